// The torch extension over csrc/kernels: checks device, dtype, contiguity and shapes,
// allocates the outputs with torch's caching allocator and launches on the current stream.
// runtime/cuda/build.py compiles it; runtime/cuda/kernels.py calls it (and decides when a
// call falls back to the reference kernel, so a check failing here is a caller's bug).
#include <array>
#include <optional>
#include <vector>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "bindings_common.h"
#include "kernels/kernels.h"

namespace {

using at::Tensor;
using modulec::DType;
namespace py = pybind11;
using namespace modulec::bind;

bool as_rows(const Tensor& t, int64_t& rows, int64_t& ld);
void check_rows(const Tensor& t, const char* name, at::ScalarType dtype, const Tensor& like);
Tensor output_rows(const Outputs& out, size_t i, at::IntArrayRef sizes,
                   const at::TensorOptions& options);

std::vector<Tensor> norm_forward(const Tensor& x, const std::optional<Tensor>& input,
                                 const Tensor& weight, double eps, const Outputs& out,
                                 double offset) {
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
  // outputs in the primitive's order: (residual_out,) y, rstd
  const size_t first = input ? 1 : 0;
  Tensor residual_out = input ? output(out, 0, x.sizes(), x.options()) : Tensor();
  // y may be rows with one stride (a buffer the memory plan lays wide: modulec/plan/pads.py)
  Tensor y = output_rows(out, first, x.sizes(), x.options());
  Tensor rstd = output(out, first + 1, leading(x), x.options().dtype(at::kFloat));
  const int64_t rows = C ? x.numel() / C : 0;
  int64_t y_rows = 0, ld_y = C;
  if (!y.is_contiguous()) as_rows(y, y_rows, ld_y);
  check_launch(modulec::launch_rmsnorm_forward(
                   dtype_of(x), x.data_ptr(), input ? input->data_ptr() : nullptr,
                   weight.data_ptr(), input ? residual_out.data_ptr() : nullptr, y.data_ptr(),
                   rstd.data_ptr<float>(), rows, C, static_cast<float>(eps),
                   static_cast<float>(offset), stream(), ld_y),
               "rmsnorm forward");
  if (input) return {residual_out, y, rstd};
  return {y, rstd};
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps,
                                    const Outputs& out, double offset) {
  return norm_forward(x, std::nullopt, weight, eps, out, offset);
}

// residual_out = residual + input, then rmsnorm of it: (residual_out, y, rstd)
std::vector<Tensor> fused_residual_rmsnorm_forward(const Tensor& residual, const Tensor& input,
                                                   const Tensor& weight, double eps,
                                                   const Outputs& out, double offset) {
  return norm_forward(residual, input, weight, eps, out, offset);
}

// y = x * rstd * (offset + weight): a norm's output from its saved input (or residual_out)
// and rstd
Tensor rmsnorm_apply(const Tensor& x, const Tensor& rstd, const Tensor& weight, double offset) {
  const auto dt = x.scalar_type();
  check(x, "x", dt, x);
  check(weight, "weight", dt, x);
  check(rstd, "rstd", at::kFloat, x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "weight must be [", C, "]");
  TORCH_CHECK(rstd.sizes() == at::IntArrayRef(leading(x)), "rstd must have x's leading dims");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty_like(x);
  const int64_t rows = C ? x.numel() / C : 0;
  check_launch(modulec::launch_rmsnorm_apply(dtype_of(x), x.data_ptr(), rstd.data_ptr<float>(),
                                             weight.data_ptr(), static_cast<float>(offset),
                                             y.data_ptr(), rows, C, stream()),
               "rmsnorm apply");
  return y;
}

// (d_x, d_weight); with d_residual_out, d_x is the fused backward's g = d_residual_out + d_x;
// weight_grad false: d_weight is not computed (None; a frozen weight's). d_residual_out and
// d_x may be rows with one stride (the residual gradient in the one-GEMM d_x's scratch,
// runtime/cuda/residual_rows.py), and one buffer (d_x written over d_residual_out).
std::vector<Tensor> rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& weight,
                                     const Tensor& rstd,
                                     const std::optional<Tensor>& d_residual_out,
                                     const Outputs& out, double offset, bool weight_grad) {
  const auto dt = x.scalar_type();
  check(x, "x", dt, x);
  check(d_y, "d_y", dt, x);
  check(weight, "weight", dt, x);
  check(rstd, "rstd", at::kFloat, x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(d_y.sizes() == x.sizes(), "d_y and x differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "weight must be [", C, "]");
  TORCH_CHECK(rstd.sizes() == at::IntArrayRef(leading(x)), "rstd must have x's leading dims");
  int64_t res_rows = 0, ld_res = C, dx_rows = 0, ld_dx = C;
  if (d_residual_out) {
    check_rows(*d_residual_out, "d_residual_out", dt, x);
    TORCH_CHECK(d_residual_out->sizes() == x.sizes(), "d_residual_out and x differ in shape");
    if (!d_residual_out->is_contiguous()) as_rows(*d_residual_out, res_rows, ld_res);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = C ? x.numel() / C : 0;
  Tensor d_x = output_rows(out, 0, x.sizes(), x.options());
  if (!d_x.is_contiguous()) as_rows(d_x, dx_rows, ld_dx);
  Tensor d_weight, work;
  if (weight_grad) {
    d_weight = at::empty_like(weight);
    work = at::empty({modulec::rmsnorm_backward_workspace(dtype_of(x), rows, C)},
                     x.options().dtype(at::kFloat));
  }
  check_launch(modulec::launch_rmsnorm_backward(
                   dtype_of(x), d_y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                   static_cast<float>(offset), rstd.data_ptr<float>(),
                   d_residual_out ? d_residual_out->data_ptr() : nullptr, d_x.data_ptr(),
                   weight_grad ? d_weight.data_ptr() : nullptr,
                   weight_grad ? work.data_ptr<float>() : nullptr, rows, C, stream(), ld_res,
                   ld_dx),
               "rmsnorm backward");
  return {d_x, d_weight};
}

// A tensor seen as rows x C with one row stride (elements): the last dim contiguous and
// the leading dims collapsible into one (each a whole number of the next). False if not.
bool as_rows(const Tensor& t, int64_t& rows, int64_t& ld) {
  const int64_t n = t.dim();
  if (n == 0 || t.stride(n - 1) != 1) return false;
  rows = 1;
  for (int64_t i = 0; i + 1 < n; ++i) rows *= t.size(i);
  ld = n >= 2 ? t.stride(n - 2) : t.size(0);
  for (int64_t i = 0; i + 2 < n; ++i)
    if (t.size(i) > 1 && t.stride(i) != t.stride(i + 1) * t.size(i + 1)) return false;
  if (rows <= 1) ld = t.size(n - 1);
  return true;
}

void check_rows(const Tensor& t, const char* name, at::ScalarType dtype, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", not ", like.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  int64_t rows, ld;
  TORCH_CHECK(as_rows(t, rows, ld), name, " must be rows with one stride (last dim contiguous)");
}

struct RowArgs {
  int64_t rows, C;
  std::vector<int64_t> ld;
};

// rows x C and each tensor's row stride; all contiguous: one row of numel elements
RowArgs row_args(std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  RowArgs a{1, first.numel(), {}};
  bool contiguous = true;
  for (const Tensor* t : ts) contiguous = contiguous && t->is_contiguous();
  for (const Tensor* t : ts) {
    int64_t rows, ld;
    as_rows(*t, rows, ld);
    if (contiguous) {
      a.ld.push_back(first.numel());
    } else {
      a.rows = rows;
      a.C = t->size(-1);
      a.ld.push_back(ld);
    }
  }
  return a;
}

// out[i] as output() takes it, or rows with one stride (a part of a concat over the last
// dim that the memory plan puts in the concat's bytes: runtime/arena.py)
Tensor output_rows(const Outputs& out, size_t i, at::IntArrayRef sizes,
                   const at::TensorOptions& options) {
  if (i >= out.size() || !out[i] || out[i]->is_contiguous()) return output(out, i, sizes, options);
  const Tensor& t = *out[i];
  int64_t rows, ld;
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == options.dtype().toScalarType() &&
                  t.device() == options.device() && as_rows(t, rows, ld),
              "out[", i, "] is ", t.sizes(), " ", t.scalar_type(), " with strides ", t.strides(),
              ", the kernel writes rows of ", sizes, " ", options.dtype());
  return t;
}

// gate, up: [*, C] each with a row stride of its own (e.g. the halves of [*, 2C]);
// activation: 0 silu (swiglu), 1 tanh GELU, 2 erf GELU (geglu)
Tensor swiglu_forward(const Tensor& gate, const Tensor& up, const Outputs& out,
                      int64_t activation) {
  check_rows(gate, "gate", gate.scalar_type(), gate);
  check_rows(up, "up", gate.scalar_type(), gate);
  dtype_of(gate);
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor y = output_rows(out, 0, gate.sizes(), gate.options());
  const RowArgs a = row_args({&gate, &up, &y});
  check_launch(modulec::launch_swiglu_forward(dtype_of(gate), gate.data_ptr(), a.ld[0],
                                              up.data_ptr(), a.ld[1], y.data_ptr(), a.ld[2],
                                              a.rows, a.C, static_cast<int>(activation),
                                              stream()),
               "swiglu forward");
  return y;
}

// (d_gate, d_up): the two halves of one [*, 2C] buffer (so the concat that usually
// follows is a view: runtime/cuda/train_kernels.py), or out[0] and out[1] when both are
// given (the arena's planned bytes); with_y: then y = act(gate) * up too, the forward's
// output, into out[2] when given (the backward's recompute of y, in the same pass)
std::vector<Tensor> swiglu_backward(const Tensor& d_y, const Tensor& gate, const Tensor& up,
                                    const Outputs& out, int64_t activation, bool with_y) {
  check_rows(gate, "gate", gate.scalar_type(), gate);
  check_rows(up, "up", gate.scalar_type(), gate);
  check_rows(d_y, "d_y", gate.scalar_type(), gate);
  dtype_of(gate);
  TORCH_CHECK(gate.sizes() == up.sizes() && d_y.sizes() == gate.sizes(),
              "d_y, gate and up differ in shape");
  TORCH_CHECK(gate.dim() >= 1, "swiglu takes at least one dim");
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t C = gate.size(-1);
  Tensor d_gate, d_up;
  if (out.size() >= 2 && out[0] && out[1]) {
    d_gate = output_rows(out, 0, gate.sizes(), gate.options());
    d_up = output_rows(out, 1, gate.sizes(), gate.options());
  } else {
    std::vector<int64_t> fused(gate.sizes().begin(), gate.sizes().end());
    fused.back() = 2 * C;
    Tensor both = at::empty(fused, gate.options());
    d_gate = both.narrow(-1, 0, C);
    d_up = both.narrow(-1, C, C);
  }
  const Tensor y = with_y ? output_rows(out, 2, gate.sizes(), gate.options()) : Tensor();
  // without y, gate stands in for it in the strides (already among them: nothing changes)
  const RowArgs a = row_args({&d_y, &gate, &up, &d_gate, &d_up, with_y ? &y : &gate});
  check_launch(modulec::launch_swiglu_backward(
                   dtype_of(gate), d_y.data_ptr(), a.ld[0], gate.data_ptr(), a.ld[1],
                   up.data_ptr(), a.ld[2], d_gate.data_ptr(), a.ld[3], d_up.data_ptr(), a.ld[4],
                   with_y ? y.data_ptr() : nullptr, a.ld[5], a.rows, a.C,
                   static_cast<int>(activation), stream()),
               "swiglu backward");
  if (!with_y) return {d_gate, d_up};
  return {d_gate, d_up, y};
}

// strides of a [B, H, T, D] tensor over b, h, t (the last dim must be contiguous)
std::array<int64_t, 3> bht_strides(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, ": rope takes [B, H, T, D]");
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, name, ": the last dim must be contiguous");
  return {t.stride(0), t.stride(1), t.stride(2)};
}

int64_t positions(const std::optional<Tensor>& position_ids, const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(2);
  if (!position_ids) return 0;
  check(*position_ids, "position_ids", at::kInt, x);
  const auto& p = *position_ids;
  TORCH_CHECK(p.dim() == 2 && p.size(1) == T && (p.size(0) == B || p.size(0) == 1),
              "position_ids must be [B, T] or [1, T]");
  return p.size(0) == 1 ? 0 : T;
}

// inv_freq: fp32 [n] on x's device, 2n <= D (the channels that rotate)
void check_inv_freq(const Tensor& inv_freq, const Tensor& x, int64_t rotated_max) {
  check(inv_freq, "inv_freq", at::kFloat, x);
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) >= 1 && 2 * inv_freq.size(0) <= rotated_max,
              "inv_freq must be [n] with 1 <= 2n <= ", rotated_max, ", got ", inv_freq.sizes());
}

void rope_into(const Tensor& x, const Tensor& out, const std::optional<Tensor>& position_ids,
               const Tensor& inv_freq, double scale, bool interleaved, bool inverse) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  check_inv_freq(inv_freq, x, D);
  const auto xs = bht_strides(x, "x"), os = bht_strides(out, "out");
  const int64_t pos_stride = positions(position_ids, x);
  check_launch(modulec::launch_rope(dtype_of(x), x.data_ptr(), xs.data(), out.data_ptr(),
                                    os.data(),
                                    position_ids ? position_ids->data_ptr<int32_t>() : nullptr,
                                    pos_stride, B, H, T, D, inv_freq.data_ptr<float>(),
                                    inv_freq.size(0), static_cast<float>(scale), interleaved,
                                    inverse, stream()),
               "rope");
}

modulec::RopeTensor rope_tensor(const Tensor& x, const Tensor& out) {
  modulec::RopeTensor r;
  const auto xs = bht_strides(x, "x"), os = bht_strides(out, "out");
  r.x = x.data_ptr();
  r.out = out.data_ptr();
  for (int i = 0; i < 3; ++i) r.x_strides[i] = xs[i], r.out_strides[i] = os[i];
  r.H = x.size(1);
  return r;
}

// rope_into of q into q_out and k into k_out in one launch (q, k: one B, T, D)
void rope_pair_into(const Tensor& q, const Tensor& q_out, const Tensor& k, const Tensor& k_out,
                    const std::optional<Tensor>& position_ids, const Tensor& inv_freq,
                    double scale, bool interleaved, bool inverse) {
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D,
              "rope: q and k differ in B, T or D");
  TORCH_CHECK(q_out.sizes() == q.sizes() && k_out.sizes() == k.sizes(),
              "rope: an output differs from its input in shape");
  check_inv_freq(inv_freq, q, D);
  const int64_t pos_stride = positions(position_ids, q);
  check_launch(modulec::launch_rope_pair(
                   dtype_of(q), rope_tensor(q, q_out), rope_tensor(k, k_out),
                   position_ids ? position_ids->data_ptr<int32_t>() : nullptr, pos_stride, B,
                   T, D, inv_freq.data_ptr<float>(), inv_freq.size(0),
                   static_cast<float>(scale), interleaved, inverse, stream()),
               "rope (q and k)");
}

void check_x(const Tensor& x, const char* name, const Tensor& like) {
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(x.device() == like.device(), name, " is on ", x.device(), ", not ", like.device());
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type());
  dtype_of(x);
  bht_strides(x, name);
}

// x [B, H, T, D] (any strides over b, h, t) rotated (inverse: the backward) into a new
// tensor laid out [B, T, H, D] (returned as its [B, H, T, D] transpose: the layout
// FlashAttention reads); position_ids int32 [B or 1, T] or None; inv_freq fp32 [n] (2n
// channels rotate), cos and sin times scale; interleaved: pairs (2i, 2i + 1)
Tensor rope(const Tensor& x, const std::optional<Tensor>& position_ids, const Tensor& inv_freq,
            double scale, bool interleaved, bool inverse, const Outputs& out) {
  check_x(x, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y;
  if (!out.empty() && out[0]) {  // given (the arena's planned bytes): any strides over b, h, t
    y = *out[0];
    check_x(y, "out[0]", x);
    TORCH_CHECK(y.sizes() == x.sizes(), "out[0] is ", y.sizes(), ", rope writes ", x.sizes());
  } else {
    y = at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
  }
  rope_into(x, y, position_ids, inv_freq, scale, interleaved, inverse);
  return y;
}

// x [B, H, T, D] (any strides over b, h, t) rotated in place: each element is read
// before it is written, by the same thread (RoPE inside the fused QKV projection output,
// modulec/plan/in_place.py)
void rope_inplace(const Tensor& x, const std::optional<Tensor>& position_ids,
                  const Tensor& inv_freq, double scale, bool interleaved, bool inverse) {
  check_x(x, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  rope_into(x, x, position_ids, inv_freq, scale, interleaved, inverse);
}

// q and k rotated (in place where an output is its input: outs empty) in one launch into
// outs (q's, k's: the arena's planned bytes, any strides over b, h, t)
std::vector<Tensor> rope_pair(const Tensor& q, const Tensor& k,
                              const std::optional<Tensor>& position_ids, const Tensor& inv_freq,
                              double scale, bool interleaved, bool inverse, const Outputs& out) {
  check_x(q, "q", q);
  check_x(k, "k", q);
  const bool given = out.size() == 2 && out[0] && out[1];
  TORCH_CHECK(out.empty() || given, "rope_pair: out is [] (in place) or [q's, k's]");
  const Tensor q_out = given ? *out[0] : q, k_out = given ? *out[1] : k;
  if (given) {
    check_x(q_out, "out[0]", q);
    check_x(k_out, "out[1]", q);
  }
  const c10::cuda::CUDAGuard guard(q.device());
  rope_pair_into(q, q_out, k, k_out, position_ids, inv_freq, scale, interleaved, inverse);
  return {q_out, k_out};
}

// The rope backward of q [B, Hq, T, D] and k [B, Hk, T, D] written into the head slots of
// one [B, T, Hq + Hk + extra_heads, D] buffer (q heads, then k heads, then extra_heads
// left unwritten): the fused QKV gradient, whose v slots the caller fills.
// Returns (buffer, d_q, d_k), d_q and d_k as [B, H, T, D] views of it.
void check_qk(const Tensor& q, const Tensor& k) {
  check_x(q, "q", q);
  check_x(k, "k", q);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "q and k differ in B, T or D");
}

// (buffer [B, T, Hq + Hk + extra_heads, D], d_q, d_k): the fused QKV gradient, d_q and d_k
// [B, H, T, D] views of its q and k head slots; the extra (v) slots are left unwritten
std::vector<Tensor> qkv_gradient_slots(const Tensor& q, int64_t Hk, int64_t extra_heads) {
  TORCH_CHECK(extra_heads >= 0, "extra_heads must be >= 0");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  Tensor buffer = at::empty({B, T, Hq + Hk + extra_heads, D}, q.options());
  return {buffer, buffer.narrow(2, 0, Hq).transpose(1, 2),
          buffer.narrow(2, Hq, Hk).transpose(1, 2)};
}

std::vector<Tensor> rope_qk_into_heads(const Tensor& q, const Tensor& k,
                                       const std::optional<Tensor>& position_ids,
                                       const Tensor& inv_freq, double scale, bool interleaved,
                                       bool inverse, int64_t extra_heads) {
  check_qk(q, k);
  const c10::cuda::CUDAGuard guard(q.device());
  auto slots = qkv_gradient_slots(q, k.size(1), extra_heads);
  rope_pair_into(q, slots[1], k, slots[2], position_ids, inv_freq, scale, interleaved, inverse);
  return slots;
}

// ---- qk_norm_rope (csrc/kernels/qk_norm_rope.cu): q [B, Hq, T, D], k [B, Hk, T, D] with
// any strides over b, h, t (the transposed heads of the fused QKV projection), weights [D]
void check_qk_rope(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                   const Tensor& k_weight) {
  check_qk(q, k);
  const int64_t D = q.size(3);
  TORCH_CHECK(D % 2 == 0 && D <= 256, "qk_norm_rope: head dim D=", D, " must be even and <= 256");
  check(q_weight, "q_weight", q.scalar_type(), q);
  check(k_weight, "k_weight", q.scalar_type(), q);
  TORCH_CHECK(q_weight.dim() == 1 && q_weight.size(0) == D && k_weight.dim() == 1 &&
                  k_weight.size(0) == D,
              "q_weight and k_weight must be [", D, "]");
}

// the rotation of qk_norm_rope: inv_freq fp32 [n], 2n <= D channels rotate
modulec::QkRopeRotation qk_rotation(const Tensor& inv_freq, const Tensor& q, double scale,
                                    bool interleaved) {
  check_inv_freq(inv_freq, q, q.size(3));
  modulec::QkRopeRotation rot;
  rot.inv_freq = inv_freq.data_ptr<float>();
  rot.n = inv_freq.size(0);
  rot.scale = static_cast<float>(scale);
  rot.interleaved = interleaved;
  return rot;
}

void set_strides(const Tensor& t, int64_t (&out)[3]) {
  const auto st = bht_strides(t, "tensor");
  for (int i = 0; i < 3; ++i) out[i] = st[i];
}

modulec::QkRopeTensor qk_rope_side(const Tensor& x, const Tensor& out, const Tensor& weight,
                                   const Tensor& rstd, const Tensor* d_rot) {
  modulec::QkRopeTensor a;
  a.x = x.data_ptr();
  set_strides(x, a.x_strides);
  a.out = out.data_ptr();
  set_strides(out, a.out_strides);
  if (d_rot) {
    a.d_rot = d_rot->data_ptr();
    set_strides(*d_rot, a.d_strides);
  }
  a.weight = weight.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.H = x.size(1);
  return a;
}

// [B, H, T, D] as the transpose of a new [B, T, H, D] tensor (FlashAttention's layout, as
// rope writes it)
Tensor heads_bthd(const Tensor& like, int64_t H) {
  return at::empty({like.size(0), like.size(2), H, like.size(3)}, like.options()).transpose(1, 2);
}

// (q_rot, k_rot, q_rstd, k_rstd): q_rot and k_rot laid out [B, T, H, D], rstd fp32 [B, H, T]
std::vector<Tensor> qk_norm_rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                         const Tensor& k_weight,
                                         const std::optional<Tensor>& position_ids, double eps,
                                         const Tensor& inv_freq, double scale, bool interleaved) {
  check_qk_rope(q, k, q_weight, k_weight);
  const auto rot = qk_rotation(inv_freq, q, scale, interleaved);
  const int64_t pos_stride = positions(position_ids, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3);
  Tensor q_rot = heads_bthd(q, q.size(1)), k_rot = heads_bthd(q, k.size(1));
  Tensor q_rstd = at::empty({B, q.size(1), T}, q.options().dtype(at::kFloat));
  Tensor k_rstd = at::empty({B, k.size(1), T}, q.options().dtype(at::kFloat));
  check_launch(modulec::launch_qk_norm_rope_forward(
                   dtype_of(q), qk_rope_side(q, q_rot, q_weight, q_rstd, nullptr),
                   qk_rope_side(k, k_rot, k_weight, k_rstd, nullptr),
                   position_ids ? position_ids->data_ptr<int32_t>() : nullptr, pos_stride, B, T,
                   D, static_cast<float>(eps), rot, stream()),
               "qk_norm_rope forward");
  return {q_rot, k_rot, q_rstd, k_rstd};
}

// (buffer, d_q, d_k, d_q_weight, d_k_weight): d_q and d_k written into the head slots of one
// [B, T, Hq + Hk + extra_heads, D] buffer (q heads, then k heads, then extra_heads left
// unwritten: the fused QKV gradient, whose v slots the caller fills), as [B, H, T, D] views
std::vector<Tensor> qk_norm_rope_backward(const Tensor& d_q_rot, const Tensor& d_k_rot,
                                          const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                          const Tensor& k_weight, const Tensor& q_rstd,
                                          const Tensor& k_rstd,
                                          const std::optional<Tensor>& position_ids,
                                          const Tensor& inv_freq, double scale, bool interleaved,
                                          int64_t extra_heads) {
  check_qk_rope(q, k, q_weight, k_weight);
  const auto rot = qk_rotation(inv_freq, q, scale, interleaved);
  check_x(d_q_rot, "d_q_rot", q);
  check_x(d_k_rot, "d_k_rot", q);
  TORCH_CHECK(d_q_rot.sizes() == q.sizes() && d_k_rot.sizes() == k.sizes(),
              "d_q_rot / d_k_rot differ from q / k in shape");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  check(q_rstd, "q_rstd", at::kFloat, q);
  check(k_rstd, "k_rstd", at::kFloat, q);
  TORCH_CHECK(q_rstd.sizes() == at::IntArrayRef({B, Hq, T}) &&
                  k_rstd.sizes() == at::IntArrayRef({B, Hk, T}),
              "q_rstd / k_rstd must be [B, H, T]");
  const int64_t pos_stride = positions(position_ids, q);
  const c10::cuda::CUDAGuard guard(q.device());
  auto slots = qkv_gradient_slots(q, Hk, extra_heads);
  const Tensor &buffer = slots[0], &d_q = slots[1], &d_k = slots[2];
  Tensor d_q_weight = at::empty_like(q_weight), d_k_weight = at::empty_like(k_weight);
  Tensor work = at::empty({modulec::qk_norm_rope_backward_workspace(dtype_of(q), B, T, Hq, Hk, D)},
                          q.options().dtype(at::kFloat));
  check_launch(modulec::launch_qk_norm_rope_backward(
                   dtype_of(q), qk_rope_side(q, d_q, q_weight, q_rstd, &d_q_rot),
                   qk_rope_side(k, d_k, k_weight, k_rstd, &d_k_rot),
                   position_ids ? position_ids->data_ptr<int32_t>() : nullptr, pos_stride, B, T,
                   D, rot, d_q_weight.data_ptr(), d_k_weight.data_ptr(), work.data_ptr<float>(),
                   stream()),
               "qk_norm_rope backward");
  return {buffer, d_q, d_k, d_q_weight, d_k_weight};
}

// d_weight [V, D] of embedding from d_y [n, D] and the stable sort of the ids
// (sorted_ids, order: int64 [n]); deterministic, every row written
Tensor embedding_backward(const Tensor& d_y, const Tensor& sorted_ids, const Tensor& order,
                          int64_t V) {
  const auto dt = d_y.scalar_type();
  check(d_y, "d_y", dt, d_y);
  check(sorted_ids, "sorted_ids", at::kLong, d_y);
  check(order, "order", at::kLong, d_y);
  TORCH_CHECK(d_y.dim() == 2, "d_y must be [n, D]");
  const int64_t n = d_y.size(0), D = d_y.size(1);
  TORCH_CHECK(sorted_ids.numel() == n && order.numel() == n, "one id and one row index per row");
  const c10::cuda::CUDAGuard guard(d_y.device());
  Tensor d_weight = at::empty({V, D}, d_y.options());
  check_launch(modulec::launch_embedding_backward(dtype_of(d_y), d_y.data_ptr(),
                                                  sorted_ids.data_ptr<int64_t>(),
                                                  order.data_ptr<int64_t>(), d_weight.data_ptr(),
                                                  n, V, D, stream()),
               "embedding backward");
  return d_weight;
}

// MoE routing gathers (csrc/kernels/moe.cu): rows [*, C] contiguous, scatter / pos int32
Tensor moe_gather_rows(const Tensor& x, const Tensor& scatter, int64_t top_k) {
  check(x, "x", x.scalar_type(), x);
  check(scatter, "scatter_indices", at::kInt, x);
  const int64_t M = scatter.numel(), C = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty({M, C}, x.options());
  check_launch(modulec::launch_moe_gather_rows(dtype_of(x), x.data_ptr(),
                                               scatter.data_ptr<int32_t>(),
                                               static_cast<int>(top_k), out.data_ptr(), M, C,
                                               stream()),
               "moe gather rows");
  return out;
}

Tensor moe_combine(const Tensor& rows, const std::optional<Tensor>& weights, const Tensor& pos,
                   int64_t top_k) {
  check(rows, "rows", rows.scalar_type(), rows);
  check(pos, "pos", at::kInt, rows);
  if (weights) check(*weights, "weights", at::kFloat, rows);
  const int64_t N = pos.numel() / top_k, C = rows.size(1);
  const c10::cuda::CUDAGuard guard(rows.device());
  Tensor out = at::empty({N, C}, rows.options());
  check_launch(modulec::launch_moe_combine(dtype_of(rows), rows.data_ptr(),
                                           weights ? weights->data_ptr<float>() : nullptr,
                                           pos.data_ptr<int32_t>(), static_cast<int>(top_k),
                                           out.data_ptr(), N, C, stream()),
               "moe combine");
  return out;
}

std::vector<Tensor> moe_combine_backward(const Tensor& d_out, const Tensor& rows,
                                         const Tensor& weights, const Tensor& scatter,
                                         int64_t top_k) {
  check(rows, "rows", rows.scalar_type(), rows);
  check(d_out, "d_combined", rows.scalar_type(), rows);
  check(weights, "weights", at::kFloat, rows);
  check(scatter, "scatter_indices", at::kInt, rows);
  const int64_t M = scatter.numel(), C = rows.size(1);
  const c10::cuda::CUDAGuard guard(rows.device());
  Tensor d_rows = at::empty({M, C}, rows.options());
  Tensor d_weights = at::empty({M}, weights.options());
  check_launch(modulec::launch_moe_combine_backward(
                   dtype_of(rows), d_out.data_ptr(), rows.data_ptr(), weights.data_ptr<float>(),
                   scatter.data_ptr<int32_t>(), static_cast<int>(top_k), d_rows.data_ptr(),
                   d_weights.data_ptr<float>(), M, C, stream()),
               "moe combine backward");
  return {d_rows, d_weights};
}

// Cross-entropy in place: logits [rows, V] (bf16, fp16 or fp32) become d_logits =
// (softmax - onehot(label)) * scale, 0 on rows whose label is ignore_index; returns the
// per-row losses (fp32 [rows]: lse - logit[label], 0 where ignored). scale: a fp32 device
// scalar (the caller's 1 / n), read by the kernel, so nothing syncs with the host.
Tensor cross_entropy_(const Tensor& logits, const Tensor& labels, const Tensor& scale,
                      int64_t ignore_index) {
  check(logits, "logits", logits.scalar_type(), logits);
  const DType dt = logits.scalar_type() == at::kHalf ? DType::F16 : dtype_of(logits);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, V], V > 0");
  check(labels, "labels", at::kLong, logits);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0), "labels must be [rows]");
  check(scale, "scale", at::kFloat, logits);
  TORCH_CHECK(scale.numel() == 1, "scale must have one element");
  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor losses = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  check_launch(modulec::launch_cross_entropy(dt, logits.data_ptr(), labels.data_ptr<int64_t>(),
                                             scale.data_ptr<float>(), losses.data_ptr<float>(),
                                             logits.size(0), logits.size(1), ignore_index,
                                             stream()),
               "cross_entropy");
  return losses;
}

// An FP8 GEMM operand: x [rows, cols] (bf16/fp32, contiguous) times scale (fp32 [] or [1]
// on the device), clamped and cast to fmt (0 E4M3, 1 E5M2): [x's layout if plain,
// transposed [cols, rows] if transposed], in that order.
std::vector<Tensor> fp8_cast(const Tensor& x, const Tensor& scale, int64_t fmt, bool plain,
                             bool transposed) {
  check(x, "x", x.scalar_type(), x);
  check(scale, "scale", at::kFloat, x);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, cols]");
  TORCH_CHECK(scale.numel() == 1, "scale must hold one value");
  const auto dtype = fp8_dtype(fmt);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  std::vector<Tensor> outs;
  Tensor out, out_t;
  if (plain) outs.push_back(out = at::empty({rows, cols}, x.options().dtype(dtype)));
  if (transposed) outs.push_back(out_t = at::empty({cols, rows}, x.options().dtype(dtype)));
  check_launch(modulec::launch_fp8_cast(dtype_of(x), x.data_ptr(), scale.data_ptr<float>(),
                                        static_cast<int>(fmt),
                                        plain ? out.data_ptr() : nullptr,
                                        transposed ? out_t.data_ptr() : nullptr, rows, cols,
                                        stream()),
               "fp8 cast");
  return outs;
}

// An FP8 operand's (scale, 1 / scale) from its amax (fp32 [] tensors on the device): the
// amax recorded into `pending` (fmax) when given, `past` (a delayed history's maximum)
// used instead where given and >= 0; top = fp8_max / 2^margin.
std::vector<Tensor> fp8_scale(const Tensor& amax, const std::optional<Tensor>& pending,
                              const std::optional<Tensor>& past, double top) {
  check(amax, "amax", at::kFloat, amax);
  TORCH_CHECK(amax.numel() == 1, "amax must hold one value");
  for (const auto* t : {&pending, &past})
    if (*t) {
      check(**t, "pending / past", at::kFloat, amax);
      TORCH_CHECK((*t)->numel() == 1, "pending / past must hold one value");
    }
  const c10::cuda::CUDAGuard guard(amax.device());
  Tensor scale = at::empty({}, amax.options()), inv_scale = at::empty({}, amax.options());
  check_launch(modulec::launch_fp8_scale(
                   amax.data_ptr<float>(), pending ? pending->data_ptr<float>() : nullptr,
                   past ? past->data_ptr<float>() : nullptr, top, scale.data_ptr<float>(),
                   inv_scale.data_ptr<float>(), stream()),
               "fp8 scale");
  return {scale, inv_scale};
}

}  // namespace

// csrc/bindings_mamba.cpp: mamba_conv1d and mamba_selective_scan
void register_mamba(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "modulec CUDA kernels (csrc/kernels)";
  register_mamba(m);
  modulec::bind::register_fusions(m);  // layernorm, gelu, softmax (bindings_fusions.cpp)
  modulec::bind::register_fp8(m);  // fp8_amax_scale (bindings_fp8.cpp)
  modulec::bind::register_optim(m);  // the AdamW steps (bindings_optim.cpp)
  modulec::bind::register_tensor(m);  // block_diag (bindings_tensor.cpp)
  modulec::bind::register_gemm(m);  // cuBLASLt with a chosen algorithm (bindings_gemm.cpp)
  // offset: the norm's scale is offset + weight (fp32; 1 for Gemma's `1 + w`)
  m.def("rmsnorm_forward", &rmsnorm_forward,
        "(x, weight, eps, out=[], offset=0) -> [y, rstd]", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("out") = Outputs(), py::arg("offset") = 0.0);
  m.def("fused_residual_rmsnorm_forward", &fused_residual_rmsnorm_forward,
        "(residual, input, weight, eps, out=[], offset=0) -> [residual_out, y, rstd]",
        py::arg("residual"), py::arg("input"), py::arg("weight"), py::arg("eps"),
        py::arg("out") = Outputs(), py::arg("offset") = 0.0);
  m.def("rmsnorm_apply", &rmsnorm_apply,
        "(x, rstd, weight, offset=0) -> x * rstd * (offset + weight)  (a norm's output from "
        "its saved statistics)",
        py::arg("x"), py::arg("rstd"), py::arg("weight"), py::arg("offset") = 0.0);
  m.def("rmsnorm_backward", &rmsnorm_backward,
        "(d_y, x, weight, rstd, d_residual_out or None, out=[], offset=0, weight_grad=True) "
        "-> [d_x, d_weight or None]",
        py::arg("d_y"), py::arg("x"), py::arg("weight"), py::arg("rstd"),
        py::arg("d_residual_out"), py::arg("out") = Outputs(), py::arg("offset") = 0.0,
        py::arg("weight_grad") = true);
  // activation: 0 silu (swiglu), 1 tanh-form GELU, 2 erf GELU (geglu)
  m.def("swiglu_forward", &swiglu_forward,
        "(gate, up, out=[], activation=0) -> y  (row-strided inputs)", py::arg("gate"),
        py::arg("up"), py::arg("out") = Outputs(), py::arg("activation") = 0);
  m.def("swiglu_backward", &swiglu_backward,
        "(d_y, gate, up, out=[], activation=0, with_y=False) -> [d_gate, d_up] (the halves of "
        "one [*, 2C] buffer, or out[0] and out[1]), then y = act(gate) * up with with_y (into "
        "out[2] when given)",
        py::arg("d_y"), py::arg("gate"), py::arg("up"), py::arg("out") = Outputs(),
        py::arg("activation") = 0, py::arg("with_y") = false);
  m.def("rope", &rope,
        "(x [B, H, T, D] strided, position_ids or None, inv_freq fp32 [n], scale, interleaved, "
        "inverse, out=[]) -> rotated x (2n channels), laid out [B, T, H, D], or into out[0] "
        "(any strides over b, h, t)",
        py::arg("x"), py::arg("position_ids"), py::arg("inv_freq"), py::arg("scale"),
        py::arg("interleaved"), py::arg("inverse"), py::arg("out") = Outputs());
  m.def("rope_inplace", &rope_inplace,
        "(x [B, H, T, D] strided, position_ids or None, inv_freq, scale, interleaved, inverse): "
        "x rotated in place");
  m.def("rope_pair", &rope_pair,
        "(q, k [B, H, T, D] strided, position_ids or None, inv_freq, scale, interleaved, "
        "inverse, out=[]) -> [q', k'] in one launch: in place, or into out[0], out[1]",
        py::arg("q"), py::arg("k"), py::arg("position_ids"), py::arg("inv_freq"),
        py::arg("scale"), py::arg("interleaved"), py::arg("inverse"),
        py::arg("out") = Outputs());
  m.def("rope_qk_into_heads", &rope_qk_into_heads,
        "(q, k, position_ids or None, inv_freq, scale, interleaved, inverse, extra_heads) -> "
        "[buffer [B, T, Hq + Hk + extra, D], q', k']");
  m.def("qk_norm_rope_forward", &qk_norm_rope_forward,
        "(q, k [B, H, T, D] strided, q_weight, k_weight, position_ids or None, eps, inv_freq "
        "fp32 [n], scale, interleaved) -> [q_rot, k_rot (laid out [B, T, H, D]), q_rstd, "
        "k_rstd]");
  m.def("qk_norm_rope_backward", &qk_norm_rope_backward,
        "(d_q_rot, d_k_rot, q, k, q_weight, k_weight, q_rstd, k_rstd, position_ids or None, "
        "inv_freq, scale, interleaved, extra_heads) -> [buffer [B, T, Hq + Hk + extra, D], "
        "d_q, d_k, d_q_weight, d_k_weight]");
  m.def("embedding_backward", &embedding_backward,
        "(d_y [n, D], sorted_ids int64 [n], order int64 [n], V) -> d_weight [V, D]");
  m.def("moe_gather_rows", &moe_gather_rows,
        "(x [N, C], scatter_indices int32 [N * top_k], top_k) -> permuted [N * top_k, C]");
  m.def("moe_combine", &moe_combine,
        "(rows [N * top_k, C], weights fp32 [N * top_k] or None, pos int32, top_k) -> [N, C]");
  m.def("moe_combine_backward", &moe_combine_backward,
        "(d_combined [N, C], rows, weights fp32, scatter_indices int32, top_k) -> [d_rows, "
        "d_weights fp32]");
  m.def("cross_entropy_", &cross_entropy_,
        "(logits [rows, V] bf16/fp16/fp32, overwritten with d_logits, labels int64 [rows], "
        "scale fp32 [], ignore_index) -> losses fp32 [rows]");
  m.def("fp8_cast", &fp8_cast,
        "(x [rows, cols] bf16/fp32, scale fp32 [] on the device, fmt 0 E4M3 / 1 E5M2, plain, "
        "transposed) -> [fp8 x if plain, fp8 x^T contiguous if transposed]  (clamped, RNE)",
        py::arg("x"), py::arg("scale"), py::arg("fmt"), py::arg("plain"),
        py::arg("transposed"));
  m.def("fp8_scale", &fp8_scale,
        "(amax fp32 [], pending fp32 [] or None, past fp32 [] or None, top) -> [scale, "
        "1 / scale]  (amax recorded into pending by fmax; past used where >= 0)",
        py::arg("amax"), py::arg("pending"), py::arg("past"), py::arg("top"));
}
