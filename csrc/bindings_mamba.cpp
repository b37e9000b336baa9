// The torch bindings of csrc/kernels/mamba.cu (mamba_conv1d, mamba_selective_scan),
// registered into the extension by bindings.cpp (`register_mamba`). runtime/cuda/mamba.py
// calls them with contiguous CUDA activations of one dtype (bf16 or fp32) and the small
// per-channel tensors already in fp32; a failing check here is a caller's bug.
#include <optional>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernels/mamba.h"

namespace {

using at::Tensor;
using modulec::DType;

DType io_dtype(const Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::BF16;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "the mamba kernels take bf16 or fp32, got ",
              t.scalar_type());
  return DType::F32;
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, const Tensor& like,
           at::IntArrayRef sizes) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == sizes, name, " is ", t.sizes(), ", expected ", sizes);
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

struct Conv {
  int64_t B, D, T, W;
};

Conv conv_sizes(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                const std::optional<Tensor>& state) {
  TORCH_CHECK(x.dim() == 3, "x must be [B, D, T]");
  const Conv c{x.size(0), x.size(1), x.size(2), weight.size(-1)};
  check(x, "x", x.scalar_type(), x, x.sizes());
  check(weight, "weight", at::kFloat, x, {c.D, c.W});
  if (bias) check(*bias, "bias", at::kFloat, x, {c.D});
  if (state) check(*state, "conv_state", x.scalar_type(), x, {c.B, c.D, c.W - 1});
  return c;
}

// y = act(conv(x)) [B, D, T]; weight fp32 [D, W], bias fp32 [D] or None
Tensor mamba_conv1d_forward(const Tensor& x, const Tensor& weight,
                            const std::optional<Tensor>& bias,
                            const std::optional<Tensor>& state, bool silu) {
  const Conv c = conv_sizes(x, weight, bias, state);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty_like(x);
  check_launch(modulec::launch_mamba_conv1d_forward(
                   io_dtype(x), x.data_ptr(), weight.data_ptr<float>(),
                   bias ? bias->data_ptr<float>() : nullptr, state ? state->data_ptr() : nullptr,
                   y.data_ptr(), c.B, c.D, c.T, static_cast<int>(c.W), silu, stream()),
               "mamba_conv1d forward");
  return y;
}

// [d_x, partial fp32 [B, D, W + 1]] (d_weight and d_bias per batch row)
std::vector<Tensor> mamba_conv1d_backward(const Tensor& d_y, const Tensor& x,
                                          const Tensor& weight,
                                          const std::optional<Tensor>& bias,
                                          const std::optional<Tensor>& state, bool silu) {
  const Conv c = conv_sizes(x, weight, bias, state);
  check(d_y, "d_y", x.scalar_type(), x, x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor d_x = at::empty_like(x);
  Tensor partial = at::empty({c.B, c.D, c.W + 1}, x.options().dtype(at::kFloat));
  check_launch(modulec::launch_mamba_conv1d_backward(
                   io_dtype(x), d_y.data_ptr(), x.data_ptr(), weight.data_ptr<float>(),
                   bias ? bias->data_ptr<float>() : nullptr, state ? state->data_ptr() : nullptr,
                   d_x.data_ptr(), partial.data_ptr<float>(), c.B, c.D, c.T,
                   static_cast<int>(c.W), silu, stream()),
               "mamba_conv1d backward");
  return {d_x, partial};
}

modulec::MambaScan scan_inputs(const Tensor& u, const Tensor& delta, const Tensor& A,
                               const Tensor& B, const Tensor& C, const Tensor& D,
                               const Tensor& dt_bias, const std::optional<Tensor>& state) {
  TORCH_CHECK(u.dim() == 3 && B.dim() == 4, "u must be [batch, channels, T], B [batch, G, N, T]");
  modulec::MambaScan s;
  s.batch = u.size(0);
  s.channels = u.size(1);
  s.T = u.size(2);
  s.groups = B.size(1);
  s.N = B.size(2);
  TORCH_CHECK(s.groups > 0 && s.channels % s.groups == 0, "channels must be a multiple of G");
  const auto dt = u.scalar_type();
  check(u, "u", dt, u, u.sizes());
  check(delta, "delta", dt, u, u.sizes());
  check(B, "B", dt, u, {s.batch, s.groups, s.N, s.T});
  check(C, "C", dt, u, {s.batch, s.groups, s.N, s.T});
  check(A, "A", at::kFloat, u, {s.channels, s.N});
  check(D, "D", at::kFloat, u, {s.channels});
  check(dt_bias, "dt_bias", at::kFloat, u, {s.channels});
  if (state) check(*state, "ssm_state", at::kFloat, u, {s.batch, s.channels, s.N});
  s.u = u.data_ptr();
  s.delta = delta.data_ptr();
  s.A = A.data_ptr<float>();
  s.B = B.data_ptr();
  s.C = C.data_ptr();
  s.D = D.data_ptr<float>();
  s.dt_bias = dt_bias.data_ptr<float>();
  s.state = state ? state->data_ptr<float>() : nullptr;
  return s;
}

// [y, last state fp32 [batch, channels, N]]; A, D, dt_bias and ssm_state fp32
std::vector<Tensor> mamba_scan_forward(const Tensor& u, const Tensor& delta, const Tensor& A,
                                       const Tensor& B, const Tensor& C, const Tensor& D,
                                       const Tensor& dt_bias,
                                       const std::optional<Tensor>& state) {
  const modulec::MambaScan s = scan_inputs(u, delta, A, B, C, D, dt_bias, state);
  const c10::cuda::CUDAGuard guard(u.device());
  Tensor y = at::empty_like(u);
  Tensor last = at::empty({s.batch, s.channels, s.N}, u.options().dtype(at::kFloat));
  check_launch(modulec::launch_mamba_scan_forward(io_dtype(u), s, y.data_ptr(),
                                                  last.data_ptr<float>(), stream()),
               "mamba_selective_scan forward");
  return {y, last};
}

// [d_u, d_delta, d_A partial fp32 [batch, channels, N], d_B fp32, d_C fp32, d_D partial
// fp32 [batch, channels], d_dt_bias partial fp32 [batch, channels]]
std::vector<Tensor> mamba_scan_backward(const Tensor& d_y, const Tensor& u, const Tensor& delta,
                                        const Tensor& A, const Tensor& B, const Tensor& C,
                                        const Tensor& D, const Tensor& dt_bias,
                                        const std::optional<Tensor>& state, int64_t chunk) {
  const modulec::MambaScan s = scan_inputs(u, delta, A, B, C, D, dt_bias, state);
  check(d_y, "d_y", u.scalar_type(), u, u.sizes());
  TORCH_CHECK(s.N <= 256, "mamba_selective_scan backward: N (", s.N, ") above 256");
  const c10::cuda::CUDAGuard guard(u.device());
  const auto f32 = u.options().dtype(at::kFloat);
  Tensor d_u = at::empty_like(u), d_delta = at::empty_like(u);
  // zeros: the kernel adds into d_B / d_C, and writes nothing when T is 0
  Tensor d_A = at::zeros({s.batch, s.channels, s.N}, f32);
  Tensor d_B = at::zeros(B.sizes(), f32), d_C = at::zeros(C.sizes(), f32);
  Tensor d_D = at::zeros({s.batch, s.channels}, f32);
  Tensor d_bias = at::zeros({s.batch, s.channels}, f32);
  Tensor work = at::empty({modulec::mamba_scan_backward_workspace(s, chunk)}, f32);
  modulec::MambaScanGrads g;
  g.d_u = d_u.data_ptr();
  g.d_delta = d_delta.data_ptr();
  g.d_A = d_A.data_ptr<float>();
  g.d_B = d_B.data_ptr<float>();
  g.d_C = d_C.data_ptr<float>();
  g.d_D = d_D.data_ptr<float>();
  g.d_dt_bias = d_bias.data_ptr<float>();
  check_launch(modulec::launch_mamba_scan_backward(io_dtype(u), s, d_y.data_ptr(), chunk, g,
                                                   work.data_ptr<float>(), stream()),
               "mamba_selective_scan backward");
  return {d_u, d_delta, d_A, d_B, d_C, d_D, d_bias};
}

}  // namespace

void register_mamba(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("mamba_conv1d_forward", &mamba_conv1d_forward,
        "(x [B, D, T], weight fp32 [D, W], bias fp32 [D] or None, conv_state [B, D, W - 1] or "
        "None, silu) -> y",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("conv_state"), py::arg("silu"));
  m.def("mamba_conv1d_backward", &mamba_conv1d_backward,
        "(d_y, x, weight fp32 [D, W], bias or None, conv_state or None, silu) -> [d_x, partial "
        "fp32 [B, D, W + 1]]",
        py::arg("d_y"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("conv_state"),
        py::arg("silu"));
  m.def("mamba_scan_forward", &mamba_scan_forward,
        "(u, delta, A fp32, B, C, D fp32, dt_bias fp32, ssm_state fp32 or None) -> [y, last "
        "state fp32]",
        py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"),
        py::arg("dt_bias"), py::arg("ssm_state"));
  m.def("mamba_scan_backward", &mamba_scan_backward,
        "(d_y, u, delta, A, B, C, D, dt_bias, ssm_state or None, chunk) -> [d_u, d_delta, d_A "
        "partial, d_B fp32, d_C fp32, d_D partial, d_dt_bias partial]",
        py::arg("d_y"), py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"),
        py::arg("D"), py::arg("dt_bias"), py::arg("ssm_state"), py::arg("chunk"));
}
