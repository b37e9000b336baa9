// rmsnorm and fused_residual_rmsnorm, forward and backward (std/primitives/rmsnorm.module,
// fused_residual_rmsnorm.module). A row is normalized by a "group" of threads: the whole
// block for long rows, a power-of-two slice of a warp for rows of at most 32 vectors
// (qk_norm's head dim: a block per 128-element row would leave most threads idle). The
// forward gives each group one row; the backward runs a persistent grid whose groups
// stride over rows, so that each thread keeps the d_weight partials of its own columns in
// registers, then a second kernel sums the per-group partials per column. fp32
// arithmetic throughout; bf16 or fp32 I/O. The scale is `offset + weight` (in fp32): offset
// 0 for Llama's norms, 1 for Gemma's `(1 + w)` (the primitives' `offset` parameter). The
// forward's FP8 instance (bf16, 8 a vector) also writes y's fp8 copy under delayed scaling
// and takes y's amax (fp8.cuh DelayedSink; runtime/cuda/fp8_producers.py).
#include <limits>

#include "fp8.cuh"
#include "rows.cuh"

namespace modulec {
namespace {

constexpr int kFwdCache = 4;       // row vectors a thread keeps in registers (forward)
constexpr int kBwdCache = 2;       // likewise for x and d_y in the backward (twice the data)
constexpr int kFrozenCache = 2;    // the d_x-alone backward's (a frozen weight: no partials)

template <int VEC>
__device__ __forceinline__ float sum_squares(const float (&a)[VEC]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += a[j] * a[j];
  return s;
}

// The scale of VEC columns: offset + weight, in fp32 (offset 0: the weight itself)
template <typename T, int VEC>
__device__ __forceinline__ void load_scale(const T* weight, int64_t i, float offset,
                                           float (&w)[VEC]) {
  load_vec<T, VEC>(weight, i, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) w[j] += offset;
}

// FP8: y's 8 values as stored (bf16) into the sink's amax and, quantized, into q8 (the
// row's fp8 copy, one 8-byte word a vector)
template <typename T, int VEC, bool FUSED, bool FP8>
__device__ __forceinline__ void store_y(const float (&a)[VEC], const T* weight, T* residual_out,
                                        T* y, int64_t i, float r, float offset,
                                        DelayedSink& sink, uint2* q8) {
  if constexpr (FUSED) store_vec<T, VEC>(residual_out, i, a);
  float w[VEC], o[VEC];
  load_scale<T, VEC>(weight, i, offset, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) o[j] = a[j] * r * w[j];  // (x * rstd) * weight, as the reference
  store_vec<T, VEC>(y, i, o);
  if constexpr (FP8) {
    static_assert(VEC == 8, "the fp8 copy is written 8 values a vector");
    float b[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) b[j] = to_float(from_float<T>(o[j]));
    const Fp8x8 u = sink8(sink, b);
    if (sink.write) q8[i] = u.packed;
  }
}

template <typename T, int VEC, bool FUSED, bool FP8>
__global__ void __launch_bounds__(kRowMaxThreads)
rms_forward_kernel(const T* __restrict__ x, const T* __restrict__ input,
                   const T* __restrict__ weight, T* __restrict__ residual_out,
                   T* __restrict__ y, float* __restrict__ rstd, int64_t rows, int64_t C,
                   float eps, float offset, int group, Fp8Delayed d, int64_t ld_y) {
  const int lane = threadIdx.x % group;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  // a group past the last row moves no data but still joins the reductions
  const int64_t nvec = row < rows ? C / VEC : 0;
  const int64_t off = row < rows ? row * C : 0;
  x += off;
  y += row < rows ? row * ld_y : 0;  // y's rows may lie wider apart (a planned wide buffer)
  if constexpr (FUSED) {
    input += off;
    residual_out += off;
  }
  DelayedSink sink{};
  uint2* q8 = nullptr;  // this row's fp8 copy
  if constexpr (FP8) {
    sink = delayed_sink(d);
    q8 = reinterpret_cast<uint2*>(static_cast<__nv_fp8_storage_t*>(d.out) + off);
  }
  // the first kFwdCache vectors of each thread stay in registers: one read from memory
  float cache[kFwdCache][VEC];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) {
      load_x<T, VEC, FUSED>(x, input, i, cache[k]);
      ss += sum_squares(cache[k]);
    }
  }
  // rows longer than the cache are read twice (the second read mostly hits L2)
  for (int64_t i = lane + kFwdCache * static_cast<int64_t>(group); i < nvec; i += group) {
    float a[VEC];
    load_x<T, VEC, FUSED>(x, input, i, a);
    ss += sum_squares(a);
  }
  const float r = rsqrtf(group_sum(ss, group) / static_cast<float>(C) + eps);
  if (lane == 0 && row < rows) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec)
      store_y<T, VEC, FUSED, FP8>(cache[k], weight, residual_out, y, i, r, offset, sink, q8);
  }
  for (int64_t i = lane + kFwdCache * static_cast<int64_t>(group); i < nvec; i += group) {
    float a[VEC];
    load_x<T, VEC, FUSED>(x, input, i, a);
    store_y<T, VEC, FUSED, FP8>(a, weight, residual_out, y, i, r, offset, sink, q8);
  }
  if constexpr (FP8) sink_finish<kRowMaxThreads>(sink, d);  // every thread: no return above
}

// d_x's arithmetic is written rounding by rounding (__fmul_rn and friends: no contraction
// into fma), so that every backward kernel, whatever the compiler fuses in its context,
// gives the same d_x bits: the frozen kernels' d_x is the trained kernel's.

// sum over the row of g * n, g = d_y * weight, n = x * r (one vector's share)
template <int VEC>
__device__ __forceinline__ float dot_gn(const float (&dy)[VEC], const float (&x)[VEC],
                                        const float (&w)[VEC], float r) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j)
    s = __fadd_rn(s, __fmul_rn(__fmul_rn(dy[j], w[j]), __fmul_rn(x[j], r)));
  return s;
}

// d_x's values of one vector before d_residual_out: r (d_y w - n mean_gn), n = x r
template <int VEC>
__device__ __forceinline__ void dx_values(const float (&dy)[VEC], const float (&x)[VEC],
                                          const float (&w)[VEC], float r, float mean_gn,
                                          float (&o)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j)
    o[j] = __fmul_rn(r, __fsub_rn(__fmul_rn(dy[j], w[j]),
                                  __fmul_rn(__fmul_rn(x[j], r), mean_gn)));
}

// d_x of one vector (plus d_residual_out when fused: `d`, loaded by the caller, or read
// here when null); adds d_y * n into dw.
template <typename T, int VEC>
__device__ __forceinline__ void store_dx(const float (&dy)[VEC], const float (&x)[VEC],
                                         const T* weight, float offset, const T* d_res, T* d_x,
                                         int64_t i, float r, float mean_gn, float (&dw)[VEC],
                                         const float* d = nullptr) {
  float w[VEC], o[VEC];
  load_scale<T, VEC>(weight, i, offset, w);
  dx_values(dy, x, w, r, mean_gn, o);
#pragma unroll
  for (int j = 0; j < VEC; ++j) dw[j] += dy[j] * (x[j] * r);
  if (d_res) {
    float loaded[VEC];
    if (!d) {
      load_vec<T, VEC>(d_res, i, loaded);
      d = loaded;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = __fadd_rn(o[j], d[j]);
  }
  store_vec<T, VEC>(d_x, i, o);
}

template <typename T, int VEC, int CACHE>
__device__ __forceinline__ void rms_backward_row(const T* d_y, const T* x, const T* weight,
                                                 float offset, float r, const T* d_res, T* d_x,
                                                 float* part,
                                                 int64_t nvec, int64_t C, int group, int lane,
                                                 float (&dw)[CACHE][VEC]) {
  const int64_t first_uncached = CACHE * static_cast<int64_t>(group);
  float xs[CACHE][VEC], gs[CACHE][VEC], ds[CACHE][VEC];
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) {
      float w[VEC];
      load_vec<T, VEC>(x, i, xs[k]);
      load_vec<T, VEC>(d_y, i, gs[k]);
      // d_residual_out's cached vectors are read now: in flight beside the others, not
      // after the row's reduction
      if (d_res) load_vec<T, VEC>(d_res, i, ds[k]);
      load_scale<T, VEC>(weight, i, offset, w);
      dot += dot_gn(gs[k], xs[k], w, r);
    }
  }
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC], g[VEC], w[VEC];
    load_vec<T, VEC>(x, i, a);
    load_vec<T, VEC>(d_y, i, g);
    load_scale<T, VEC>(weight, i, offset, w);
    dot += dot_gn(g, a, w, r);
  }
  const float mean_gn = group_sum(dot, group) / static_cast<float>(C);
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec)
      store_dx<T, VEC>(gs[k], xs[k], weight, offset, d_res, d_x, i, r, mean_gn, dw[k], ds[k]);
  }
  // uncached columns accumulate d_weight straight into this block's partial row
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC], g[VEC], acc[VEC] = {};
    load_vec<T, VEC>(x, i, a);
    load_vec<T, VEC>(d_y, i, g);
    store_dx<T, VEC>(g, a, weight, offset, d_res, d_x, i, r, mean_gn, acc);
    if (part) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) part[i * VEC + j] += acc[j];
    }
  }
}

// d_res and d_x are rows ld_res and ld_dx elements apart (C: dense; wider: the residual
// gradient laid in the one-GEMM d_x's scratch, runtime/cuda/residual_rows.py), and may be
// one buffer (in place: each thread reads its elements of d_res before it writes them, so
// neither pointer is __restrict__).
// Persistent grid: group g handles rows g, g + groups, ...; each thread owns the same
// columns in every row, so its d_weight partials (one row of `partial` per group) need
// neither atomics nor barriers. PARTS false (no d_weight wanted: a frozen weight's): the
// partials' registers and code go, and the grid is a group a row (backward_vec).
template <typename T, int VEC, bool PARTS = true, int CACHE = kBwdCache>
__global__ void __launch_bounds__(kRowMaxThreads)
rms_backward_kernel(const T* __restrict__ d_y, const T* __restrict__ x,
                    const T* __restrict__ weight, float offset, const float* __restrict__ rstd,
                    const T* d_res, T* d_x, float* __restrict__ partial, int64_t rows,
                    int64_t C, int group, int64_t ld_res, int64_t ld_dx) {
  const int64_t nvec = C / VEC;
  const int lane = threadIdx.x % group;
  const int64_t per_block = blockDim.x / group;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / group;
  float* part = PARTS && partial ? partial + first * C : nullptr;  // null: no d_weight
  float dw[CACHE][VEC] = {};
  if (part)
    for (int64_t i = lane + CACHE * static_cast<int64_t>(group); i < nvec; i += group)
      for (int j = 0; j < VEC; ++j) part[i * VEC + j] = 0.f;
  // the loop bound is uniform across the block: every group reaches every reduction
  for (int64_t base = first - threadIdx.x / group; base < rows; base += gridDim.x * per_block) {
    const int64_t row = base + threadIdx.x / group;
    const bool valid = row < rows;
    const int64_t off = valid ? row * C : 0, at = valid ? row : 0;
    rms_backward_row<T, VEC, CACHE>(d_y + off, x + off, weight, offset, valid ? rstd[row] : 0.f,
                             d_res ? d_res + at * ld_res : nullptr, d_x + at * ld_dx, part,
                             valid ? nvec : 0, C, group, lane, dw);
  }
  if (!part) return;
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec)
      for (int j = 0; j < VEC; ++j) part[i * VEC + j] = dw[k][j];
  }
}

// ---- the frozen backward with its rows pipelined (d_x alone, rows of kPipeThreads x
// kPipeCache vectors: LoRA 8B's 4096 bf16 columns). A persistent grid, a block a row at a
// time (rows blockIdx.x, + gridDim.x, ...): the next row's vectors are loaded before the
// current row's sum and stores, so loads stay in flight through the reduction, where the
// one-row-a-block kernel loads, sums, stores and exits. The vectors are kept as loaded (a
// 16-byte Vec, not VEC floats) and the weight's read again where used: two rows' worth
// then fit 2 blocks of 256 a multiprocessor without spills (122-128 registers; spilled,
// the kernel ran no faster than the one-row kernel). dot_gn and dx_values as the other
// kernels: their bits.
// docs/decisions.md "RMSNorm backward of a frozen weight".
constexpr int kPipeThreads = 256, kPipeCache = 2, kPipeBlocks = 2;

template <typename T, int VEC>
struct PipeRow {
  Vec<T, VEC> x[kPipeCache], g[kPipeCache], d[kPipeCache];
};

template <typename T, int VEC>
__device__ __forceinline__ void unpack_vec(const Vec<T, VEC>& r, float (&out)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_float(r.v[j]);
}

template <typename T>
__device__ __forceinline__ T* row_of(T* base, int row, int ld) {
  return base + static_cast<int64_t>(row) * ld;
}

template <typename T, int VEC, bool RES>
__device__ __forceinline__ void pipe_load(PipeRow<T, VEC>& v, const T* d_y, const T* x,
                                          const T* d_res, int row, int rows, int C,
                                          int ld_res) {
  if (row >= rows) return;
  const auto* xs = reinterpret_cast<const Vec<T, VEC>*>(row_of(x, row, C));
  const auto* gs = reinterpret_cast<const Vec<T, VEC>*>(row_of(d_y, row, C));
  const auto* ds = reinterpret_cast<const Vec<T, VEC>*>(RES ? row_of(d_res, row, ld_res) : x);
#pragma unroll
  for (int k = 0; k < kPipeCache; ++k) {
    const int i = threadIdx.x + k * kPipeThreads;
    v.x[k] = xs[i];
    v.g[k] = gs[i];
    if constexpr (RES) v.d[k] = ds[i];
  }
}

// offset + weight, as load_scale computes it; the weight's vector read again at each use
// (a volatile load: kept, the compiler would hold its VEC floats through the loop)
template <typename T, int VEC>
__device__ __forceinline__ void scale_of(const T* weight, int i, float offset,
                                         float (&w)[VEC]) {
  static_assert(sizeof(Vec<T, VEC>) == 16, "16-byte vectors");
  uint4 u;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(reinterpret_cast<const uint4*>(weight) + i));
  unpack_vec(*reinterpret_cast<const Vec<T, VEC>*>(&u), w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) w[j] += offset;
}

template <typename T, int VEC, bool RES>
__device__ __forceinline__ void pipe_finish(const PipeRow<T, VEC>& v,
                                            const T* weight, float offset,
                                            float r, T* d_x, int C) {
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < kPipeCache; ++k) {
    float a[VEC], g[VEC], w[VEC];
    unpack_vec(v.x[k], a);
    unpack_vec(v.g[k], g);
    scale_of(weight, threadIdx.x + k * kPipeThreads, offset, w);
    dot += dot_gn(g, a, w, r);
  }
  const float mean_gn = block_sum(dot) / static_cast<float>(C);
  auto* out = reinterpret_cast<Vec<T, VEC>*>(d_x);
#pragma unroll
  for (int k = 0; k < kPipeCache; ++k) {
    float a[VEC], g[VEC], w[VEC], o[VEC];
    unpack_vec(v.x[k], a);
    unpack_vec(v.g[k], g);
    scale_of(weight, threadIdx.x + k * kPipeThreads, offset, w);
    dx_values(g, a, w, r, mean_gn, o);
    if constexpr (RES) {
      float d[VEC];
      unpack_vec(v.d[k], d);
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = __fadd_rn(o[j], d[j]);
    }
    Vec<T, VEC> packed;
#pragma unroll
    for (int j = 0; j < VEC; ++j) packed.v[j] = from_float<T>(o[j]);
    out[threadIdx.x + k * kPipeThreads] = packed;
  }
}

// Two register sets used in turn (static indices: they stay registers). d_res and d_x may
// be one buffer: a row's d_res is loaded before its d_x is stored, and rows do not overlap.
// Rows, lengths and strides in 32 bits (the launch checks they fit): registers, which
// the two rows in flight use up.
template <typename T, int VEC, bool RES>
__global__ void __launch_bounds__(kPipeThreads, kPipeBlocks)
rms_backward_pipelined_kernel(const T* __restrict__ d_y, const T* __restrict__ x,
                              const T* __restrict__ weight, float offset,
                              const float* __restrict__ rstd, const T* d_res, T* d_x, int rows,
                              int C, int ld_res, int ld_dx) {
  PipeRow<T, VEC> a, b;
  const int step = gridDim.x;
  int row = blockIdx.x;
  pipe_load<T, VEC, RES>(a, d_y, x, d_res, row, rows, C, ld_res);
  while (row < rows) {  // uniform across the block: every thread reaches each block_sum
    pipe_load<T, VEC, RES>(b, d_y, x, d_res, row + step, rows, C, ld_res);
    pipe_finish<T, VEC, RES>(a, weight, offset, rstd[row], row_of(d_x, row, ld_dx), C);
    row += step;
    if (row >= rows) break;
    pipe_load<T, VEC, RES>(a, d_y, x, d_res, row + step, rows, C, ld_res);
    pipe_finish<T, VEC, RES>(b, weight, offset, rstd[row], row_of(d_x, row, ld_dx), C);
    row += step;
  }
}

// y = x * rstd[row] * weight: a norm's output from its saved input and statistics (the
// planner's `apply_saved` replay). The same fp32 products in the same order as store_y, so
// from the same x it gives the forward's y bit for bit. One thread: VEC elements.
template <typename T, int VEC>
__global__ void rms_apply_kernel(const T* __restrict__ x, const float* __restrict__ rstd,
                                 const T* __restrict__ weight, float offset, T* __restrict__ y,
                                 int64_t rows, int64_t C) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_row = C / VEC;
  if (i >= rows * per_row) return;
  const int64_t row = i / per_row, col = i - row * per_row;
  float a[VEC], w[VEC], o[VEC];
  load_vec<T, VEC>(x + row * C, col, a);
  load_scale<T, VEC>(weight, col, offset, w);
  const float r = rstd[row];
#pragma unroll
  for (int j = 0; j < VEC; ++j) o[j] = a[j] * r * w[j];
  store_vec<T, VEC>(y + row * C, col, o);
}

template <typename T>
cudaError_t apply_typed(const void* x, const float* rstd, const void* weight, float offset,
                        void* y, int64_t rows, int64_t C, cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T), threads = 256;
  auto launch = [&](auto kernel, int vec) {
    const int64_t items = rows * (C / vec);
    kernel<<<static_cast<unsigned>((items + threads - 1) / threads), threads, 0, stream>>>(
        static_cast<const T*>(x), rstd, static_cast<const T*>(weight), offset,
        static_cast<T*>(y), rows, C);
  };
  if (pick_vec<T>(C, {x, weight, y}) == wide)
    launch(rms_apply_kernel<T, wide>, wide);
  else
    launch(rms_apply_kernel<T, 1>, 1);
  return cudaGetLastError();
}

// ------------------------------------------------------------------- host dispatch
template <typename T, int VEC, bool FP8 = false>
cudaError_t forward_vec(const void* x, const void* input, const void* weight,
                        void* residual_out, void* y, float* rstd, int64_t rows, int64_t C,
                        float eps, float offset, cudaStream_t stream, const Fp8Delayed& d = {},
                        int64_t ld_y = 0) {
  const RowConfig cfg = row_config(C / VEC, kFwdCache);
  const int64_t blocks = (rows + cfg.rows_per_block() - 1) / cfg.rows_per_block();
  auto args = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), cfg.threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(input), static_cast<const T*>(weight),
        static_cast<T*>(residual_out), static_cast<T*>(y), rstd, rows, C, eps, offset,
        cfg.group, d, ld_y > 0 ? ld_y : C);
  };
  if (input)
    args(rms_forward_kernel<T, VEC, true, FP8>);
  else
    args(rms_forward_kernel<T, VEC, false, FP8>);
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_typed(const void* x, const void* input, const void* weight,
                          void* residual_out, void* y, float* rstd, int64_t rows, int64_t C,
                          float eps, float offset, cudaStream_t stream, int64_t ld_y) {
  constexpr int wide = 16 / sizeof(T);
  if (pick_vec<T>(C, {x, input, weight, residual_out, y}) == wide && ld_y % wide == 0)
    return forward_vec<T, wide>(x, input, weight, residual_out, y, rstd, rows, C, eps, offset,
                                stream, {}, ld_y);
  return forward_vec<T, 1>(x, input, weight, residual_out, y, rstd, rows, C, eps, offset,
                           stream, {}, ld_y);
}

// The backward's launch shape (rows.cuh row_backward_plan; partials: d_weight's)
template <typename T>
RowBackwardPlan backward_plan(int64_t rows, int64_t C) {
  constexpr int wide = 16 / sizeof(T);
  return row_backward_plan<wide>(rows, C, kBwdCache, rms_backward_kernel<T, wide>,
                                 rms_backward_kernel<T, 1>);
}

template <typename T, int VEC>
cudaError_t backward_vec(const void* d_y, const void* x, const void* weight, float offset,
                         const float* rstd, const void* d_res, void* d_x, void* d_weight,
                         float* workspace, int64_t rows, int64_t C, const RowBackwardPlan& plan,
                         cudaStream_t stream, int64_t ld_res, int64_t ld_dx) {
  if constexpr (VEC * sizeof(T) == 16) {
    constexpr int64_t kInt = std::numeric_limits<int>::max();
    if (!d_weight && C == static_cast<int64_t>(VEC) * kPipeCache * kPipeThreads &&
        rows <= kInt && ld_res <= kInt && ld_dx <= kInt) {
      // d_x alone at the pipelined kernel's row length: a persistent grid of the blocks
      // that fit at once (more would only queue)
      const int64_t grid =
          std::min<int64_t>(rows, static_cast<int64_t>(sm_count()) * kPipeBlocks);
      auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(grid), kPipeThreads, 0, stream>>>(
            static_cast<const T*>(d_y), static_cast<const T*>(x), static_cast<const T*>(weight),
            offset, rstd, static_cast<const T*>(d_res), static_cast<T*>(d_x),
            static_cast<int>(rows), static_cast<int>(C), static_cast<int>(ld_res),
            static_cast<int>(ld_dx));
      };
      if (d_res)
        launch(rms_backward_pipelined_kernel<T, VEC, true>);
      else
        launch(rms_backward_pipelined_kernel<T, VEC, false>);
      return cudaGetLastError();
    }
  }
  if (!d_weight) {
    // d_x alone (a frozen weight's) at other row lengths: no partials, so no persistent
    // grid either, a group a row as the forward's, and no column sums
    const RowConfig cfg = row_config(C / VEC, kFrozenCache);
    const int64_t per_block = cfg.rows_per_block();
    rms_backward_kernel<T, VEC, false, kFrozenCache>
        <<<static_cast<unsigned>((rows + per_block - 1) / per_block), cfg.threads, 0,
           stream>>>(static_cast<const T*>(d_y), static_cast<const T*>(x),
                     static_cast<const T*>(weight), offset, rstd, static_cast<const T*>(d_res),
                     static_cast<T*>(d_x), nullptr, rows, C, cfg.group, ld_res, ld_dx);
    return cudaGetLastError();
  }
  rms_backward_kernel<T, VEC><<<plan.grid, plan.cfg.threads, 0, stream>>>(
      static_cast<const T*>(d_y), static_cast<const T*>(x), static_cast<const T*>(weight), offset,
      rstd,
      static_cast<const T*>(d_res), static_cast<T*>(d_x), workspace, rows, C, plan.cfg.group,
      ld_res, ld_dx);
  launch_column_sum<T>(workspace, 0, plan.parts(), C, d_weight, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* d_y, const void* x, const void* weight, float offset,
                           const float* rstd, const void* d_res, void* d_x, void* d_weight,
                           float* workspace, int64_t rows, int64_t C, cudaStream_t stream,
                           int64_t ld_res, int64_t ld_dx) {
  constexpr int wide = 16 / sizeof(T);
  const RowBackwardPlan plan = backward_plan<T>(rows, C);
  if (pick_vec<T>(C, {d_y, x, weight, d_res, d_x}) == wide && ld_res % wide == 0 &&
      ld_dx % wide == 0)
    return backward_vec<T, wide>(d_y, x, weight, offset, rstd, d_res, d_x, d_weight, workspace,
                                 rows, C, plan, stream, ld_res, ld_dx);
  return backward_vec<T, 1>(d_y, x, weight, offset, rstd, d_res, d_x, d_weight, workspace, rows,
                            C, plan, stream, ld_res, ld_dx);
}

}  // namespace

cudaError_t launch_rmsnorm_forward(DType dt, const void* x, const void* input, const void* weight,
                                   void* residual_out, void* y, float* rstd, int64_t rows,
                                   int64_t C, float eps, float offset, cudaStream_t stream,
                                   int64_t ld_y) {
  if (rows == 0 || C == 0) return cudaSuccess;
  if (ld_y <= 0) ld_y = C;
  if (ld_y < C) return cudaErrorInvalidValue;
  if (dt == DType::BF16)
    return forward_typed<__nv_bfloat16>(x, input, weight, residual_out, y, rstd, rows, C, eps,
                                        offset, stream, ld_y);
  return forward_typed<float>(x, input, weight, residual_out, y, rstd, rows, C, eps, offset,
                              stream, ld_y);
}

cudaError_t launch_rmsnorm_forward_fp8(const void* x, const void* input, const void* weight,
                                       void* residual_out, void* y, float* rstd, int64_t rows,
                                       int64_t C, float eps, float offset, const Fp8Delayed& d,
                                       cudaStream_t stream) {
  using T = __nv_bfloat16;
  const auto aligned = [](const void* p, uintptr_t n) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  if (rows <= 0 || C <= 0 || rows % 8 || C % 8 || !d.out || !d.past || !d.work ||
      (d.fmt != 0 && d.fmt != 1) || pick_vec<T>(C, {x, input, weight, residual_out, y}) != 8 ||
      !aligned(d.out, 8) || !aligned(d.out_t, 8))
    return cudaErrorInvalidValue;
  const cudaError_t err = forward_vec<T, 8, true>(x, input, weight, residual_out, y, rstd, rows,
                                                  C, eps, offset, stream, d);
  if (err != cudaSuccess) return err;
  return launch_fp8_delayed_finish(y, d, true, rows, C, stream);  // y^T from the fp8 y
}

int64_t rmsnorm_backward_workspace(DType dt, int64_t rows, int64_t C) {
  if (rows == 0 || C == 0) return 0;
  const int64_t parts = dt == DType::BF16 ? backward_plan<__nv_bfloat16>(rows, C).parts()
                                           : backward_plan<float>(rows, C).parts();
  return parts * C;
}

cudaError_t launch_rmsnorm_backward(DType dt, const void* d_y, const void* x, const void* weight,
                                    float offset, const float* rstd, const void* d_residual_out,
                                    void* d_x, void* d_weight, float* workspace, int64_t rows,
                                    int64_t C, cudaStream_t stream, int64_t ld_res,
                                    int64_t ld_dx) {
  if (C == 0) return cudaSuccess;
  ld_res = ld_res > 0 ? ld_res : C;
  ld_dx = ld_dx > 0 ? ld_dx : C;
  if (rows == 0)  // no rows: d_weight is a sum over nothing
    return d_weight ? cudaMemsetAsync(d_weight, 0, C * (dt == DType::BF16 ? 2 : 4), stream)
                    : cudaSuccess;
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16>(d_y, x, weight, offset, rstd, d_residual_out, d_x,
                                         d_weight, workspace, rows, C, stream, ld_res, ld_dx);
  return backward_typed<float>(d_y, x, weight, offset, rstd, d_residual_out, d_x, d_weight,
                               workspace, rows, C, stream, ld_res, ld_dx);
}

cudaError_t launch_rmsnorm_apply(DType dt, const void* x, const float* rstd, const void* weight,
                                 float offset, void* y, int64_t rows, int64_t C,
                                 cudaStream_t stream) {
  if (rows == 0 || C == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return apply_typed<__nv_bfloat16>(x, rstd, weight, offset, y, rows, C, stream);
  return apply_typed<float>(x, rstd, weight, offset, y, rows, C, stream);
}

}  // namespace modulec
