// softmax over the last dim, forward and backward (std/primitives/softmax.module with
// dim = -1, the only form these kernels take; runtime/cuda/kernels.py sends other dims to
// the reference). Rows as norms.cu's forward: a group of threads per row (rows.cuh) keeps
// its vectors in registers; y = exp(x - max) / sum exp(x - max) in fp32 with the precise
// expf, as the reference; d_x = y * (d_y - sum(d_y * y)). bf16 or fp32 I/O.
#include "rows.cuh"

namespace modulec {
namespace {

constexpr int kFwdCache = 4;  // row vectors a thread keeps in registers (forward)
constexpr int kBwdCache = 2;  // likewise for y and d_y in the backward

struct RowSpan {
  int64_t nvec, off;
  int lane;
};

// the group's row: its vectors (0 past the last row: the group still joins reductions)
__device__ __forceinline__ RowSpan row_span(int64_t rows, int64_t C, int vec, int group) {
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const bool valid = row < rows;
  return {valid ? C / vec : 0, valid ? row * C : 0, static_cast<int>(threadIdx.x % group)};
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowMaxThreads)
softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t C,
                       int group) {
  const RowSpan s = row_span(rows, C, VEC, group);
  x += s.off;
  y += s.off;
  const int64_t first_uncached = kFwdCache * static_cast<int64_t>(group);
  float cache[kFwdCache][VEC];
  float m = neg_inf();
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = s.lane + static_cast<int64_t>(k) * group;
    if (i < s.nvec) {
      load_vec<T, VEC>(x, i, cache[k]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = fmaxf(m, cache[k][j]);
    }
  }
  for (int64_t i = s.lane + first_uncached; i < s.nvec; i += group) {
    float a[VEC];
    load_vec<T, VEC>(x, i, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) m = fmaxf(m, a[j]);
  }
  m = group_max(m, group);
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = s.lane + static_cast<int64_t>(k) * group;
    if (i < s.nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        cache[k][j] = expf(cache[k][j] - m);
        sum += cache[k][j];
      }
    }
  }
  for (int64_t i = s.lane + first_uncached; i < s.nvec; i += group) {
    float a[VEC];
    load_vec<T, VEC>(x, i, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += expf(a[j] - m);
  }
  sum = group_sum(sum, group);
#pragma unroll
  for (int k = 0; k < kFwdCache; ++k) {
    const int64_t i = s.lane + static_cast<int64_t>(k) * group;
    if (i < s.nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) cache[k][j] /= sum;
      store_vec<T, VEC>(y, i, cache[k]);
    }
  }
  for (int64_t i = s.lane + first_uncached; i < s.nvec; i += group) {
    float a[VEC];
    load_vec<T, VEC>(x, i, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] = expf(a[j] - m) / sum;
    store_vec<T, VEC>(y, i, a);
  }
}

template <int VEC>
__device__ __forceinline__ float dot(const float (&a)[VEC], const float (&b)[VEC]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += a[j] * b[j];
  return s;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_dx(const float (&g)[VEC], const float (&y)[VEC], float d,
                                         T* d_x, int64_t i) {
  float o[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) o[j] = y[j] * (g[j] - d);
  store_vec<T, VEC>(d_x, i, o);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowMaxThreads)
softmax_backward_kernel(const T* __restrict__ d_y, const T* __restrict__ y,
                        T* __restrict__ d_x, int64_t rows, int64_t C, int group) {
  const RowSpan s = row_span(rows, C, VEC, group);
  d_y += s.off;
  y += s.off;
  d_x += s.off;
  const int64_t first_uncached = kBwdCache * static_cast<int64_t>(group);
  float gs[kBwdCache][VEC], ys[kBwdCache][VEC];
  float d = 0.f;
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k) {
    const int64_t i = s.lane + static_cast<int64_t>(k) * group;
    if (i < s.nvec) {
      load_vec<T, VEC>(d_y, i, gs[k]);
      load_vec<T, VEC>(y, i, ys[k]);
      d += dot(gs[k], ys[k]);
    }
  }
  for (int64_t i = s.lane + first_uncached; i < s.nvec; i += group) {
    float g[VEC], a[VEC];
    load_vec<T, VEC>(d_y, i, g);
    load_vec<T, VEC>(y, i, a);
    d += dot(g, a);
  }
  d = group_sum(d, group);
#pragma unroll
  for (int k = 0; k < kBwdCache; ++k) {
    const int64_t i = s.lane + static_cast<int64_t>(k) * group;
    if (i < s.nvec) store_dx<T, VEC>(gs[k], ys[k], d, d_x, i);
  }
  for (int64_t i = s.lane + first_uncached; i < s.nvec; i += group) {
    float g[VEC], a[VEC];
    load_vec<T, VEC>(d_y, i, g);
    load_vec<T, VEC>(y, i, a);
    store_dx<T, VEC>(g, a, d, d_x, i);
  }
}

template <typename T>
cudaError_t forward_typed(const void* x, void* y, int64_t rows, int64_t C, cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  auto launch = [&](auto kernel, int vec) {
    const RowConfig cfg = row_config(C / vec, kFwdCache);
    const int64_t blocks = (rows + cfg.rows_per_block() - 1) / cfg.rows_per_block();
    kernel<<<static_cast<unsigned>(blocks), cfg.threads, 0, st>>>(
        static_cast<const T*>(x), static_cast<T*>(y), rows, C, cfg.group);
  };
  if (pick_vec<T>(C, {x, y}) == wide)
    launch(softmax_forward_kernel<T, wide>, wide);
  else
    launch(softmax_forward_kernel<T, 1>, 1);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* d_y, const void* y, void* d_x, int64_t rows, int64_t C,
                           cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  auto launch = [&](auto kernel, int vec) {
    const RowConfig cfg = row_config(C / vec, kBwdCache);
    const int64_t blocks = (rows + cfg.rows_per_block() - 1) / cfg.rows_per_block();
    kernel<<<static_cast<unsigned>(blocks), cfg.threads, 0, st>>>(
        static_cast<const T*>(d_y), static_cast<const T*>(y), static_cast<T*>(d_x), rows, C,
        cfg.group);
  };
  if (pick_vec<T>(C, {d_y, y, d_x}) == wide)
    launch(softmax_backward_kernel<T, wide>, wide);
  else
    launch(softmax_backward_kernel<T, 1>, 1);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_softmax_forward(DType dt, const void* x, void* y, int64_t rows, int64_t C,
                                   cudaStream_t stream) {
  if (rows == 0 || C == 0) return cudaSuccess;
  if (dt == DType::BF16) return forward_typed<__nv_bfloat16>(x, y, rows, C, stream);
  return forward_typed<float>(x, y, rows, C, stream);
}

cudaError_t launch_softmax_backward(DType dt, const void* d_y, const void* y, void* d_x,
                                    int64_t rows, int64_t C, cudaStream_t stream) {
  if (rows == 0 || C == 0) return cudaSuccess;
  if (dt == DType::BF16) return backward_typed<__nv_bfloat16>(d_y, y, d_x, rows, C, stream);
  return backward_typed<float>(d_y, y, d_x, rows, C, stream);
}

}  // namespace modulec
