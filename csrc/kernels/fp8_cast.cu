// FP8 cast of a GEMM operand (runtime/fp8_gemm.py; decisions.md, "FP8 on the GPU"): one
// pass over x [rows, cols] (bf16 or fp32, contiguous) writing q = fp8(clamp(x * scale,
// +-fp8_max)) in x's layout (`out`, [rows, cols]) and/or transposed (`out_t`, [cols, rows]),
// the layouts torch._scaled_mm takes. The same numbers as the torch ops it replaces
// (x.to(fp32) * scale, clamp keeping NaN, .to(float8)): an fp32 product, the clamp, then
// round to nearest even (subnormals kept) by the CUDA fp8 conversion. `scale` is a device
// fp32 scalar (the recipe's scale: no host sync). bf16 with both dims multiples of 8 (the
// GEMM shapes): 64 x 64 tiles, 8 elements a thread at a time; otherwise 32 x 32 tiles, a
// block of 32 x 8 threads reading a tile row-major (coalesced), writing `out` the same way
// and `out_t` through shared memory, transposed.
#include "fp8.cuh"

namespace modulec {
namespace {

constexpr int kTile = 32, kRowsPerPass = 8;

template <typename T>
__global__ void fp8_cast_kernel(const T* __restrict__ x, const float* __restrict__ scale_ptr,
                                float top, __nv_fp8_interpretation_t fmt,
                                __nv_fp8_storage_t* __restrict__ out,
                                __nv_fp8_storage_t* __restrict__ out_t, int64_t rows,
                                int64_t cols) {
  __shared__ __nv_fp8_storage_t tile[kTile][kTile + 4];
  const float scale = *scale_ptr;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;  // rows: up to 2^31 tiles
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int tx = threadIdx.x;
#pragma unroll
  for (int k = 0; k < kTile; k += kRowsPerPass) {
    const int ty = threadIdx.y + k;
    const int64_t r = row0 + ty, c = col0 + tx;
    if (r < rows && c < cols) {
      const __nv_fp8_storage_t q = quantize(to_float(x[r * cols + c]), scale, top, fmt);
      if (out) out[r * cols + c] = q;
      tile[ty][tx] = q;
    }
  }
  if (!out_t) return;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kTile; k += kRowsPerPass) {
    const int ty = threadIdx.y + k;
    const int64_t c = col0 + ty, r = row0 + tx;  // out_t[c][r] = q[r][c]
    if (r < rows && c < cols) out_t[c * rows + r] = tile[tx][ty];
  }
}

// bf16 with rows and cols multiples of 8 (16-byte aligned x, 8-byte aligned outputs): 64 x
// 64 tiles, each thread moving 8 elements at a time (16-byte loads, 8-byte fp8 stores, in
// x's layout and, through shared memory, transposed; fp8_tile.cuh).
__global__ void fp8_cast_bf16x8_kernel(const __nv_bfloat16* __restrict__ x,
                                       const float* __restrict__ scale_ptr, float top,
                                       __nv_fp8_interpretation_t fmt,
                                       __nv_fp8_storage_t* __restrict__ out,
                                       __nv_fp8_storage_t* __restrict__ out_t, int64_t rows,
                                       int64_t cols) {
  __shared__ __align__(16) Fp8Tile tile;
  const float scale = *scale_ptr;
  const TileAt t = block_tile();
  for_each_chunk(t, rows, cols, [&](const Chunk& k) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + k.gr * cols + k.gc);
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    Fp8x8 u;
#pragma unroll
    for (int j = 0; j < 8; ++j) u.q[j] = quantize(to_float(v[j]), scale, top, fmt);
    put8<true>(tile, out, cols, k, u);
  });
  if (!out_t) return;
  __syncthreads();
  store_transposed(tile, out_t, t, rows, cols);
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename T>
cudaError_t cast_typed(const void* x, const float* scale, float top,
                       __nv_fp8_interpretation_t fmt, void* out, void* out_t, int64_t rows,
                       int64_t cols, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((rows + kTile - 1) / kTile),
                  static_cast<unsigned>((cols + kTile - 1) / kTile));
  fp8_cast_kernel<T><<<grid, dim3(kTile, kRowsPerPass), 0, stream>>>(
      static_cast<const T*>(x), scale, top, fmt, static_cast<__nv_fp8_storage_t*>(out),
      static_cast<__nv_fp8_storage_t*>(out_t), rows, cols);
  return cudaGetLastError();
}

// One thread: the operand's amax recorded into its pending slot (fmax: a NaN is not
// recorded), the delayed amax where the history has one, then scale = top / amax in
// float64 rounded to fp32 (1 for an amax of 0 or not finite) and its reciprocal: the
// numbers of runtime/fp8_gemm.py's torch ops (scale_from, torch.reciprocal) in one launch.
__global__ void fp8_scale_kernel(const float* __restrict__ amax, float* __restrict__ pending,
                                 const float* __restrict__ past, double top,
                                 float* __restrict__ scale, float* __restrict__ inv_scale) {
  record_and_scale(*amax, pending, past, top, scale, inv_scale);
}

}  // namespace

cudaError_t launch_fp8_scale(const float* amax, float* pending, const float* past, double top,
                             float* scale, float* inv_scale, cudaStream_t stream) {
  fp8_scale_kernel<<<1, 1, 0, stream>>>(amax, pending, past, top, scale, inv_scale);
  return cudaGetLastError();
}

cudaError_t launch_fp8_cast(DType dt, const void* x, const float* scale, int fmt, void* out,
                            void* out_t, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0 || (!out && !out_t)) return cudaSuccess;
  if ((cols + kTile - 1) / kTile > 65535) return cudaErrorInvalidValue;  // grid.y
  if (fmt != 0 && fmt != 1) return cudaErrorInvalidValue;
  const __nv_fp8_interpretation_t kind = fp8_kind(fmt);
  const float top = fp8_clamp(fmt);
  if (dt == DType::BF16 && rows % 8 == 0 && cols % 8 == 0 && aligned(x, 16) &&
      (!out || aligned(out, 8)) && (!out_t || aligned(out_t, 8)) &&
      tile_grid_fits(cols)) {
    fp8_cast_bf16x8_kernel<<<tile_grid(rows, cols), kVecThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), scale, top, kind,
        static_cast<__nv_fp8_storage_t*>(out), static_cast<__nv_fp8_storage_t*>(out_t), rows,
        cols);
    return cudaGetLastError();
  }
  if (dt == DType::BF16)
    return cast_typed<__nv_bfloat16>(x, scale, top, kind, out, out_t, rows, cols, stream);
  if (dt == DType::F32)
    return cast_typed<float>(x, scale, top, kind, out, out_t, rows, cols, stream);
  return cudaErrorInvalidValue;
}

}  // namespace modulec
