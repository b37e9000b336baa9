// Shared device helpers for the modulec CUDA kernels: dtype conversion, 16-byte vector
// access, warp and block reductions. Plain CUDA C++ (no torch headers) so that every
// kernel file compiles alone with `nvcc -std=c++17 -arch=sm_90a -c`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace modulec {

// Explicit conversions: torch builds .cu files with __CUDA_NO_BFLOAT16_CONVERSIONS__ (and
// the half one), so no implicit bf16/fp16 <-> float conversion may be relied on.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
// round-to-nearest-even, as torch's .to(torch.bfloat16)
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// VEC elements moved as one access; VEC * sizeof(T) == 16 gives 16-byte loads/stores.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, int64_t i, float (&out)[VEC]) {
  Vec<T, VEC> r = reinterpret_cast<const Vec<T, VEC>*>(p)[i];
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_float(r.v[j]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, int64_t i, const float (&in)[VEC]) {
  Vec<T, VEC> r;
#pragma unroll
  for (int j = 0; j < VEC; ++j) r.v[j] = from_float<T>(in[j]);
  reinterpret_cast<Vec<T, VEC>*>(p)[i] = r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block, returned to every thread. The leading barrier lets a loop call it
// once per row: no warp overwrites `partial` while another still reads the last total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? partial[lane] : 0.f);
}

// out[col] = sum over parts [first, end) of partial[p * C + col], for the 32 columns of
// blockIdx.x: 8 warps stride over the parts (coalesced 128-byte rows), then add the 8
// sums in a fixed order (deterministic). Launch with dim3(32, 8) threads.
template <typename T>
__device__ __forceinline__ void column_sum_block(const float* __restrict__ partial,
                                                 int64_t first, int64_t end, int64_t C,
                                                 T* __restrict__ out) {
  __shared__ float acc[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < C)
    for (int64_t p = first + threadIdx.y; p < end; p += 8) s += partial[p * C + col];
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    float t = 0.f;
    for (int k = 0; k < 8; ++k) t += acc[k][threadIdx.x];
    out[col] = from_float<T>(t);
  }
}

// The widest vector (16 bytes) when every pointer is 16-byte aligned and `n` is a
// multiple of it, else 1 (scalar).
template <typename T>
inline int pick_vec(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int wide = 16 / sizeof(T);
  if (n % wide) return 1;
  for (const void* p : ptrs)
    if (p && reinterpret_cast<uintptr_t>(p) % 16) return 1;
  return wide;
}

inline int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 1;
}

}  // namespace modulec
