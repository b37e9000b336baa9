// The host-side entry points of the modulec CUDA kernels: raw device pointers, sizes and a
// stream. csrc/bindings.cpp wraps them on torch tensors; nothing here needs torch.
// Every launcher returns the launch's cudaError_t (cudaSuccess when there is no work).
// Dtype policy: bf16 or fp32 I/O (cross_entropy also fp16), fp32 arithmetic; rstd is
// always fp32.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace modulec {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };  // F16: cross_entropy only

// ---- norms.cu: rmsnorm and fused_residual_rmsnorm over the last dim (rows x C)
// y = x * rstd * (offset + weight), rstd = 1 / sqrt(mean(x^2) + eps); offset 0 (Llama) or
// 1 (Gemma's `1 + w`), added in fp32. With `input` non-null the kernel is
// fused_residual_rmsnorm: x = residual + input (fp32), written to residual_out.
cudaError_t launch_rmsnorm_forward(DType dt, const void* x, const void* input, const void* weight,
                                   void* residual_out, void* y, float* rstd, int64_t rows,
                                   int64_t C, float eps, float offset, cudaStream_t stream,
                                   int64_t ld_y = 0);
// The same (bf16; rows and C multiples of 8, x / input / weight / residual_out / y 16-byte
// aligned) also writing y's fp8 copy under delayed scaling (Fp8Delayed, declared with the
// fp8 launchers below): y row-major in the same pass, y^T from it (launch_fp8_delayed_finish).
struct Fp8Delayed;
cudaError_t launch_rmsnorm_forward_fp8(const void* x, const void* input, const void* weight,
                                       void* residual_out, void* y, float* rstd, int64_t rows,
                                       int64_t C, float eps, float offset, const Fp8Delayed& d,
                                       cudaStream_t stream);

// y = x * rstd * (offset + weight) from a saved x and rstd (a norm's output replayed,
// `apply_saved`).
cudaError_t launch_rmsnorm_apply(DType dt, const void* x, const float* rstd, const void* weight,
                                 float offset, void* y, int64_t rows, int64_t C,
                                 cudaStream_t stream);

// fp32 workspace (in floats) that launch_rmsnorm_backward needs for its d_weight partials.
int64_t rmsnorm_backward_workspace(DType dt, int64_t rows, int64_t C);

// d_x = rstd * (g - n * mean(g * n)) (+ d_residual_out when non-null: the fused backward),
// g = d_y * (offset + weight), n = x * rstd; d_weight = sum over rows of d_y * n, reduced
// in two passes through `workspace` (per-block fp32 partials, then a column sum); with
// d_weight null, d_x alone (no partials, no column sum; workspace may be null).
// d_residual_out and d_x are rows ld_res / ld_dx elements apart (0: C, dense) and may be
// the same buffer (d_x written over d_residual_out).
cudaError_t launch_rmsnorm_backward(DType dt, const void* d_y, const void* x, const void* weight,
                                    float offset, const float* rstd, const void* d_residual_out,
                                    void* d_x, void* d_weight, float* workspace, int64_t rows,
                                    int64_t C, cudaStream_t stream, int64_t ld_res = 0,
                                    int64_t ld_dx = 0);

// ---- layernorm.cu: layernorm and fused_residual_layernorm over the last dim (rows x C)
// y = (x - mean) * rstd * weight + bias (bias null: none), mean and rstd fp32 per row,
// rstd = 1 / sqrt(mean((x - mean)^2) + eps) (the biased variance). With `input` non-null:
// fused_residual_layernorm, x = residual + input (fp32), written to residual_out.
cudaError_t launch_layernorm_forward(DType dt, const void* x, const void* input,
                                     const void* weight, const void* bias, void* residual_out,
                                     void* y, float* mean, float* rstd, int64_t rows, int64_t C,
                                     float eps, cudaStream_t stream);

// fp32 workspace (in floats) that launch_layernorm_backward needs for its partials.
int64_t layernorm_backward_workspace(DType dt, int64_t rows, int64_t C);

// d_x = rstd * (g - mean(g) - n * mean(g * n)) (+ d_residual_out when non-null: the fused
// backward), g = d_y * weight, n = (x - mean) * rstd; d_weight = sum over rows of d_y * n,
// d_bias (when non-null) = sum over rows of d_y, both reduced in two passes through
// `workspace` (per-group fp32 partials, then a column sum: deterministic).
cudaError_t launch_layernorm_backward(DType dt, const void* d_y, const void* x,
                                      const void* weight, const float* mean, const float* rstd,
                                      const void* d_residual_out, void* d_x, void* d_weight,
                                      void* d_bias, float* workspace, int64_t rows, int64_t C,
                                      cudaStream_t stream);

// ---- gelu.cu: y = gelu(x), d_x = d_y * gelu'(x) over n contiguous elements; approximate:
// the tanh form, else the exact erf form.
cudaError_t launch_gelu_forward(DType dt, const void* x, void* y, int64_t n, bool approximate,
                                cudaStream_t stream);
cudaError_t launch_gelu_backward(DType dt, const void* d_y, const void* x, void* d_x, int64_t n,
                                 bool approximate, cudaStream_t stream);

// ---- softmax.cu: softmax over the last dim of rows x C (contiguous): y = exp(x - max) /
// sum exp(x - max); d_x = y * (d_y - sum(d_y * y)).
cudaError_t launch_softmax_forward(DType dt, const void* x, void* y, int64_t rows, int64_t C,
                                   cudaStream_t stream);
cudaError_t launch_softmax_backward(DType dt, const void* d_y, const void* y, void* d_x,
                                    int64_t rows, int64_t C, cudaStream_t stream);

// ---- embedding.cu: d_weight [V, D] = per id, the sum of the d_y rows [n, D] with that id;
// sorted_ids / order: a stable sort of the n ids and the rows in that order (int64).
cudaError_t launch_embedding_backward(DType dt, const void* d_y, const int64_t* sorted_ids,
                                      const int64_t* order, void* d_weight, int64_t n,
                                      int64_t V, int64_t D, cudaStream_t stream);

// ---- moe.cu: gathers over an MoE routing. scatter [M] (M = N * top_k): the assignment
// t * top_k + k of permuted row j; pos: its inverse. weights: fp32 [N * top_k] or null (1).
// out[j] = x[scatter[j] / top_k]
cudaError_t launch_moe_gather_rows(DType dt, const void* x, const int32_t* scatter, int top_k,
                                   void* out, int64_t M, int64_t C, cudaStream_t stream);
// out[t] = sum over k of weights[t * top_k + k] * rows[pos[t * top_k + k]]
cudaError_t launch_moe_combine(DType dt, const void* rows, const float* weights,
                               const int32_t* pos, int top_k, void* out, int64_t N, int64_t C,
                               cudaStream_t stream);
// d_rows[j] = weights[a] * d_out[a / top_k]; d_weights[a] = d_out[a / top_k] . rows[j]
cudaError_t launch_moe_combine_backward(DType dt, const void* d_out, const void* rows,
                                        const float* weights, const int32_t* scatter, int top_k,
                                        void* d_rows, float* d_weights, int64_t M, int64_t C,
                                        cudaStream_t stream);

// ---- swiglu.cu: y = act(gate) * up over rows x C elements; every tensor has its own row
// stride ld (elements; the last dim contiguous). Contiguous tensors: rows = 1, C = n.
// activation: 0 silu (swiglu), 1 tanh-form GELU, 2 erf GELU (geglu); else
// cudaErrorInvalidValue.
cudaError_t launch_swiglu_forward(DType dt, const void* gate, int64_t ld_gate, const void* up,
                                  int64_t ld_up, void* y, int64_t ld_y, int64_t rows, int64_t C,
                                  int activation, cudaStream_t stream);
// The same (bf16, y [rows, C] contiguous; rows, C, ld_gate, ld_up multiples of 8 and the
// pointers 16-byte aligned) also writing y's fp8 copy under delayed scaling (Fp8Delayed):
// y and y^T in the same pass, 64 x 64 tiles.
cudaError_t launch_swiglu_forward_fp8(const void* gate, int64_t ld_gate, const void* up,
                                      int64_t ld_up, void* y, int64_t rows, int64_t C,
                                      int activation, const Fp8Delayed& d, cudaStream_t stream);
// The backward: d_gate, d_up, and where y is not null also y = act(gate) * up (row stride
// ld_y): the forward's values, bit for bit, in the pass that reads gate and up anyway.
cudaError_t launch_swiglu_backward(DType dt, const void* d_y, int64_t ld_dy, const void* gate,
                                   int64_t ld_gate, const void* up, int64_t ld_up,
                                   void* d_gate, int64_t ld_dgate, void* d_up, int64_t ld_dup,
                                   void* y, int64_t ld_y, int64_t rows, int64_t C,
                                   int activation, cudaStream_t stream);

// ---- rope.cu: RoPE of x [B, H, T, D] into out (may alias x); x_strides and out_strides:
// 3 strides (elements) over b, h, t each, the last dim contiguous. position_ids: int32
// [B or 1, T] or null (0 .. T-1); pos_batch_stride is T, or 0 when one row of positions
// serves every batch. inv_freq: fp32 [n] on the device, 2n <= D channels rotate (the rest
// pass through), in pairs (i, i + n), or (2i, 2i + 1) when interleaved; cos and sin are
// times scale. inverse: the backward (rotation by -angle).
cudaError_t launch_rope(DType dt, const void* x, const int64_t* x_strides, void* out,
                        const int64_t* out_strides, const int32_t* position_ids,
                        int64_t pos_batch_stride, int64_t B, int64_t H, int64_t T, int64_t D,
                        const float* inv_freq, int64_t n, float scale, bool interleaved,
                        bool inverse, cudaStream_t stream);
// The same over q and k in one launch (the attention's two rotated tensors: one shape but
// their head counts, strides of their own).
struct RopeTensor {
  const void* x = nullptr;
  int64_t x_strides[3] = {};
  void* out = nullptr;
  int64_t out_strides[3] = {};
  int64_t H = 0;
};
cudaError_t launch_rope_pair(DType dt, const RopeTensor& q, const RopeTensor& k,
                             const int32_t* position_ids, int64_t pos_batch_stride, int64_t B,
                             int64_t T, int64_t D, const float* inv_freq, int64_t n,
                             float scale, bool interleaved, bool inverse, cudaStream_t stream);

// ---- qk_norm_rope.cu: qk_norm then rope (std/primitives/qk_norm_rope.module) over q [B, Hq,
// T, D] and k [B, Hk, T, D] in one launch each way. A QkRopeTensor is one of q, k: strides
// (elements) over b, h, t, the last dim contiguous; position_ids and pos_batch_stride as
// launch_rope's. D even and at most 256, 1 <= n and 2n <= D (cudaErrorInvalidValue
// otherwise).
struct QkRopeTensor {
  const void* x = nullptr;      // q or k (the backward: the saved pre-norm one)
  int64_t x_strides[3] = {};
  void* out = nullptr;          // forward: x_rot; backward: d_x
  int64_t out_strides[3] = {};
  const void* d_rot = nullptr;  // backward: the gradient of x_rot (forward: null)
  int64_t d_strides[3] = {};
  const void* weight = nullptr; // [D]
  float* rstd = nullptr;        // fp32 [B, H, T] contiguous: written forward, read backward
  int64_t H = 0;
};

// The rotation, as launch_rope's: inv_freq fp32 [n] on the device, 2n channels rotate (the
// rest pass through), in pairs (i, i + n) or (2i, 2i + 1) when interleaved; cos and sin
// times scale.
struct QkRopeRotation {
  const float* inv_freq = nullptr;
  int64_t n = 0;
  float scale = 1.f;
  bool interleaved = false;
};

// x_rot = rope(x * rstd * weight), rstd = 1 / sqrt(mean(x^2) + eps), for q and k.
cudaError_t launch_qk_norm_rope_forward(DType dt, const QkRopeTensor& q, const QkRopeTensor& k,
                                        const int32_t* position_ids, int64_t pos_batch_stride,
                                        int64_t B, int64_t T, int64_t D, float eps,
                                        const QkRopeRotation& rot, cudaStream_t stream);

// fp32 workspace (in floats) that launch_qk_norm_rope_backward needs for its partials.
int64_t qk_norm_rope_backward_workspace(DType dt, int64_t B, int64_t T, int64_t Hq, int64_t Hk,
                                        int64_t D);

// g = the inverse rotation of d_rot; d_x = rstd * (g w - n mean(g w n)), n = x * rstd;
// d_weight = sum over rows of g * n, for q and k (two passes through `workspace`, as
// launch_rmsnorm_backward's: deterministic).
cudaError_t launch_qk_norm_rope_backward(DType dt, const QkRopeTensor& q, const QkRopeTensor& k,
                                         const int32_t* position_ids, int64_t pos_batch_stride,
                                         int64_t B, int64_t T, int64_t D,
                                         const QkRopeRotation& rot, void* d_q_weight,
                                         void* d_k_weight, float* workspace, cudaStream_t stream);

// ---- adamw.cu: one AdamW step (torch.optim.AdamW's arithmetic) over n fp32 master
// weights with fp32 moments, reading the gradient in bf16 or fp32 (grad_dt) and writing
// the bf16 compute copy (when non-null). step: a device float, the step number (>= 1)
// after this update, so that a captured graph replays with the right bias corrections.
// lr_now (device float or null): the learning rate is lr * *lr_now (a schedule's rate,
// updated between graph replays); grad_scale (device float or null): every gradient
// element is multiplied by it first (global gradient-norm clipping); norm_sq (device
// double or null): the sum of the gradient's squares (before grad_scale) is added to it.
cudaError_t launch_adamw(DType grad_dt, float* param, const void* grad, float* exp_avg,
                         float* exp_avg_sq, void* compute_bf16, const float* step, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         const float* lr_now, const float* grad_scale, cudaStream_t stream,
                         double* norm_sq = nullptr);

// The same update on a master held as two 16-bit halves (adamw.cu, SplitMaster): hi, the
// bf16 compute copy (the value rounded half away from zero), and lo (int16), the bits
// rounding took off: bits(master) = bits(hi) * 2^16 + lo. 4 bytes a parameter for master
// and compute copy together.
cudaError_t launch_adamw_split(DType grad_dt, void* hi_bf16, int16_t* lo, const void* grad,
                               float* exp_avg, float* exp_avg_sq, const float* step, int64_t n,
                               float lr, float beta1, float beta2, float eps,
                               float weight_decay, const float* lr_now,
                               const float* grad_scale, cudaStream_t stream,
                               double* norm_sq = nullptr);

// The split update of up to kAdamWListMax tensors in one launch (adamw.cu): tensor k is
// hi[k] / lo[k] (its split master), grad[k] (all of grad_dt), its moments and n[k]
// elements, with rate factor lr[k] (times *lr_now when given) and weight decay
// weight_decay[k]; beta1, beta2, eps, step and grad_scale are the list's.
constexpr int kAdamWListMax = 16;
struct AdamWSplitList {
  void* hi[kAdamWListMax];
  int16_t* lo[kAdamWListMax];
  const void* grad[kAdamWListMax];
  float* exp_avg[kAdamWListMax];
  float* exp_avg_sq[kAdamWListMax];
  int64_t n[kAdamWListMax];
  float lr[kAdamWListMax];
  float weight_decay[kAdamWListMax];
  int count;
};
cudaError_t launch_adamw_split_list(DType grad_dt, const AdamWSplitList& list,
                                    const float* step, float beta1, float beta2, float eps,
                                    const float* lr_now, const float* grad_scale,
                                    cudaStream_t stream, double* norm_sq = nullptr);

// ---- cross_entropy.cu: cross-entropy loss and its gradient, in place on logits [rows, V]
// (row-contiguous; bf16, fp16 or fp32). Per row, lse = log(sum_j exp(x_j)) in fp32;
// losses[row] = lse - x[label] (fp32; NaN for a label outside [0, V)) and the row becomes
// (exp(x_j - lse) - [j == label]) * scale in the logits' dtype. A row whose label is
// ignore_index gets loss 0 and gradient 0. scale: a device float (the caller's 1 / n),
// read by the kernel so that a captured CUDA graph needs no host value.
cudaError_t launch_cross_entropy(DType dt, void* logits, const int64_t* labels,
                                 const float* scale, float* losses, int64_t rows, int64_t V,
                                 int64_t ignore_index, cudaStream_t stream);

// ---- fp8_cast.cu: an FP8 GEMM operand (runtime/fp8_gemm.py). q = fp8(clamp(x * *scale,
// +-fp8_max)), round to nearest even, NaN kept; x [rows, cols] bf16 or fp32 (contiguous),
// scale a device float; written to out [rows, cols] and/or out_t [cols, rows] (either may
// be null). fmt 0: E4M3 (448), 1: E5M2 (57344); else cudaErrorInvalidValue.
cudaError_t launch_fp8_cast(DType dt, const void* x, const float* scale, int fmt, void* out,
                            void* out_t, int64_t rows, int64_t cols, cudaStream_t stream);
// The operand's scale from its amax (device floats, one thread): *pending = fmax(*pending,
// *amax) when pending is non-null; the amax used is *past when past is non-null and
// *past >= 0 (a delayed history's maximum), else *amax; *scale = fp32(top / amax) computed
// in float64 (1 for an amax of 0 or not finite; top = fp8_max / 2^margin), *inv_scale =
// 1 / *scale.
cudaError_t launch_fp8_scale(const float* amax, float* pending, const float* past, double top,
                             float* scale, float* inv_scale, cudaStream_t stream);
// fp8_amax.cu: the same from x itself in one launch: amax = max |x| over x [n] (bf16 or
// fp32, contiguous; NaN if x holds one, 0 if n is 0), then as launch_fp8_scale. work: two
// device unsigned ints, zero before the call and left zero after it (calls on one stream
// share one).
cudaError_t launch_fp8_amax_scale(DType dt, const void* x, int64_t n, unsigned* work,
                                  float* pending, const float* past, double top, float* scale,
                                  float* inv_scale, cudaStream_t stream);
// Delayed scaling's cast with the amax in one pass: launch_fp8_cast's q of x [rows, cols]
// (bf16, both multiples of 8, x 16-byte and outputs 8-byte aligned) at the scale of *past
// (a history's maximum, non-null), x's amax recorded into *pending as launch_fp8_amax_scale
// does and *scale / *inv_scale written; where *past < 0 (no history) the scale is x's own
// and a second launch casts. cudaErrorInvalidValue for shapes it does not take.
cudaError_t launch_fp8_cast_delayed(const void* x, unsigned* work, float* pending,
                                    const float* past, double top, int fmt, float* scale,
                                    float* inv_scale, void* out, void* out_t, int64_t rows,
                                    int64_t cols, cudaStream_t stream);
// Delayed scaling's fp8 copy of a producer's output [rows, cols] (bf16), written by the
// producer itself (launch_rmsnorm_forward_fp8, launch_swiglu_forward_fp8): the numbers of
// launch_fp8_cast_delayed on that output. work, past (non-null), pending (or null), top and
// fmt as there; scale / inv_scale written; out [rows, cols] fp8 (non-null, 8-byte aligned),
// out_t [cols, rows] fp8 or null.
struct Fp8Delayed {
  unsigned* work;
  float* pending;
  const float* past;
  double top;
  int fmt;
  float* scale;
  float* inv_scale;
  void* out;
  void* out_t;
};
// After a producer wrote `d`'s fp8 copy of x [rows, cols] (bf16, multiples of 8): where
// *past < 0 (no history: the producer only took the amax) x cast at *scale into out and
// out_t; else, with transpose_plain, out_t as out transposed (a byte transpose: the same
// bits as a cast of x), else nothing.
cudaError_t launch_fp8_delayed_finish(const void* x, const Fp8Delayed& d, bool transpose_plain,
                                      int64_t rows, int64_t cols, cudaStream_t stream);

// ---- block_diag.cu: n <= kMaxBlocks row-major matrices ptr[b] [rows[b], cols[b]] placed at
// (row[b], col[b]) of y [rows, cols] (row-major), zeros elsewhere; itemsize 2 or 4 (bits
// copied). The backward copies each block of d_y [.., cols] into ptr[b] (contiguous);
// start[b] = the elements of blocks 0..b-1 (start[n]: all of them).
constexpr int kMaxBlocks = 8;
struct Blocks {
  int n;
  void* ptr[kMaxBlocks];
  int64_t row[kMaxBlocks], col[kMaxBlocks], rows[kMaxBlocks], cols[kMaxBlocks];
  int64_t start[kMaxBlocks + 1];
};
cudaError_t launch_block_diag_forward(int itemsize, const Blocks& blocks, void* y,
                                      int64_t rows, int64_t cols, cudaStream_t stream);
cudaError_t launch_block_diag_backward(int itemsize, const Blocks& blocks, const void* d_y,
                                       int64_t cols, cudaStream_t stream);

// scaled_copies.cu: dst = alpha * src for each of `count` bf16 copies of rows x cols
// (cols a multiple of 8, row strides in elements multiples of 8, both 16-byte aligned) in
// one launch; `table` in device memory, `most_pieces` the largest rows * cols / 8. The
// layout is fixed: runtime/cuda/lora_kcat.py packs it (`COPY_ROW`).
struct ScaledCopy {
  const void* src;
  void* dst;
  int64_t rows, cols, src_ld, dst_ld;
  float alpha, unused;
};
static_assert(sizeof(ScaledCopy) == 56, "lora_kcat.py packs 56-byte rows");
cudaError_t launch_scaled_copies(const ScaledCopy* table, int count, int64_t most_pieces,
                                 cudaStream_t stream);

// skinny_grads.cu: d_a = alpha d_c b [rows, rank] and d_b = alpha d_c^T a [cols, rank] (bf16)
// in one pass over d_c [rows, cols] (row stride ld), its CTAs' parts met in `sums` (one of
// the two: SkinnySums). rows % skinny_rows_multiple() == 0,
// cols % skinny_cols_multiple() == 0, rank in {16, 32, 48, 64}.
// `blocks`: where b is block-diagonal (LoRA's B of a fused projection: n blocks of 16
// columns, block i's rows ending at end[i], each end a multiple of
// skinny_cols_multiple()), n = rank / 16 of them, and only the blocks are summed and
// written (d_b's other entries are left as they were); n = 0: b dense. a's rows lie lda
// elements apart (>= rank, a multiple of 8; a 16-byte aligned), d_a's ld_a (>= rank).
// `compact` (with blocks): d_b is [cols, 16], each row its own block's 16 columns alone
// (the blocks' gradients stacked: the parts of LoRA's B as row views, no block_diag
// backward).
constexpr int kSkinnyMaxBlocks = 4;
struct SkinnyBlocks {
  int n;
  int64_t end[kSkinnyMaxBlocks];
  bool compact;
};
// Where the CTAs' parts meet: `partials` (skinny_partial_floats(rows, cols, rank, blocks,
// sm_count) floats, nothing to zero, the same bits every run) or, where partials is null,
// the sums da [rows, rank] and db [cols, rank], zero on entry and left zero (atomics: the
// last bits vary).
struct SkinnySums {
  float* partials;
  float* da;
  float* db;
};
int skinny_rows_multiple();
int skinny_cols_multiple();
int64_t skinny_partial_floats(int64_t rows, int64_t cols, int rank,
                              const SkinnyBlocks& blocks, int sm_count);
cudaError_t launch_skinny_nt_backward(const void* d_c, int64_t ld, const void* a,
                                      int64_t lda, const void* b, const SkinnySums& sums,
                                      void* d_a, int64_t ld_a, void* d_b, int64_t rows,
                                      int64_t cols, int rank, float alpha,
                                      const SkinnyBlocks& blocks,
                                      int sm_count, cudaStream_t stream);

// graph_fills.cu: each memset node of `graph` replaced by a fill kernel node with the same
// dependencies (*replaced: how many)
cudaError_t graph_memsets_to_kernels(cudaGraph_t graph, int* replaced);

}  // namespace modulec
