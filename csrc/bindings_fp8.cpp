// Torch binding of fp8_amax.cu (registered by bindings.cpp's module, `register_fp8`): an
// FP8 operand's amax and scale in one launch (runtime/fp8_gemm.py ScaleState.scales).
// fp8_cast and fp8_scale are bound in bindings.cpp.
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

}  // namespace

void register_fp8(pybind11::module_& m) {
  m.def("fp8_amax_scale", &fp8_amax_scale,
        "(x bf16/fp32 contiguous, work int32 [2] zero, pending fp32 [] or None, past fp32 [] "
        "or None, top) -> [scale, 1 / scale]  (fp8_scale of max |x|, one launch)",
        pybind11::arg("x"), pybind11::arg("work"), pybind11::arg("pending"),
        pybind11::arg("past"), pybind11::arg("top"));
}

}  // namespace bind
}  // namespace modulec
