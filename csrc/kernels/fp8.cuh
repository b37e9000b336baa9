// FP8 pieces shared by fp8_cast.cu (the cast, the scale) and fp8_amax.cu (the amax with
// the scale, the cast with the amax): the quantization of one value, the scale from an
// amax, and the 8-wide bf16 path's 64 x 64 tile and its transposed store. The numbers of
// runtime/fp8_gemm.py's torch ops (decisions.md, "FP8 on the GPU").
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

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

// bf16 with rows and cols multiples of 8: 64 x 64 tiles, each thread moving 8 elements at
// a time (16-byte loads, 8-byte fp8 stores), the tile kept in shared memory for out_t.
constexpr int kVecTile = 64, kVecThreads = 256, kChunks = kVecTile * kVecTile / 8;

using Fp8Tile = __nv_fp8_storage_t[kVecTile][kVecTile + 8];

// out_t[c][r] = tile[r][c] for the tile at (row0, col0) of q [rows, cols]: 8 elements of a
// tile column, one 8-byte store, a step. The caller synchronizes the block first.
__device__ __forceinline__ void store_transposed(const Fp8Tile& tile,
                                                 __nv_fp8_storage_t* __restrict__ out_t,
                                                 int64_t row0, int64_t col0, int64_t rows,
                                                 int64_t cols) {
  for (int i = threadIdx.x; i < kChunks; i += blockDim.x) {
    const int c = i / 8, r = (i % 8) * 8;  // out_t row col0 + c, 8 elements from row0 + r
    const int64_t gc = col0 + c, gr = row0 + r;
    if (gr >= rows || gc >= cols) continue;
    union { __nv_fp8_storage_t q[8]; uint2 packed; } u;
#pragma unroll
    for (int j = 0; j < 8; ++j) u.q[j] = tile[r + j][c];
    *reinterpret_cast<uint2*>(out_t + gc * rows + gr) = u.packed;
  }
}

}  // namespace modulec
