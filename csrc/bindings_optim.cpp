// Torch binding of adamw.cu's list form (registered by bindings.cpp's module,
// `register_optim`): the split-master AdamW update of several tensors in one launch
// (runtime/cuda/step_optim.py `AdamWBatch`: LoRA's adapters, 14 small tensors a layer).
// adamw_step and adamw_split_step (one tensor a launch) are bound in bindings.cpp.
#include <c10/cuda/CUDAGuard.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

// hi[k] bf16 and lo[k] int16 (the split master), grad[k] (one dtype for all, bf16 or
// fp32), exp_avg[k] / exp_avg_sq[k] fp32, all contiguous on one device, each of hi[k]'s
// size; lr[k] the rate factor (times lr_now when given), weight_decay[k]; step, lr_now
// and grad_scale one-element fp32 device tensors. Launches of up to kAdamWListMax.
void adamw_split_list(const std::vector<Tensor>& hi, const std::vector<Tensor>& lo,
                      const std::vector<Tensor>& grad, const std::vector<Tensor>& exp_avg,
                      const std::vector<Tensor>& exp_avg_sq, const Tensor& step,
                      const std::vector<double>& lr, const std::vector<double>& weight_decay,
                      double beta1, double beta2, double eps,
                      const std::optional<Tensor>& lr_now,
                      const std::optional<Tensor>& grad_scale,
                      const std::optional<Tensor>& norm_sq) {
  const size_t count = hi.size();
  TORCH_CHECK(lo.size() == count && grad.size() == count && exp_avg.size() == count &&
                  exp_avg_sq.size() == count && lr.size() == count &&
                  weight_decay.size() == count,
              "adamw_split_list: the lists differ in length");
  if (count == 0) return;
  const Tensor& like = hi[0];
  check(step, "step", at::kFloat, like);
  TORCH_CHECK(step.numel() == 1, "step must have one element");
  for (const auto* t : {&lr_now, &grad_scale}) {
    if (!t->has_value()) continue;
    check(**t, t == &lr_now ? "lr_now" : "grad_scale", at::kFloat, like);
    TORCH_CHECK((*t)->numel() == 1, "lr_now and grad_scale must have one element");
  }
  const DType grad_dt = dtype_of(grad[0]);
  for (size_t k = 0; k < count; ++k) {
    check(hi[k], "hi", at::kBFloat16, like);
    check(lo[k], "lo", at::kShort, like);
    check(grad[k], "grad", grad[0].scalar_type(), like);
    check(exp_avg[k], "exp_avg", at::kFloat, like);
    check(exp_avg_sq[k], "exp_avg_sq", at::kFloat, like);
    const int64_t n = hi[k].numel();
    TORCH_CHECK(lo[k].numel() == n && grad[k].numel() == n && exp_avg[k].numel() == n &&
                    exp_avg_sq[k].numel() == n,
                "adamw_split_list: tensor ", k, "'s master, grad and moments differ in size");
  }
  const c10::cuda::CUDAGuard guard(like.device());
  const float* lr_now_ptr = lr_now ? lr_now->data_ptr<float>() : nullptr;
  const float* scale_ptr = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
  double* norm_sq_ptr = nullptr;  // the gradients' squares added to it (adamw.cu)
  if (norm_sq.has_value()) {
    check(*norm_sq, "norm_sq", at::kDouble, like);
    TORCH_CHECK(norm_sq->numel() == 1, "norm_sq must have one element");
    norm_sq_ptr = norm_sq->data_ptr<double>();
  }
  for (size_t start = 0; start < count; start += kAdamWListMax) {
    AdamWSplitList list{};
    list.count = static_cast<int>(std::min<size_t>(kAdamWListMax, count - start));
    for (int j = 0; j < list.count; ++j) {
      const size_t k = start + j;
      list.hi[j] = hi[k].data_ptr();
      list.lo[j] = lo[k].data_ptr<int16_t>();
      list.grad[j] = grad[k].data_ptr();
      list.exp_avg[j] = exp_avg[k].data_ptr<float>();
      list.exp_avg_sq[j] = exp_avg_sq[k].data_ptr<float>();
      list.n[j] = hi[k].numel();
      list.lr[j] = static_cast<float>(lr[k]);
      list.weight_decay[j] = static_cast<float>(weight_decay[k]);
    }
    check_launch(launch_adamw_split_list(grad_dt, list, step.data_ptr<float>(),
                                         static_cast<float>(beta1), static_cast<float>(beta2),
                                         static_cast<float>(eps), lr_now_ptr, scale_ptr,
                                         stream(), norm_sq_ptr),
                 "adamw split list");
  }
}

}  // namespace

void register_optim(pybind11::module_& m) {
  m.def("adamw_split_list", &adamw_split_list,
        "(hi [bf16], lo [int16], grad [bf16/fp32], exp_avg [fp32], exp_avg_sq [fp32], step, "
        "lr [float], weight_decay [float], beta1, beta2, eps, lr_now=None, grad_scale=None, "
        "norm_sq=None): adamw_split_step of each tensor k (its rate factor lr[k], its weight "
        "decay), up to 16 tensors a launch; norm_sq (fp64 [1]) gets every gradient's squares",
        pybind11::arg("hi"), pybind11::arg("lo"), pybind11::arg("grad"),
        pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"), pybind11::arg("step"),
        pybind11::arg("lr"), pybind11::arg("weight_decay"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("lr_now") = pybind11::none(),
        pybind11::arg("grad_scale") = pybind11::none(),
        pybind11::arg("norm_sq") = pybind11::none());
}

}  // namespace bind
}  // namespace modulec
