// The torch extension over csrc/kernels: checks device, dtype, contiguity and shapes,
// allocates the outputs with torch's caching allocator and launches on the current stream.
// runtime/cuda/build.py compiles it; runtime/cuda/kernels.py calls it (and decides when a
// call falls back to the reference kernel, so a check failing here is a caller's bug).
#include <optional>
#include <vector>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "kernels/kernels.h"

namespace {

using at::Tensor;
using modulec::DType;

DType dtype_of(const Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::BF16;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "modulec CUDA kernels take bf16 or fp32, got ",
              t.scalar_type());
  return DType::F32;
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", not ", like.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// x [*, C] as rows x C; rstd has the leading dims
std::vector<int64_t> leading(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "expected at least one dim");
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

std::vector<Tensor> norm_forward(const Tensor& x, const std::optional<Tensor>& input,
                                 const Tensor& weight, double eps) {
  const auto dt = x.scalar_type();
  check(x, "x", dt, x);
  check(weight, "weight", dt, x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "weight must be [", C, "]");
  if (input) {
    check(*input, "input", dt, x);
    TORCH_CHECK(input->sizes() == x.sizes(), "residual and input differ in shape");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty_like(x);
  Tensor residual_out = input ? at::empty_like(x) : Tensor();
  Tensor rstd = at::empty(leading(x), x.options().dtype(at::kFloat));
  const int64_t rows = C ? x.numel() / C : 0;
  check_launch(modulec::launch_rmsnorm_forward(
                   dtype_of(x), x.data_ptr(), input ? input->data_ptr() : nullptr,
                   weight.data_ptr(), input ? residual_out.data_ptr() : nullptr, y.data_ptr(),
                   rstd.data_ptr<float>(), rows, C, static_cast<float>(eps), stream()),
               "rmsnorm forward");
  if (input) return {residual_out, y, rstd};
  return {y, rstd};
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps) {
  return norm_forward(x, std::nullopt, weight, eps);
}

// residual_out = residual + input, then rmsnorm of it: (residual_out, y, rstd)
std::vector<Tensor> fused_residual_rmsnorm_forward(const Tensor& residual, const Tensor& input,
                                                   const Tensor& weight, double eps) {
  return norm_forward(residual, input, weight, eps);
}

// (d_x, d_weight); with d_residual_out, d_x is the fused backward's g = d_residual_out + d_x
std::vector<Tensor> rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& weight,
                                     const Tensor& rstd,
                                     const std::optional<Tensor>& d_residual_out) {
  const auto dt = x.scalar_type();
  check(x, "x", dt, x);
  check(d_y, "d_y", dt, x);
  check(weight, "weight", dt, x);
  check(rstd, "rstd", at::kFloat, x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(d_y.sizes() == x.sizes(), "d_y and x differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "weight must be [", C, "]");
  TORCH_CHECK(rstd.sizes() == at::IntArrayRef(leading(x)), "rstd must have x's leading dims");
  if (d_residual_out) {
    check(*d_residual_out, "d_residual_out", dt, x);
    TORCH_CHECK(d_residual_out->sizes() == x.sizes(), "d_residual_out and x differ in shape");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = C ? x.numel() / C : 0;
  Tensor d_x = at::empty_like(x);
  Tensor d_weight = at::empty_like(weight);
  Tensor work = at::empty({modulec::rmsnorm_backward_workspace(dtype_of(x), rows, C)},
                          x.options().dtype(at::kFloat));
  check_launch(modulec::launch_rmsnorm_backward(
                   dtype_of(x), d_y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                   rstd.data_ptr<float>(), d_residual_out ? d_residual_out->data_ptr() : nullptr,
                   d_x.data_ptr(), d_weight.data_ptr(), work.data_ptr<float>(), rows, C,
                   stream()),
               "rmsnorm backward");
  return {d_x, d_weight};
}

Tensor swiglu_forward(const Tensor& gate, const Tensor& up) {
  check(gate, "gate", gate.scalar_type(), gate);
  check(up, "up", gate.scalar_type(), gate);
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor y = at::empty_like(gate);
  check_launch(modulec::launch_swiglu_forward(dtype_of(gate), gate.data_ptr(), up.data_ptr(),
                                              y.data_ptr(), gate.numel(), stream()),
               "swiglu forward");
  return y;
}

std::vector<Tensor> swiglu_backward(const Tensor& d_y, const Tensor& gate, const Tensor& up) {
  check(gate, "gate", gate.scalar_type(), gate);
  check(up, "up", gate.scalar_type(), gate);
  check(d_y, "d_y", gate.scalar_type(), gate);
  TORCH_CHECK(gate.sizes() == up.sizes() && d_y.sizes() == gate.sizes(),
              "d_y, gate and up differ in shape");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor d_gate = at::empty_like(gate), d_up = at::empty_like(gate);
  check_launch(modulec::launch_swiglu_backward(dtype_of(gate), d_y.data_ptr(), gate.data_ptr(),
                                               up.data_ptr(), d_gate.data_ptr(), d_up.data_ptr(),
                                               gate.numel(), stream()),
               "swiglu backward");
  return {d_gate, d_up};
}

// x [B, H, T, D] rotated (inverse: the backward); position_ids int32 [B or 1, T] or None
Tensor rope(const Tensor& x, const std::optional<Tensor>& position_ids, double theta,
            bool inverse) {
  check(x, "x", x.scalar_type(), x);
  TORCH_CHECK(x.dim() == 4, "rope takes [B, H, T, D]");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "rope: head dim D=", D, " must be even");
  int64_t pos_stride = 0;
  if (position_ids) {
    check(*position_ids, "position_ids", at::kInt, x);
    const auto& p = *position_ids;
    TORCH_CHECK(p.dim() == 2 && p.size(1) == T && (p.size(0) == B || p.size(0) == 1),
                "position_ids must be [B, T] or [1, T]");
    pos_stride = p.size(0) == 1 ? 0 : T;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty_like(x);
  check_launch(modulec::launch_rope(dtype_of(x), x.data_ptr(), out.data_ptr(),
                                    position_ids ? position_ids->data_ptr<int32_t>() : nullptr,
                                    pos_stride, B, H, T, D, static_cast<float>(theta), inverse,
                                    stream()),
               "rope");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "modulec CUDA kernels (csrc/kernels)";
  m.def("rmsnorm_forward", &rmsnorm_forward, "(x, weight, eps) -> [y, rstd]");
  m.def("fused_residual_rmsnorm_forward", &fused_residual_rmsnorm_forward,
        "(residual, input, weight, eps) -> [residual_out, y, rstd]");
  m.def("rmsnorm_backward", &rmsnorm_backward,
        "(d_y, x, weight, rstd, d_residual_out or None) -> [d_x, d_weight]");
  m.def("swiglu_forward", &swiglu_forward, "(gate, up) -> y");
  m.def("swiglu_backward", &swiglu_backward, "(d_y, gate, up) -> [d_gate, d_up]");
  m.def("rope", &rope, "(x [B, H, T, D], position_ids or None, theta, inverse) -> rotated x");
}
