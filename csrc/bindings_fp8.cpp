// Torch bindings of fp8_amax.cu (registered by bindings.cpp's module, `register_fp8`): an
// FP8 operand's amax and scale in one launch (runtime/fp8_gemm.py ScaleState.scales), and
// delayed scaling's cast with the amax in one pass (ScaleState.cast_delayed). fp8_cast and
// fp8_scale are bound in bindings.cpp.
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

// Delayed scaling: (scale, 1 / scale, [fp8 x if plain], [fp8 x^T if transposed]) of x
// [rows, cols] (bf16, contiguous, both multiples of 8) at past's scale, x's amax recorded
// into pending (fp8_amax.cu launch_fp8_cast_delayed).
std::vector<Tensor> fp8_cast_delayed(const Tensor& x, const Tensor& work,
                                     const std::optional<Tensor>& pending, const Tensor& past,
                                     double top, int64_t fmt, bool plain, bool transposed) {
  check(x, "x", at::kBFloat16, x);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, cols]");
  check(work, "work", at::kInt, x);
  TORCH_CHECK(work.numel() == 2, "work must hold two ints");
  check(past, "past", at::kFloat, x);
  TORCH_CHECK(past.numel() == 1, "past must hold one value");
  if (pending) {
    check(*pending, "pending", at::kFloat, x);
    TORCH_CHECK(pending->numel() == 1, "pending must hold one value");
  }
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (E4M3) or 1 (E5M2)");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto options = x.options().dtype(at::kFloat);
  const auto fp8 = x.options().dtype(fmt == 0 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2);
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

}  // namespace

void register_fp8(pybind11::module_& m) {
  m.def("fp8_cast_delayed", &fp8_cast_delayed,
        "(x [rows, cols] bf16, work int32 [2] zero, pending fp32 [] or None, past fp32 [], top, "
        "fmt 0 E4M3 / 1 E5M2, plain, transposed) -> [scale, 1 / scale, fp8 x if plain, fp8 "
        "x^T if transposed]  (delayed scaling: the cast and x's amax in one pass)",
        pybind11::arg("x"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"), pybind11::arg("fmt"),
        pybind11::arg("plain"), pybind11::arg("transposed"));
  m.def("fp8_amax_scale", &fp8_amax_scale,
        "(x bf16/fp32 contiguous, work int32 [2] zero, pending fp32 [] or None, past fp32 [] "
        "or None, top) -> [scale, 1 / scale]  (fp8_scale of max |x|, one launch)",
        pybind11::arg("x"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"));
}

}  // namespace bind
}  // namespace modulec
