// Torch bindings of fp8_amax.cu (registered by bindings.cpp's module, `register_fp8`): an
// FP8 operand's amax and scale in one launch (runtime/fp8_gemm.py ScaleState.scales), and
// delayed scaling's cast with the amax in one pass (ScaleState.cast_delayed), and the
// producers that write that cast's fp8 copy of their output themselves (RMSNorm, SwiGLU:
// runtime/cuda/fp8_producers.py). fp8_cast and fp8_scale are bound in bindings.cpp.
#include <c10/cuda/CUDAGuard.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

// (scale, 1 / scale) of x (bf16 / fp32, contiguous, any shape) from max |x|: recorded into
// `pending` (fmax) when given, `past` used instead where given and >= 0; work: int32 [2]
// on x's device, zero (left zero by each call).
std::vector<Tensor> fp8_amax_scale(const Tensor& x, const Tensor& work,
                                   const std::optional<Tensor>& pending,
                                   const std::optional<Tensor>& past, double top) {
  check(x, "x", x.scalar_type(), x);
  check(work, "work", at::kInt, x);
  TORCH_CHECK(work.numel() == 2, "work must hold two ints");
  for (const auto* t : {&pending, &past})
    if (*t) {
      check(**t, "pending / past", at::kFloat, x);
      TORCH_CHECK((*t)->numel() == 1, "pending / past must hold one value");
    }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto options = x.options().dtype(at::kFloat);
  Tensor scale = at::empty({}, options), inv_scale = at::empty({}, options);
  check_launch(launch_fp8_amax_scale(
                   dtype_of(x), x.data_ptr(), x.numel(),
                   reinterpret_cast<unsigned*>(work.data_ptr<int>()),
                   pending ? pending->data_ptr<float>() : nullptr,
                   past ? past->data_ptr<float>() : nullptr, top, scale.data_ptr<float>(),
                   inv_scale.data_ptr<float>(), stream()),
               "fp8 amax and scale");
  return {scale, inv_scale};
}

// A delayed-scaling call's state, on `like`'s device: work int32 [2], past fp32 [],
// pending fp32 [] or None (its `fmt` is checked by fp8_dtype where the output is made).
void check_delayed(const Tensor& like, const Tensor& work, const std::optional<Tensor>& pending,
                   const Tensor& past) {
  check(work, "work", at::kInt, like);
  TORCH_CHECK(work.numel() == 2, "work must hold two ints");
  check(past, "past", at::kFloat, like);
  TORCH_CHECK(past.numel() == 1, "past must hold one value");
  if (pending) {
    check(*pending, "pending", at::kFloat, like);
    TORCH_CHECK(pending->numel() == 1, "pending must hold one value");
  }
}

// Delayed scaling: (scale, 1 / scale, [fp8 x if plain], [fp8 x^T if transposed]) of x
// [rows, cols] (bf16, contiguous, both multiples of 8) at past's scale, x's amax recorded
// into pending (fp8_amax.cu launch_fp8_cast_delayed).
std::vector<Tensor> fp8_cast_delayed(const Tensor& x, const Tensor& work,
                                     const std::optional<Tensor>& pending, const Tensor& past,
                                     double top, int64_t fmt, bool plain, bool transposed) {
  check(x, "x", at::kBFloat16, x);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, cols]");
  check_delayed(x, work, pending, past);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto options = x.options().dtype(at::kFloat);
  const auto fp8 = x.options().dtype(fp8_dtype(fmt));
  const int64_t rows = x.size(0), cols = x.size(1);
  std::vector<Tensor> outs = {at::empty({}, options), at::empty({}, options)};
  Tensor out, out_t;
  if (plain) outs.push_back(out = at::empty({rows, cols}, fp8));
  if (transposed) outs.push_back(out_t = at::empty({cols, rows}, fp8));
  check_launch(launch_fp8_cast_delayed(
                   x.data_ptr(), reinterpret_cast<unsigned*>(work.data_ptr<int>()),
                   pending ? pending->data_ptr<float>() : nullptr, past.data_ptr<float>(), top,
                   static_cast<int>(fmt), outs[0].data_ptr<float>(), outs[1].data_ptr<float>(),
                   plain ? out.data_ptr() : nullptr, transposed ? out_t.data_ptr() : nullptr,
                   rows, cols, stream()),
               "fp8 delayed cast");
  return outs;
}

// The producers' delayed-scaling arguments (kernels.h Fp8Delayed) on tensors: checked, with
// scale, 1 / scale, the fp8 y [rows, cols] and, if transposed, y^T appended to `outs`.
Fp8Delayed delayed_of(const Tensor& like, int64_t rows, int64_t cols, const Tensor& work,
                      const std::optional<Tensor>& pending, const Tensor& past, double top,
                      int64_t fmt, bool transposed, std::vector<Tensor>& outs) {
  check_delayed(like, work, pending, past);
  const auto options = like.options().dtype(at::kFloat);
  const auto fp8 = like.options().dtype(fp8_dtype(fmt));
  const size_t first = outs.size();
  outs.push_back(at::empty({}, options));
  outs.push_back(at::empty({}, options));
  outs.push_back(at::empty({rows, cols}, fp8));
  if (transposed) outs.push_back(at::empty({cols, rows}, fp8));
  return Fp8Delayed{reinterpret_cast<unsigned*>(work.data_ptr<int>()),
                    pending ? pending->data_ptr<float>() : nullptr, past.data_ptr<float>(), top,
                    static_cast<int>(fmt), outs[first].data_ptr<float>(),
                    outs[first + 1].data_ptr<float>(), outs[first + 2].data_ptr(),
                    transposed ? outs[first + 3].data_ptr() : nullptr};
}

// rmsnorm (input None) or fused_residual_rmsnorm forward of x [rows, C] (bf16) writing y's
// fp8 copy under delayed scaling: [(residual_out,) y, rstd, scale, 1 / scale, fp8 y, fp8 y^T
// if transposed]; `out`: the (residual_out,) y, rstd bytes as the plain forward takes them.
std::vector<Tensor> rmsnorm_forward_fp8(const Tensor& x, const std::optional<Tensor>& input,
                                        const Tensor& weight, double eps, double offset,
                                        const Outputs& out, const Tensor& work,
                                        const std::optional<Tensor>& pending,
                                        const Tensor& past, double top, int64_t fmt,
                                        bool transposed) {
  check(x, "x", at::kBFloat16, x);
  check(weight, "weight", at::kBFloat16, x);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, C]");
  const int64_t rows = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "weight must be [", C, "]");
  if (input) {
    check(*input, "input", at::kBFloat16, x);
    TORCH_CHECK(input->sizes() == x.sizes(), "residual and input differ in shape");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const size_t first = input ? 1 : 0;
  std::vector<Tensor> outs;
  if (input) outs.push_back(output(out, 0, x.sizes(), x.options()));
  outs.push_back(output(out, first, x.sizes(), x.options()));
  outs.push_back(output(out, first + 1, {rows}, x.options().dtype(at::kFloat)));
  const Tensor y = outs[first], rstd = outs[first + 1];
  const Fp8Delayed d =
      delayed_of(x, rows, C, work, pending, past, top, fmt, transposed, outs);
  check_launch(launch_rmsnorm_forward_fp8(x.data_ptr(), input ? input->data_ptr() : nullptr,
                                          weight.data_ptr(),
                                          input ? outs[0].data_ptr() : nullptr, y.data_ptr(),
                                          rstd.data_ptr<float>(), rows, C,
                                          static_cast<float>(eps), static_cast<float>(offset),
                                          d, stream()),
               "rmsnorm forward with its fp8 copy");
  return outs;
}

// swiglu / geglu forward of gate, up [rows, C] (bf16, each rows with its own stride, the
// last dim contiguous) writing y's fp8 copy under delayed scaling: [y, scale, 1 / scale,
// fp8 y, fp8 y^T if transposed]; `out`: y's bytes (contiguous) as the plain forward takes.
std::vector<Tensor> swiglu_forward_fp8(const Tensor& gate, const Tensor& up, const Outputs& out,
                                       int64_t activation, const Tensor& work,
                                       const std::optional<Tensor>& pending,
                                       const Tensor& past, double top, int64_t fmt,
                                       bool transposed) {
  for (const auto* t : {&gate, &up}) {
    TORCH_CHECK(t->is_cuda() && t->device() == gate.device(), "gate / up must be on one GPU");
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "gate / up must be bf16");
    TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1, "gate / up must be [rows, C] rows");
  }
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  const int64_t rows = gate.size(0), C = gate.size(1);
  const c10::cuda::CUDAGuard guard(gate.device());
  std::vector<Tensor> outs = {output(out, 0, gate.sizes(), gate.options())};
  const Fp8Delayed d =
      delayed_of(gate, rows, C, work, pending, past, top, fmt, transposed, outs);
  check_launch(launch_swiglu_forward_fp8(gate.data_ptr(), gate.stride(0), up.data_ptr(),
                                         up.stride(0), outs[0].data_ptr(), rows, C,
                                         static_cast<int>(activation), d, stream()),
               "swiglu forward with its fp8 copy");
  return outs;
}

}  // namespace

void register_fp8(pybind11::module_& m) {
  m.def("fp8_cast_delayed", &fp8_cast_delayed,
        "(x [rows, cols] bf16, work int32 [2] zero, pending fp32 [] or None, past fp32 [], top, "
        "fmt 0 E4M3 / 1 E5M2, plain, transposed) -> [scale, 1 / scale, fp8 x if plain, fp8 "
        "x^T if transposed]  (delayed scaling: the cast and x's amax in one pass)",
        pybind11::arg("x"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"), pybind11::arg("fmt"),
        pybind11::arg("plain"), pybind11::arg("transposed"));
  m.def("rmsnorm_forward_fp8", &rmsnorm_forward_fp8,
        "(x [rows, C] bf16, input or None, weight, eps, offset, out, work, pending or None, "
        "past, top, fmt, transposed) -> [(residual_out,) y, rstd, scale, 1 / scale, fp8 y, "
        "fp8 y^T if transposed]  (delayed scaling: y's cast and amax in the norm's pass)",
        pybind11::arg("x"), pybind11::arg("input"), pybind11::arg("weight"),
        pybind11::arg("eps"), pybind11::arg("offset"), pybind11::arg("out"),
        pybind11::arg("work"), pybind11::arg("pending"), pybind11::arg("past"),
        pybind11::arg("top"), pybind11::arg("fmt"), pybind11::arg("transposed"));
  m.def("swiglu_forward_fp8", &swiglu_forward_fp8,
        "(gate, up [rows, C] bf16 rows, out, activation, work, pending or None, past, top, fmt, "
        "transposed) -> [y, scale, 1 / scale, fp8 y, fp8 y^T if transposed]  (delayed "
        "scaling: y's cast and amax in the activation's pass)",
        pybind11::arg("gate"), pybind11::arg("up"), pybind11::arg("out"),
        pybind11::arg("activation"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"), pybind11::arg("fmt"),
        pybind11::arg("transposed"));
  m.def("fp8_amax_scale", &fp8_amax_scale,
        "(x bf16/fp32 contiguous, work int32 [2] zero, pending fp32 [] or None, past fp32 [] "
        "or None, top) -> [scale, 1 / scale]  (fp8_scale of max |x|, one launch)",
        pybind11::arg("x"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"));
}

}  // namespace bind
}  // namespace modulec
