// Row-wise kernels' launch shape and reductions (norms.cu, layernorm.cu, softmax.cu): a
// row of C elements is handled by a "group" of threads, the whole block for long rows or
// a power-of-two slice of a warp for rows of at most 32 vectors (a block per short row
// would leave most threads idle). Each thread of a group keeps the first few of its
// vectors in registers (`per_thread`), so most rows are read from memory once. Also the
// two norms' shared pieces: the fused input, the backward's plan and its column sums.
#pragma once

#include <algorithm>
#include "common.cuh"

namespace modulec {

constexpr int kRowMaxThreads = 512;   // __launch_bounds__: leaves 128 registers a thread
constexpr int kSmallRowThreads = 256;  // block size when a warp holds several rows

// Threads per row ("group") and per block.
struct RowConfig {
  int group, threads;
  int rows_per_block() const { return threads / group; }
};

// Threads for a row of `nvec` vectors when each thread caches `per_thread` of them.
inline int row_threads(int64_t nvec, int per_thread) {
  int64_t t = (nvec + per_thread - 1) / per_thread;
  t = (t + 31) / 32 * 32;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(t, 64), kRowMaxThreads));
}

// Rows of at most 32 vectors get a power-of-two slice of a warp, one thread a vector;
// longer rows get the block.
inline RowConfig row_config(int64_t nvec, int per_thread) {
  if (nvec > 32) {
    const int t = row_threads(nvec, per_thread);
    return {t, t};
  }
  int group = 1;
  while (group < nvec) group <<= 1;
  return {group, kSmallRowThreads};
}

// Sum over the row's group: the block, or `group` consecutive lanes of a warp (the xor
// shuffle stays inside aligned power-of-two slices). Uniform across the block.
__device__ __forceinline__ float group_sum(float v, int group) {
  if (group >= static_cast<int>(blockDim.x)) return block_sum(v);
  for (int off = group >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// -inf: the max over nothing
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Max over the block, returned to every thread (the leading barrier as block_sum's).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_max(lane < warps ? partial[lane] : neg_inf());
}

// Max over the row's group, as group_sum.
__device__ __forceinline__ float group_max(float v, int group) {
  if (group >= static_cast<int>(blockDim.x)) return block_max(v);
  for (int off = group >> 1; off > 0; off >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// ---- the norms' shared pieces (norms.cu's RMSNorm, layernorm.cu's LayerNorm)

// The row's value to normalize: x, or residual + input in fp32 for the fused kernels (the
// reference normalizes the fp32 sum, not residual_out rounded to the I/O dtype).
template <typename T, int VEC, bool FUSED>
__device__ __forceinline__ void load_x(const T* x, const T* input, int64_t i, float (&a)[VEC]) {
  load_vec<T, VEC>(x, i, a);
  if constexpr (FUSED) {
    float b[VEC];
    load_vec<T, VEC>(input, i, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] += b[j];
  }
}

// The backward's second pass: out[c] = sum over parts [first, end) of partial[part][c]
// (common.cuh column_sum_block; no atomics: deterministic). In an unnamed namespace: each
// file that launches it has its own kernel, as a kernel defined in the file would be.
namespace {

template <typename T>
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t first, int64_t end,
                                  int64_t C, T* __restrict__ out) {
  column_sum_block<T>(partial, first, end, C, out);
}

template <typename T>
void launch_column_sum(const float* partial, int64_t first, int64_t end, int64_t C, void* out,
                       cudaStream_t stream) {
  const unsigned col_blocks = static_cast<unsigned>((C + 31) / 32);
  column_sum_kernel<T><<<col_blocks, dim3(32, 8), 0, stream>>>(partial, first, end, C,
                                                                static_cast<T*>(out));
}

}  // namespace

// The persistent backward's launch shape, from the sizes alone: the workspace is sized
// before the launch, which may then fall back to scalar access (unaligned pointers) on the
// same shape, since a group handles rows of any length. The grid holds as many blocks as
// fit on the GPU at once: more would only add partials. `cache`: the vectors a thread
// keeps; the kernels: the vector path's (WIDE a thread) and the scalar path's.
struct RowBackwardPlan {
  RowConfig cfg;
  int grid;
  int64_t parts() const { return static_cast<int64_t>(grid) * cfg.rows_per_block(); }
};

template <int WIDE, typename VecKernel, typename ScalarKernel>
RowBackwardPlan row_backward_plan(int64_t rows, int64_t C, int cache, VecKernel vec_kernel,
                                  ScalarKernel scalar_kernel) {
  const bool vector = C % WIDE == 0;
  const RowConfig cfg = row_config(vector ? C / WIDE : C, cache);
  int per_sm = 0;
  if (vector)
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, vec_kernel, cfg.threads, 0);
  else
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scalar_kernel, cfg.threads, 0);
  const int64_t needed = (rows + cfg.rows_per_block() - 1) / cfg.rows_per_block();
  const int64_t resident = static_cast<int64_t>(sm_count()) * std::max(per_sm, 1);
  return {cfg, static_cast<int>(std::min(needed, resident))};
}

}  // namespace modulec
