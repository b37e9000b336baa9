// Row-wise kernels' launch shape and reductions (norms.cu, layernorm.cu, softmax.cu): a
// row of C elements is handled by a "group" of threads, the whole block for long rows or
// a power-of-two slice of a warp for rows of at most 32 vectors (a block per short row
// would leave most threads idle). Each thread of a group keeps the first few of its
// vectors in registers (`per_thread`), so most rows are read from memory once.
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

}  // namespace modulec
