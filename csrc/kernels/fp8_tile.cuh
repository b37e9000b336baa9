// The 64 x 64 fp8 tile of the 8-wide bf16 path (rows and cols multiples of 8), shared by
// fp8_cast.cu (the cast), fp8_amax.cu (the cast with the amax, the transpose) and
// swiglu.cu (swiglu's output and its fp8 copy): one block a tile of q [rows, cols]
// (tile_grid), each thread moving 8 elements at a time (16-byte loads, 8-byte fp8 stores),
// the tile kept in shared memory for the transposed copy out_t [cols, rows]. Here: the walk
// over a tile's 8-element chunks, the stores of a chunk's fp8 values and the transposed
// store. What a kernel computes for a chunk (the quantization, an amax, swiglu) stays its own.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace modulec {

constexpr int kVecTile = 64, kVecThreads = 256, kChunks = kVecTile * kVecTile / 8;

using Fp8Tile = __nv_fp8_storage_t[kVecTile][kVecTile + 8];

union Fp8x8 {
  __nv_fp8_storage_t q[8];
  uint2 packed;  // one 8-byte store
};

// Whether the tiles of cols fit grid.y (at most 65535 blocks): every tile_grid launch checks
// it first
inline bool tile_grid_fits(int64_t cols) { return (cols + kVecTile - 1) / kVecTile <= 65535; }

// One block a tile of [rows, cols] (the caller checks tile_grid_fits(cols))
inline dim3 tile_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((rows + kVecTile - 1) / kVecTile),
              static_cast<unsigned>((cols + kVecTile - 1) / kVecTile));
}

// This block's tile: rows row0 .. row0 + 63 and columns col0 .. col0 + 63
struct TileAt {
  int64_t row0, col0;
};

__device__ __forceinline__ TileAt block_tile() {
  return {static_cast<int64_t>(blockIdx.x) * kVecTile,
          static_cast<int64_t>(blockIdx.y) * kVecTile};
}

// 8 elements of tile row r from tile column c: row gr, columns gc .. gc + 7 of [rows, cols]
struct Chunk {
  int r, c;
  int64_t gr, gc;
};

// chunk(k) for each of this thread's chunks of tile t that lie inside [rows, cols]
template <typename F>
__device__ __forceinline__ void for_each_chunk(TileAt t, int64_t rows, int64_t cols,
                                               F&& chunk) {
  for (int i = threadIdx.x; i < kChunks; i += blockDim.x) {
    const int r = i / 8, c = (i % 8) * 8;
    const Chunk k{r, c, t.row0 + r, t.col0 + c};
    if (k.gr >= rows || k.gc >= cols) continue;
    chunk(k);
  }
}

// A chunk's 8 fp8 values into out [rows, cols] and into the tile (for out_t). OUT_OPTIONAL:
// out may be null (only out_t asked for); else the launch has checked that it is not.
template <bool OUT_OPTIONAL>
__device__ __forceinline__ void put8(Fp8Tile& tile, __nv_fp8_storage_t* __restrict__ out,
                                     int64_t cols, const Chunk& k, const Fp8x8& u) {
  if (!OUT_OPTIONAL || out) *reinterpret_cast<uint2*>(out + k.gr * cols + k.gc) = u.packed;
  *reinterpret_cast<uint2*>(&tile[k.r][k.c]) = u.packed;
}

// out_t[c][r] = tile[r][c] for tile t of q [rows, cols]: 8 elements of a tile column, one
// 8-byte store, a step. The caller synchronizes the block first.
__device__ __forceinline__ void store_transposed(const Fp8Tile& tile,
                                                 __nv_fp8_storage_t* __restrict__ out_t,
                                                 TileAt t, int64_t rows, int64_t cols) {
  for (int i = threadIdx.x; i < kChunks; i += blockDim.x) {
    const int c = i / 8, r = (i % 8) * 8;  // out_t row col0 + c, 8 elements from row0 + r
    const int64_t gc = t.col0 + c, gr = t.row0 + r;
    if (gr >= rows || gc >= cols) continue;
    Fp8x8 u;
#pragma unroll
    for (int j = 0; j < 8; ++j) u.q[j] = tile[r + j][c];
    *reinterpret_cast<uint2*>(out_t + gc * rows + gr) = u.packed;
  }
}

}  // namespace modulec
