// An FP8 GEMM operand's amax and scale in one launch (runtime/fp8_gemm.py
// ScaleState.scales; decisions.md, "FP8 on the GPU"): a grid-stride max of |x| over the
// bits of |x| as unsigned integers (ordered as the magnitudes, any NaN above +inf, so the
// max keeps a NaN as torch's vector_norm(inf) does), each block's maximum atomically into
// work[0]; the last block to finish (a ticket in work[1]) then does what fp8_scale_kernel
// does with that amax (record into the pending slot, the delayed window, fp32(top / amax)
// in float64 and its reciprocal) and resets work for the next call (calls are ordered on
// the stream: one work buffer serves them all). Where the amax reduction and fp8_scale were
// two launches and torch's reduction, this is one launch and one read of x.
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256, kMaxBlocks = 1024;

__device__ __forceinline__ unsigned magnitude_bits(float v) {
  return __float_as_uint(v) & 0x7fffffffu;
}

__device__ __forceinline__ void finish(float a, float* pending, const float* past, double top,
                                       float* scale, float* inv_scale) {
  if (pending && !isnan(a)) *pending = fmaxf(*pending, a);
  if (past && *past >= 0.f) a = *past;
  const double wide = static_cast<double>(a);
  const float s = (isfinite(wide) && wide > 0.0) ? static_cast<float>(top / wide) : 1.f;
  *scale = s;
  *inv_scale = 1.f / s;
}

// VEC 8: bf16 x 16-byte aligned with n a multiple of 8 (one 16-byte load a step)
template <typename T, int VEC>
__global__ void fp8_amax_scale_kernel(const T* __restrict__ x, int64_t n, unsigned* work,
                                      float* pending, const float* past, double top,
                                      float* scale, float* inv_scale) {
  unsigned m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (VEC == 8) {
    const uint4* chunks = reinterpret_cast<const uint4*>(x);
    for (int64_t i = start; i < n / 8; i += stride) {
      const uint4 raw = chunks[i];
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = max(m, magnitude_bits(to_float(v[j])));
    }
  } else {
    for (int64_t i = start; i < n; i += stride) m = max(m, magnitude_bits(to_float(x[i])));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ unsigned warps[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = max(m, warps[w]);  // warp 0's is m
  atomicMax(&work[0], m);
  __threadfence();  // this block's maximum visible before its ticket
  if (atomicAdd(&work[1], 1u) != gridDim.x - 1) return;  // not the last block
  __threadfence();
  const float a = __uint_as_float(atomicMax(&work[0], 0u));  // every block's, read atomically
  work[0] = 0u;
  work[1] = 0u;
  finish(a, pending, past, top, scale, inv_scale);
}

template <typename T, int VEC>
cudaError_t launch(const void* x, int64_t n, unsigned* work, float* pending, const float* past,
                   double top, float* scale, float* inv_scale, cudaStream_t stream) {
  const int64_t items = VEC == 8 ? n / 8 : n;
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (items + kThreads - 1) / kThreads)));
  fp8_amax_scale_kernel<T, VEC><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(x), n, work, pending, past, top, scale, inv_scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_amax_scale(DType dt, const void* x, int64_t n, unsigned* work,
                                  float* pending, const float* past, double top, float* scale,
                                  float* inv_scale, cudaStream_t stream) {
  if (dt == DType::BF16 && n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0)
    return launch<__nv_bfloat16, 8>(x, n, work, pending, past, top, scale, inv_scale, stream);
  if (dt == DType::BF16)
    return launch<__nv_bfloat16, 1>(x, n, work, pending, past, top, scale, inv_scale, stream);
  if (dt == DType::F32)
    return launch<float, 1>(x, n, work, pending, past, top, scale, inv_scale, stream);
  return cudaErrorInvalidValue;
}

}  // namespace modulec
