// layernorm and fused_residual_layernorm, forward and backward (std/primitives/
// layernorm.module, fused_residual_layernorm.module), laid out as norms.cu's RMSNorm
// kernels: the forward gives each row a group of threads (rows.cuh) that keeps its
// vectors in registers, the mean and the biased variance taken in two passes over them
// (fp32; rows longer than the cache re-read the rest); the backward runs a persistent
// grid whose groups stride over rows, each thread keeping the d_weight and d_bias
// partials of its own columns in registers, then a second kernel sums the per-group
// partials per column (no atomics: deterministic). bf16 or fp32 I/O; mean and rstd fp32.
// y = (x - mean) * rstd * weight + bias, in that order (the reference's); no bias: none.
#include "rows.cuh"

namespace modulec {
namespace {

constexpr int kFwdCache = 4;  // row vectors a thread keeps in registers (forward)
constexpr int kBwdCache = 2;  // likewise for x and d_y in the backward

template <int VEC>
__device__ __forceinline__ float vec_sum(const float (&a)[VEC]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += a[j];
  return s;
}

template <int VEC>
__device__ __forceinline__ float centred_squares(const float (&a)[VEC], float mean) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += (a[j] - mean) * (a[j] - mean);
  return s;
}

template <typename T, int VEC, bool FUSED>
__device__ __forceinline__ void store_y(const float (&a)[VEC], const T* weight, const T* bias,
                                        T* residual_out, T* y, int64_t i, float mean, float r) {
  if constexpr (FUSED) store_vec<T, VEC>(residual_out, i, a);
  float w[VEC], o[VEC];
  load_vec<T, VEC>(weight, i, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) o[j] = (a[j] - mean) * r * w[j];
  if (bias) {
    float b[VEC];
    load_vec<T, VEC>(bias, i, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] += b[j];
  }
  store_vec<T, VEC>(y, i, o);
}

template <typename T, int VEC, bool FUSED>
__global__ void __launch_bounds__(kRowMaxThreads)
ln_forward_kernel(const T* __restrict__ x, const T* __restrict__ input,
                  const T* __restrict__ weight, const T* __restrict__ bias,
                  T* __restrict__ residual_out, T* __restrict__ y, float* __restrict__ mean_out,
                  float* __restrict__ rstd_out, int64_t rows, int64_t C, float eps, int group) {
  const int lane = threadIdx.x % group;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  // a group past the last row moves no data but still joins the reductions
  const int64_t nvec = row < rows ? C / VEC : 0;
  const int64_t off = row < rows ? row * C : 0;
  x += off;
  y += off;
  if constexpr (FUSED) {
    input += off;
    residual_out += off;
  }
  const int64_t first_uncached = kFwdCache * static_cast<int64_t>(group);
  float cache[kFwdCache][VEC];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) {
      load_x<T, VEC, FUSED>(x, input, i, cache[k]);
      s += vec_sum(cache[k]);
    }
  }
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC];
    load_x<T, VEC, FUSED>(x, input, i, a);
    s += vec_sum(a);
  }
  const float mean = group_sum(s, group) / static_cast<float>(C);
  // the variance from the centred values (two passes: no cancellation of E[x^2] - mean^2)
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) ss += centred_squares(cache[k], mean);
  }
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC];
    load_x<T, VEC, FUSED>(x, input, i, a);
    ss += centred_squares(a, mean);
  }
  const float r = rsqrtf(group_sum(ss, group) / static_cast<float>(C) + eps);
  if (lane == 0 && row < rows) {
    mean_out[row] = mean;
    rstd_out[row] = r;
  }
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) store_y<T, VEC, FUSED>(cache[k], weight, bias, residual_out, y, i, mean, r);
  }
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC];
    load_x<T, VEC, FUSED>(x, input, i, a);
    store_y<T, VEC, FUSED>(a, weight, bias, residual_out, y, i, mean, r);
  }
}

// The row sums of the backward, one vector's share: sum g and sum g * n, with
// g = d_y * weight, n = (x - mean) * rstd
template <int VEC>
__device__ __forceinline__ void dots(const float (&dy)[VEC], const float (&x)[VEC],
                                     const float (&w)[VEC], float mean, float r, float& sg,
                                     float& sgn) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float g = dy[j] * w[j];
    sg += g;
    sgn += g * ((x[j] - mean) * r);
  }
}

struct RowStats {
  float mean, r, mean_g, mean_gn;
};

// d_x = rstd * (g - mean(g) - n * mean(g * n)) of one vector (plus d_residual_out when
// fused); adds d_y * n into dw and d_y into db.
template <typename T, int VEC>
__device__ __forceinline__ void store_dx(const float (&dy)[VEC], const float (&x)[VEC],
                                         const T* weight, const T* d_res, T* d_x, int64_t i,
                                         const RowStats& st, float (&dw)[VEC],
                                         float (&db)[VEC]) {
  float w[VEC], o[VEC];
  load_vec<T, VEC>(weight, i, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float n = (x[j] - st.mean) * st.r;
    o[j] = st.r * (dy[j] * w[j] - st.mean_g - n * st.mean_gn);
    dw[j] += dy[j] * n;
    db[j] += dy[j];
  }
  if (d_res) {
    float d[VEC];
    load_vec<T, VEC>(d_res, i, d);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] += d[j];
  }
  store_vec<T, VEC>(d_x, i, o);
}

// The d_weight / d_bias partials a group keeps in registers (its cached columns)
template <int VEC>
struct Partials {
  float dw[kBwdCache][VEC], db[kBwdCache][VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void ln_backward_row(const T* d_y, const T* x, const T* weight,
                                                float mean, float r, const T* d_res, T* d_x,
                                                float* part_w, float* part_b, int64_t nvec,
                                                int64_t C, int group, int lane,
                                                Partials<VEC>& acc) {
  const int64_t first_uncached = kBwdCache * static_cast<int64_t>(group);
  float xs[kBwdCache][VEC], gs[kBwdCache][VEC];
  float sg = 0.f, sgn = 0.f;
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec) {
      float w[VEC];
      load_vec<T, VEC>(x, i, xs[k]);
      load_vec<T, VEC>(d_y, i, gs[k]);
      load_vec<T, VEC>(weight, i, w);
      dots(gs[k], xs[k], w, mean, r, sg, sgn);
    }
  }
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC], g[VEC], w[VEC];
    load_vec<T, VEC>(x, i, a);
    load_vec<T, VEC>(d_y, i, g);
    load_vec<T, VEC>(weight, i, w);
    dots(g, a, w, mean, r, sg, sgn);
  }
  const float inv_c = 1.f / static_cast<float>(C);
  const float mean_g = group_sum(sg, group) * inv_c;
  const RowStats st{mean, r, mean_g, group_sum(sgn, group) * inv_c};
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec)
      store_dx<T, VEC>(gs[k], xs[k], weight, d_res, d_x, i, st, acc.dw[k], acc.db[k]);
  }
  // uncached columns accumulate straight into this group's partial rows
  for (int64_t i = lane + first_uncached; i < nvec; i += group) {
    float a[VEC], g[VEC], w_acc[VEC] = {}, b_acc[VEC] = {};
    load_vec<T, VEC>(x, i, a);
    load_vec<T, VEC>(d_y, i, g);
    store_dx<T, VEC>(g, a, weight, d_res, d_x, i, st, w_acc, b_acc);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      part_w[i * VEC + j] += w_acc[j];
      part_b[i * VEC + j] += b_acc[j];
    }
  }
}

// Persistent grid: group g handles rows g, g + groups, ...; each thread owns the same
// columns in every row, so its partials (one row of `partial` per group for d_weight,
// then one per group for d_bias) need neither atomics nor barriers.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowMaxThreads)
ln_backward_kernel(const T* __restrict__ d_y, const T* __restrict__ x,
                   const T* __restrict__ weight, const float* __restrict__ mean,
                   const float* __restrict__ rstd, const T* __restrict__ d_res,
                   T* __restrict__ d_x, float* __restrict__ partial, int64_t rows, int64_t C,
                   int group) {
  const int64_t nvec = C / VEC;
  const int lane = threadIdx.x % group;
  const int64_t per_block = blockDim.x / group;
  const int64_t parts = static_cast<int64_t>(gridDim.x) * per_block;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / group;
  float* part_w = partial + first * C;
  float* part_b = partial + (parts + first) * C;
  Partials<VEC> acc;
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc.dw[k][j] = acc.db[k][j] = 0.f;
  for (int64_t i = lane + kBwdCache * static_cast<int64_t>(group); i < nvec; i += group)
    for (int j = 0; j < VEC; ++j) part_w[i * VEC + j] = part_b[i * VEC + j] = 0.f;
  // the loop bound is uniform across the block: every group reaches every reduction
  for (int64_t base = first - threadIdx.x / group; base < rows; base += parts) {
    const int64_t row = base + threadIdx.x / group;
    const bool valid = row < rows;
    const int64_t off = valid ? row * C : 0;
    ln_backward_row<T, VEC>(d_y + off, x + off, weight, valid ? mean[row] : 0.f,
                            valid ? rstd[row] : 0.f, d_res ? d_res + off : nullptr, d_x + off,
                            part_w, part_b, valid ? nvec : 0, C, group, lane, acc);
  }
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < nvec)
      for (int j = 0; j < VEC; ++j) {
        part_w[i * VEC + j] = acc.dw[k][j];
        part_b[i * VEC + j] = acc.db[k][j];
      }
  }
}

// ------------------------------------------------------------------- host dispatch
struct Forward {
  const void *x, *input, *weight, *bias;
  void *residual_out, *y;
  float *mean, *rstd;
};

template <typename T, int VEC>
cudaError_t forward_vec(const Forward& f, int64_t rows, int64_t C, float eps,
                        cudaStream_t stream) {
  const RowConfig cfg = row_config(C / VEC, kFwdCache);
  const int64_t blocks = (rows + cfg.rows_per_block() - 1) / cfg.rows_per_block();
  auto args = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), cfg.threads, 0, stream>>>(
        static_cast<const T*>(f.x), static_cast<const T*>(f.input),
        static_cast<const T*>(f.weight), static_cast<const T*>(f.bias),
        static_cast<T*>(f.residual_out), static_cast<T*>(f.y), f.mean, f.rstd, rows, C, eps,
        cfg.group);
  };
  if (f.input)
    args(ln_forward_kernel<T, VEC, true>);
  else
    args(ln_forward_kernel<T, VEC, false>);
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_typed(const Forward& f, int64_t rows, int64_t C, float eps,
                          cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T);
  if (pick_vec<T>(C, {f.x, f.input, f.weight, f.bias, f.residual_out, f.y}) == wide)
    return forward_vec<T, wide>(f, rows, C, eps, stream);
  return forward_vec<T, 1>(f, rows, C, eps, stream);
}

// The backward's launch shape (rows.cuh row_backward_plan; partials: d_weight's, d_bias's)
template <typename T>
RowBackwardPlan backward_plan(int64_t rows, int64_t C) {
  constexpr int wide = 16 / sizeof(T);
  return row_backward_plan<wide>(rows, C, kBwdCache, ln_backward_kernel<T, wide>,
                                 ln_backward_kernel<T, 1>);
}

struct Backward {
  const void *d_y, *x, *weight;
  const float *mean, *rstd;
  const void* d_res;
  void *d_x, *d_weight, *d_bias;
  float* workspace;
};

template <typename T, int VEC>
cudaError_t backward_vec(const Backward& b, int64_t rows, int64_t C,
                         const RowBackwardPlan& plan, cudaStream_t stream) {
  ln_backward_kernel<T, VEC><<<plan.grid, plan.cfg.threads, 0, stream>>>(
      static_cast<const T*>(b.d_y), static_cast<const T*>(b.x), static_cast<const T*>(b.weight),
      b.mean, b.rstd, static_cast<const T*>(b.d_res), static_cast<T*>(b.d_x), b.workspace, rows,
      C, plan.cfg.group);
  const int64_t parts = plan.parts();
  launch_column_sum<T>(b.workspace, 0, parts, C, b.d_weight, stream);
  if (b.d_bias) launch_column_sum<T>(b.workspace, parts, 2 * parts, C, b.d_bias, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const Backward& b, int64_t rows, int64_t C, cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T);
  const RowBackwardPlan plan = backward_plan<T>(rows, C);
  if (pick_vec<T>(C, {b.d_y, b.x, b.weight, b.d_res, b.d_x}) == wide)
    return backward_vec<T, wide>(b, rows, C, plan, stream);
  return backward_vec<T, 1>(b, rows, C, plan, stream);
}

}  // namespace

cudaError_t launch_layernorm_forward(DType dt, const void* x, const void* input,
                                     const void* weight, const void* bias, void* residual_out,
                                     void* y, float* mean, float* rstd, int64_t rows, int64_t C,
                                     float eps, cudaStream_t stream) {
  if (rows == 0 || C == 0) return cudaSuccess;
  const Forward f{x, input, weight, bias, residual_out, y, mean, rstd};
  if (dt == DType::BF16) return forward_typed<__nv_bfloat16>(f, rows, C, eps, stream);
  return forward_typed<float>(f, rows, C, eps, stream);
}

int64_t layernorm_backward_workspace(DType dt, int64_t rows, int64_t C) {
  if (rows == 0 || C == 0) return 0;
  const int64_t parts = dt == DType::BF16 ? backward_plan<__nv_bfloat16>(rows, C).parts()
                                           : backward_plan<float>(rows, C).parts();
  return 2 * parts * C;  // d_weight's partials, then d_bias's
}

cudaError_t launch_layernorm_backward(DType dt, const void* d_y, const void* x,
                                      const void* weight, const float* mean, const float* rstd,
                                      const void* d_residual_out, void* d_x, void* d_weight,
                                      void* d_bias, float* workspace, int64_t rows, int64_t C,
                                      cudaStream_t stream) {
  if (C == 0) return cudaSuccess;
  const int64_t bytes = C * (dt == DType::BF16 ? 2 : 4);
  if (rows == 0) {  // no rows: the parameter gradients are sums over nothing
    cudaError_t err = cudaMemsetAsync(d_weight, 0, bytes, stream);
    if (err == cudaSuccess && d_bias) err = cudaMemsetAsync(d_bias, 0, bytes, stream);
    return err;
  }
  const Backward b{d_y, x, weight, mean, rstd, d_residual_out, d_x, d_weight, d_bias, workspace};
  if (dt == DType::BF16) return backward_typed<__nv_bfloat16>(b, rows, C, stream);
  return backward_typed<float>(b, rows, C, stream);
}

}  // namespace modulec
