// Torch bindings of layernorm.cu, gelu.cu and softmax.cu (registered by bindings.cpp's
// module): the same checks, output placement (`out`: the arena's planned bytes) and stream
// as bindings.cpp's; runtime/cuda/kernels.py decides when a call falls back to the
// reference, so a check failing here is a caller's bug.
#include <c10/cuda/CUDAGuard.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

namespace py = pybind11;

void check_vector(const Tensor& t, const char* name, const Tensor& x, int64_t C) {
  check(t, name, x.scalar_type(), x);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == C, name, " must be [", C, "]");
}

void check_stats(const Tensor& t, const char* name, const Tensor& x) {
  check(t, name, at::kFloat, x);
  TORCH_CHECK(t.sizes() == at::IntArrayRef(leading(x)), name, " must have x's leading dims");
}

// outputs in the primitive's order: (residual_out,) y, mean, rstd
std::vector<Tensor> ln_forward(const Tensor& x, const std::optional<Tensor>& input,
                               const Tensor& weight, const std::optional<Tensor>& bias,
                               double eps, const Outputs& out) {
  check(x, "x", x.scalar_type(), x);
  const int64_t C = x.size(-1);
  check_vector(weight, "weight", x, C);
  if (bias) check_vector(*bias, "bias", x, C);
  if (input) {
    check(*input, "input", x.scalar_type(), x);
    TORCH_CHECK(input->sizes() == x.sizes(), "residual and input differ in shape");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const size_t first = input ? 1 : 0;
  Tensor residual_out = input ? output(out, 0, x.sizes(), x.options()) : Tensor();
  Tensor y = output(out, first, x.sizes(), x.options());
  const auto stats = x.options().dtype(at::kFloat);
  Tensor mean = output(out, first + 1, leading(x), stats);
  Tensor rstd = output(out, first + 2, leading(x), stats);
  const int64_t rows = C ? x.numel() / C : 0;
  check_launch(launch_layernorm_forward(
                   dtype_of(x), x.data_ptr(), input ? input->data_ptr() : nullptr,
                   weight.data_ptr(), bias ? bias->data_ptr() : nullptr,
                   input ? residual_out.data_ptr() : nullptr, y.data_ptr(),
                   mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, C,
                   static_cast<float>(eps), stream()),
               "layernorm forward");
  if (input) return {residual_out, y, mean, rstd};
  return {y, mean, rstd};
}

std::vector<Tensor> layernorm_forward(const Tensor& x, const Tensor& weight,
                                      const std::optional<Tensor>& bias, double eps,
                                      const Outputs& out) {
  return ln_forward(x, std::nullopt, weight, bias, eps, out);
}

// residual_out = residual + input, then layernorm of it: (residual_out, y, mean, rstd)
std::vector<Tensor> fused_residual_layernorm_forward(const Tensor& residual, const Tensor& input,
                                                     const Tensor& weight,
                                                     const std::optional<Tensor>& bias,
                                                     double eps, const Outputs& out) {
  return ln_forward(residual, input, weight, bias, eps, out);
}

// (d_x, d_weight) and d_bias when with_bias; with d_residual_out, d_x is the fused
// backward's d_residual_out + d_x
std::vector<Tensor> layernorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& weight,
                                       const Tensor& mean, const Tensor& rstd,
                                       const std::optional<Tensor>& d_residual_out,
                                       bool with_bias, const Outputs& out) {
  check(x, "x", x.scalar_type(), x);
  check(d_y, "d_y", x.scalar_type(), x);
  TORCH_CHECK(d_y.sizes() == x.sizes(), "d_y and x differ in shape");
  const int64_t C = x.size(-1);
  check_vector(weight, "weight", x, C);
  check_stats(mean, "mean", x);
  check_stats(rstd, "rstd", x);
  if (d_residual_out) {
    check(*d_residual_out, "d_residual_out", x.scalar_type(), x);
    TORCH_CHECK(d_residual_out->sizes() == x.sizes(), "d_residual_out and x differ in shape");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = C ? x.numel() / C : 0;
  Tensor d_x = output(out, 0, x.sizes(), x.options());
  Tensor d_weight = at::empty_like(weight);
  Tensor d_bias = with_bias ? at::empty_like(weight) : Tensor();
  Tensor work = at::empty({layernorm_backward_workspace(dtype_of(x), rows, C)},
                          x.options().dtype(at::kFloat));
  check_launch(launch_layernorm_backward(
                   dtype_of(x), d_y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                   mean.data_ptr<float>(), rstd.data_ptr<float>(),
                   d_residual_out ? d_residual_out->data_ptr() : nullptr, d_x.data_ptr(),
                   d_weight.data_ptr(), with_bias ? d_bias.data_ptr() : nullptr,
                   work.data_ptr<float>(), rows, C, stream()),
               "layernorm backward");
  if (with_bias) return {d_x, d_weight, d_bias};
  return {d_x, d_weight};
}

Tensor gelu_forward(const Tensor& x, bool approximate, const Outputs& out) {
  check(x, "x", x.scalar_type(), x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = output(out, 0, x.sizes(), x.options());
  check_launch(launch_gelu_forward(dtype_of(x), x.data_ptr(), y.data_ptr(), x.numel(),
                                   approximate, stream()),
               "gelu forward");
  return y;
}

Tensor gelu_backward(const Tensor& d_y, const Tensor& x, bool approximate, const Outputs& out) {
  check(x, "x", x.scalar_type(), x);
  check(d_y, "d_y", x.scalar_type(), x);
  TORCH_CHECK(d_y.sizes() == x.sizes(), "d_y and x differ in shape");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor d_x = output(out, 0, x.sizes(), x.options());
  check_launch(launch_gelu_backward(dtype_of(x), d_y.data_ptr(), x.data_ptr(), d_x.data_ptr(),
                                    x.numel(), approximate, stream()),
               "gelu backward");
  return d_x;
}

int64_t rows_of(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "softmax takes at least one dim");
  return x.size(-1) ? x.numel() / x.size(-1) : 0;
}

// softmax over the last dim
Tensor softmax_forward(const Tensor& x, const Outputs& out) {
  check(x, "x", x.scalar_type(), x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = output(out, 0, x.sizes(), x.options());
  check_launch(launch_softmax_forward(dtype_of(x), x.data_ptr(), y.data_ptr(), rows_of(x),
                                      x.size(-1), stream()),
               "softmax forward");
  return y;
}

Tensor softmax_backward(const Tensor& d_y, const Tensor& y, const Outputs& out) {
  check(y, "y", y.scalar_type(), y);
  check(d_y, "d_y", y.scalar_type(), y);
  TORCH_CHECK(d_y.sizes() == y.sizes(), "d_y and y differ in shape");
  const c10::cuda::CUDAGuard guard(y.device());
  Tensor d_x = output(out, 0, y.sizes(), y.options());
  check_launch(launch_softmax_backward(dtype_of(y), d_y.data_ptr(), y.data_ptr(), d_x.data_ptr(),
                                       rows_of(y), y.size(-1), stream()),
               "softmax backward");
  return d_x;
}

}  // namespace

void register_fusions(py::module_& m) {
  m.def("layernorm_forward", &layernorm_forward,
        "(x, weight, bias or None, eps, out=[]) -> [y, mean, rstd]", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("out") = Outputs());
  m.def("fused_residual_layernorm_forward", &fused_residual_layernorm_forward,
        "(residual, input, weight, bias or None, eps, out=[]) -> [residual_out, y, mean, rstd]",
        py::arg("residual"), py::arg("input"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("out") = Outputs());
  m.def("layernorm_backward", &layernorm_backward,
        "(d_y, x, weight, mean, rstd, d_residual_out or None, with_bias, out=[]) -> [d_x, "
        "d_weight(, d_bias)]",
        py::arg("d_y"), py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"),
        py::arg("d_residual_out"), py::arg("with_bias"), py::arg("out") = Outputs());
  m.def("gelu_forward", &gelu_forward, "(x, approximate, out=[]) -> gelu(x)", py::arg("x"),
        py::arg("approximate"), py::arg("out") = Outputs());
  m.def("gelu_backward", &gelu_backward, "(d_y, x, approximate, out=[]) -> d_x",
        py::arg("d_y"), py::arg("x"), py::arg("approximate"), py::arg("out") = Outputs());
  m.def("softmax_forward", &softmax_forward, "(x, out=[]) -> softmax over the last dim",
        py::arg("x"), py::arg("out") = Outputs());
  m.def("softmax_backward", &softmax_backward, "(d_y, y, out=[]) -> d_x", py::arg("d_y"),
        py::arg("y"), py::arg("out") = Outputs());
}

}  // namespace bind
}  // namespace modulec
