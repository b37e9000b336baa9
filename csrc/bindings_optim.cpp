// Torch bindings of adamw.cu (registered by bindings.cpp's module, `register_optim`): one
// tensor's AdamW step on a fp32 master (adamw_step) or a split one (adamw_split_step), and
// the split-master update of several tensors in one launch (adamw_split_list;
// runtime/cuda/step_optim.py `AdamWBatch`: LoRA's adapters, 14 small tensors a layer).
#include <c10/cuda/CUDAGuard.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

// What an AdamW step reads beside its master, checked against `master` (the fp32 master,
// or the split master's top half): the gradient (bf16 or fp32), both fp32 moments and the
// step count (a fp32 [] or [1] device tensor), each of the master's size.
void check_adamw_inputs(const Tensor& master, const Tensor& grad, const Tensor& exp_avg,
                        const Tensor& exp_avg_sq, const Tensor& step) {
  check(exp_avg, "exp_avg", at::kFloat, master);
  check(exp_avg_sq, "exp_avg_sq", at::kFloat, master);
  check(grad, "grad", grad.scalar_type(), master);
  check(step, "step", at::kFloat, master);
  TORCH_CHECK(step.numel() == 1, "step must have one element");
  const int64_t n = master.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
              "the master, grad and moments differ in size");
}

// The optional device scalars of an AdamW step (fp32, one element, on the master's
// device): lr_now, the learning rate the `lr` argument multiplies, and grad_scale, the
// factor every gradient element is multiplied by first.
void check_adamw_scalars(const Tensor& master, const std::optional<Tensor>& lr_now,
                         const std::optional<Tensor>& grad_scale) {
  for (const auto* t : {&lr_now, &grad_scale}) {
    if (!t->has_value()) continue;
    check(**t, t == &lr_now ? "lr_now" : "grad_scale", at::kFloat, master);
    TORCH_CHECK((*t)->numel() == 1, "lr_now and grad_scale must have one element");
  }
}

const float* scalar_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// An AdamW step's optional `norm_sq`: a one-element fp64 device tensor the gradient's
// squares are added to (csrc/kernels/adamw.cu), or null.
double* norm_sq_ptr(const Tensor& master, const std::optional<Tensor>& norm_sq) {
  if (!norm_sq.has_value()) return nullptr;
  check(*norm_sq, "norm_sq", at::kDouble, master);
  TORCH_CHECK(norm_sq->numel() == 1, "norm_sq must have one element");
  return norm_sq->data_ptr<double>();
}

// One AdamW step of a fp32 master (in place, with its fp32 moments) from a bf16 or fp32
// gradient; writes the bf16 compute copy when given.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                const Tensor& exp_avg_sq, const std::optional<Tensor>& compute,
                const Tensor& step, double lr, double beta1, double beta2, double eps,
                double weight_decay, const std::optional<Tensor>& lr_now,
                const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& norm_sq) {
  check(param, "param", at::kFloat, param);
  check_adamw_inputs(param, grad, exp_avg, exp_avg_sq, step);
  check_adamw_scalars(param, lr_now, grad_scale);
  if (compute) {
    check(*compute, "compute", at::kBFloat16, param);
    TORCH_CHECK(compute->numel() == param.numel(), "compute differs in size");
  }
  const c10::cuda::CUDAGuard guard(param.device());
  check_launch(modulec::launch_adamw(dtype_of(grad), param.data_ptr<float>(), grad.data_ptr(),
                                     exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                                     compute ? compute->data_ptr() : nullptr,
                                     step.data_ptr<float>(), param.numel(),
                                     static_cast<float>(lr), static_cast<float>(beta1),
                                     static_cast<float>(beta2), static_cast<float>(eps),
                                     static_cast<float>(weight_decay), scalar_ptr(lr_now),
                                     scalar_ptr(grad_scale), stream(),
                                     norm_sq_ptr(param, norm_sq)),
               "adamw");
}

// The same step on a master split in halves: hi (bf16, the compute copy) and lo (int16),
// bits(master) = bits(hi) * 2^16 + lo (csrc/kernels/adamw.cu), both updated in place.
void adamw_split_step(const Tensor& hi, const Tensor& lo, const Tensor& grad,
                      const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& step,
                      double lr, double beta1, double beta2, double eps, double weight_decay,
                      const std::optional<Tensor>& lr_now,
                      const std::optional<Tensor>& grad_scale,
                      const std::optional<Tensor>& norm_sq) {
  check(hi, "hi", at::kBFloat16, hi);
  check(lo, "lo", at::kShort, hi);
  TORCH_CHECK(lo.numel() == hi.numel(), "hi and lo differ in size");
  check_adamw_inputs(hi, grad, exp_avg, exp_avg_sq, step);
  check_adamw_scalars(hi, lr_now, grad_scale);
  const c10::cuda::CUDAGuard guard(hi.device());
  check_launch(modulec::launch_adamw_split(
                   dtype_of(grad), hi.data_ptr(), lo.data_ptr<int16_t>(), grad.data_ptr(),
                   exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                   step.data_ptr<float>(), hi.numel(), static_cast<float>(lr),
                   static_cast<float>(beta1), static_cast<float>(beta2),
                   static_cast<float>(eps), static_cast<float>(weight_decay),
                   scalar_ptr(lr_now), scalar_ptr(grad_scale), stream(),
                   norm_sq_ptr(hi, norm_sq)),
               "adamw split");
}

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
  check_adamw_scalars(like, lr_now, grad_scale);
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
  double* norm_sq_at = norm_sq_ptr(like, norm_sq);
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
                                         static_cast<float>(eps), scalar_ptr(lr_now),
                                         scalar_ptr(grad_scale), stream(), norm_sq_at),
                 "adamw split list");
  }
}

}  // namespace

void register_optim(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("adamw_step", &adamw_step,
        "(param fp32, grad bf16/fp32, exp_avg, exp_avg_sq, compute bf16 or None, step, lr, "
        "beta1, beta2, eps, weight_decay, lr_now=None, grad_scale=None, norm_sq=None): "
        "lr_now, a fp32 device scalar the lr multiplies; grad_scale, one the gradient is "
        "multiplied by; norm_sq, a fp64 device scalar the gradient's squares are added to",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("compute"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("lr_now") = py::none(), py::arg("grad_scale") = py::none(),
        py::arg("norm_sq") = py::none());
  m.def("adamw_split_step", &adamw_split_step,
        "(hi bf16 compute copy, lo int16, grad bf16/fp32, exp_avg, exp_avg_sq, step, lr, "
        "beta1, beta2, eps, weight_decay, lr_now=None, grad_scale=None, norm_sq=None): the "
        "master is bits(hi) * 2^16 + lo; norm_sq as adamw_step's",
        py::arg("hi"), py::arg("lo"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("lr_now") = py::none(), py::arg("grad_scale") = py::none(),
        py::arg("norm_sq") = py::none());
  m.def("adamw_split_list", &adamw_split_list,
        "(hi [bf16], lo [int16], grad [bf16/fp32], exp_avg [fp32], exp_avg_sq [fp32], step, "
        "lr [float], weight_decay [float], beta1, beta2, eps, lr_now=None, grad_scale=None, "
        "norm_sq=None): adamw_split_step of each tensor k (its rate factor lr[k], its weight "
        "decay), up to 16 tensors a launch; norm_sq (fp64 [1]) gets every gradient's squares",
        py::arg("hi"), py::arg("lo"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"),
        py::arg("lr"), py::arg("weight_decay"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("lr_now") = py::none(),
        py::arg("grad_scale") = py::none(),
        py::arg("norm_sq") = py::none());
}

}  // namespace bind
}  // namespace modulec
