// FP8 pieces shared by fp8_cast.cu (the cast, the scale), fp8_amax.cu (the amax with the
// scale, the cast with the amax) and the producers that write delayed scaling's fp8 copy
// of their output (norms.cu, swiglu.cu: `DelayedSink`): the quantization of one value, the
// scale from an amax, the grid's amax (the 8-wide bf16 path's 64 x 64 tile: fp8_tile.cuh).
// The numbers of runtime/fp8_gemm.py's torch ops (decisions.md, "FP8 on the GPU").
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"
#include "fp8_tile.cuh"

namespace modulec {

// fp8(clamp(x * scale, +-top)): an fp32 product, the clamp (keeping NaN, as torch's does),
// then round to nearest even (subnormals kept) by the CUDA fp8 conversion.
__device__ __forceinline__ __nv_fp8_storage_t quantize(float x, float scale, float top,
                                                       __nv_fp8_interpretation_t fmt) {
  float v = x * scale;
  if (!isnan(v)) v = fminf(fmaxf(v, -top), top);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt);
}

// fp32(top / amax) computed in float64; 1 for an amax of 0 or not finite
__device__ __forceinline__ float scale_of(float amax, double top) {
  const double wide = static_cast<double>(amax);
  return (isfinite(wide) && wide > 0.0) ? static_cast<float>(top / wide) : 1.f;
}

// The operand's amax `a` recorded into its pending slot (fmax: a NaN is not recorded), the
// delayed amax where the history has one (*past >= 0), then the scale from it and its
// reciprocal (scale_from, torch.reciprocal).
__device__ __forceinline__ void record_and_scale(float a, float* pending, const float* past,
                                                 double top, float* scale, float* inv_scale) {
  if (pending && !isnan(a)) *pending = fmaxf(*pending, a);
  if (past && *past >= 0.f) a = *past;
  const float s = scale_of(a, top);
  *scale = s;
  *inv_scale = 1.f / s;
}

__host__ __device__ __forceinline__ __nv_fp8_interpretation_t fp8_kind(int fmt) {
  return fmt == 0 ? __NV_E4M3 : __NV_E5M2;
}
// the clamp of quantize: the format's largest finite value
__host__ __device__ __forceinline__ float fp8_clamp(int fmt) {
  return fmt == 0 ? 448.0f : 57344.0f;
}

// |v|'s bits as an unsigned integer: ordered as the magnitudes, any NaN above +inf
__device__ __forceinline__ unsigned magnitude_bits(float v) {
  return __float_as_uint(v) & 0x7fffffffu;
}

// The block's maximum of m (every thread calls it; blockDim a multiple of 32, `warps` a
// shared array of blockDim / 32) into work[0]; the last block of the grid to finish gets
// the grid's maximum (others: false) and resets work (two counters, zero between calls).
__device__ __forceinline__ bool grid_max(unsigned m, unsigned* work, unsigned* warps,
                                         float* amax) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x != 0) return false;
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = max(m, warps[w]);  // w 0: m
  atomicMax(&work[0], m);
  __threadfence();  // this block's maximum visible before its ticket
  const unsigned blocks = gridDim.x * gridDim.y;
  if (atomicAdd(&work[1], 1u) != blocks - 1) return false;  // not the last block
  __threadfence();
  *amax = __uint_as_float(atomicMax(&work[0], 0u));  // every block's, read atomically
  work[0] = 0u;
  work[1] = 0u;
  return true;
}

// ---- a producer's fp8 copy of its output under delayed scaling (kernels.h Fp8Delayed):
// where the history has an amax (*past >= 0) the scale is known before the producer runs,
// so each element it writes (rounded to bf16 first: the value the separate cast would
// read) is quantized at that scale as it is written; every element's magnitude goes into
// the grid's amax, which the last block records and turns into *scale / *inv_scale as
// fp8_amax.cu's delayed cast does. No history: nothing is quantized here, the scale comes
// from this amax and launch_fp8_delayed_finish casts from the written output.
struct DelayedSink {
  float scale, top;
  __nv_fp8_interpretation_t kind;
  bool write;  // a history: quantize as the output is written
  unsigned m;  // this thread's max magnitude bits so far
};

__device__ __forceinline__ DelayedSink delayed_sink(const Fp8Delayed& d) {
  const bool have = *d.past >= 0.f;
  return {have ? scale_of(*d.past, d.top) : 0.f, fp8_clamp(d.fmt), fp8_kind(d.fmt), have, 0u};
}

// 8 output values (as stored: bf16-rounded) into the amax, and quantized when writing
__device__ __forceinline__ Fp8x8 sink8(DelayedSink& s, const float (&v)[8]) {
  Fp8x8 u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s.m = max(s.m, magnitude_bits(v[j]));
    if (s.write) u.q[j] = quantize(v[j], s.scale, s.top, s.kind);
  }
  return u;
}

// The grid's amax recorded and the scale written (every thread of every block calls it)
template <int THREADS>
__device__ __forceinline__ void sink_finish(const DelayedSink& s, const Fp8Delayed& d) {
  __shared__ unsigned warps[THREADS / 32];
  float a;
  if (grid_max(s.m, d.work, warps, &a))
    record_and_scale(a, d.pending, d.past, d.top, d.scale, d.inv_scale);
}


}  // namespace modulec
