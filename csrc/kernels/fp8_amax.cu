// An FP8 GEMM operand's amax and scale in one launch (runtime/fp8_gemm.py
// ScaleState.scales; decisions.md, "FP8 on the GPU"): a grid-stride max of |x| over the
// bits of |x| as unsigned integers (ordered as the magnitudes, any NaN above +inf, so the
// max keeps a NaN as torch's vector_norm(inf) does), each block's maximum atomically into
// work[0]; the last block to finish (a ticket in work[1]) then does what fp8_scale_kernel
// does with that amax (record into the pending slot, the delayed window, fp32(top / amax)
// in float64 and its reciprocal) and resets work for the next call (calls are ordered on
// the stream: one work buffer serves them all). Where the amax reduction and fp8_scale were
// two launches and torch's reduction, this is one launch and one read of x. Also what
// follows a producer that wrote its output's fp8 copy itself (launch_fp8_delayed_finish:
// the cast where there was no history yet, or y^T from the fp8 y).
#include "fp8.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256, kMaxBlocks = 1024;

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
  __shared__ unsigned warps[kThreads / 32];
  float a;
  if (grid_max(m, work, warps, &a)) record_and_scale(a, pending, past, top, scale, inv_scale);
}

// ---- delayed scaling: the cast with the amax in one pass (fp8_cast.cu's 8-wide kernel,
// bf16, rows and cols multiples of 8). FIRST: where the history has an amax (*past >= 0)
// the scale is known before x is read: each block casts its 64 x 64 tile at that scale
// (x's layout and / or transposed) and takes its amax; the last block records it and
// writes the scale. Where the history is empty (a first step) it only takes the amax; the
// last block writes the scale from it, and the second launch (!FIRST, which returns at once
// where *past >= 0) casts at that scale. The same numbers as the amax, scale and cast
// launches. The tile and its transposed store: fp8_tile.cuh; quantize: fp8.cuh.
template <bool FIRST>
__global__ void fp8_cast_delayed_kernel(const __nv_bfloat16* __restrict__ x, unsigned* work,
                                        float* pending, const float* __restrict__ past,
                                        double top_scale, float top,
                                        __nv_fp8_interpretation_t fmt, float* scale,
                                        float* inv_scale, __nv_fp8_storage_t* __restrict__ out,
                                        __nv_fp8_storage_t* __restrict__ out_t, int64_t rows,
                                        int64_t cols) {
  __shared__ __align__(16) Fp8Tile tile;
  __shared__ unsigned warps[kVecThreads / 32];
  const bool have = *past >= 0.f;
  if (!FIRST && have) return;  // cast already
  const bool write = !FIRST || have;
  const float s = FIRST ? (have ? scale_of(*past, top_scale) : 0.f) : *scale;
  const TileAt t = block_tile();
  unsigned m = 0;
  for_each_chunk(t, rows, cols, [&](const Chunk& k) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + k.gr * cols + k.gc);
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    Fp8x8 u;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float f = __bfloat162float(v[j]);
      if (FIRST) m = max(m, magnitude_bits(f));
      if (write) u.q[j] = quantize(f, s, top, fmt);
    }
    if (write) put8<true>(tile, out, cols, k, u);
  });
  if (FIRST) {
    float a;
    if (grid_max(m, work, warps, &a))
      record_and_scale(a, pending, past, top_scale, scale, inv_scale);
  }
  if (!write || !out_t) return;
  __syncthreads();
  store_transposed(tile, out_t, t, rows, cols);
}

// out_t = out^T (fp8 bytes, 64 x 64 tiles through shared memory) where the history has an
// amax (*past >= 0: the producer quantized out); else nothing (fp8_cast_delayed_kernel
// <false> cast both layouts). launch_fp8_delayed_finish.
__global__ void fp8_transpose_kernel(const float* __restrict__ past,
                                     const __nv_fp8_storage_t* __restrict__ out,
                                     __nv_fp8_storage_t* __restrict__ out_t, int64_t rows,
                                     int64_t cols) {
  __shared__ __align__(16) Fp8Tile tile;
  if (!(*past >= 0.f)) return;  // the producer's test (fp8.cuh delayed_sink)
  const TileAt t = block_tile();
  for_each_chunk(t, rows, cols, [&](const Chunk& k) {  // 8 bytes of tile row k.r
    *reinterpret_cast<uint2*>(&tile[k.r][k.c]) =
        *reinterpret_cast<const uint2*>(out + k.gr * cols + k.gc);
  });
  __syncthreads();
  store_transposed(tile, out_t, t, rows, cols);
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

cudaError_t launch_fp8_cast_delayed(const void* x, unsigned* work, float* pending,
                                    const float* past, double top, int fmt, float* scale,
                                    float* inv_scale, void* out, void* out_t, int64_t rows,
                                    int64_t cols, cudaStream_t stream) {
  const auto aligned = [](const void* p, uintptr_t n) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  if (rows <= 0 || cols <= 0 || rows % 8 || cols % 8 || !aligned(x, 16) || !aligned(out, 8) ||
      !aligned(out_t, 8) || (!out && !out_t) || (fmt != 0 && fmt != 1) || !past ||
      !tile_grid_fits(cols))
    return cudaErrorInvalidValue;
  const __nv_fp8_interpretation_t kind = fp8_kind(fmt);
  const float clamp = fp8_clamp(fmt);
  const dim3 grid = tile_grid(rows, cols);
  const auto* in = static_cast<const __nv_bfloat16*>(x);
  auto* q = static_cast<__nv_fp8_storage_t*>(out);
  auto* q_t = static_cast<__nv_fp8_storage_t*>(out_t);
  fp8_cast_delayed_kernel<true><<<grid, kVecThreads, 0, stream>>>(
      in, work, pending, past, top, clamp, kind, scale, inv_scale, q, q_t, rows, cols);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  fp8_cast_delayed_kernel<false><<<grid, kVecThreads, 0, stream>>>(
      in, work, pending, past, top, clamp, kind, scale, inv_scale, q, q_t, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_fp8_delayed_finish(const void* x, const Fp8Delayed& d, bool transpose_plain,
                                      int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || rows % 8 || cols % 8 || !d.out || !d.past ||
      (d.fmt != 0 && d.fmt != 1) || !tile_grid_fits(cols))
    return cudaErrorInvalidValue;
  const dim3 grid = tile_grid(rows, cols);
  auto* q = static_cast<__nv_fp8_storage_t*>(d.out);
  auto* q_t = static_cast<__nv_fp8_storage_t*>(d.out_t);
  // no history: both layouts cast from x at the scale the producer wrote (returns at once
  // where *past >= 0)
  fp8_cast_delayed_kernel<false><<<grid, kVecThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), d.work, d.pending, d.past, d.top,
      fp8_clamp(d.fmt), fp8_kind(d.fmt), d.scale, d.inv_scale, q, q_t, rows, cols);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !transpose_plain || !q_t) return err;
  fp8_transpose_kernel<<<grid, kVecThreads, 0, stream>>>(d.past, q, q_t, rows, cols);
  return cudaGetLastError();
}

}  // namespace modulec
