// The backward of a skinny NT matmul C = alpha A B^T (A [T, R], B [N, R], R <= 64: LoRA's
// delta h (s B)^T, the adapters' rank-wide products) in one pass over d_C [T, N]:
//   d_A = alpha d_C B      [T, R]   (a sum over N)
//   d_B = alpha d_C^T A    [N, R]   (a sum over T)
// cuBLAS runs them as two GEMMs, each reading all of d_C (by far the largest operand: a
// LoRA 8B layer's four are 176 MB at T=2048) and each too thin to reach the card's
// bandwidth. Here each CTA stages a tile of d_C (kRows x kCols, bf16) in shared memory
// once and feeds both products from it on the tensor cores (mma.sync m16n8k16, fp32
// accumulation): d_A's rows stay in registers across the CTA's run of column chunks,
// d_B's chunk is summed over the CTA's rows. A second kernel scales by alpha and casts to
// bf16. The CTAs' parts meet one of two ways:
// - partials (where the caller gives their workspace: skinny_partial_floats): each CTA
//   stores its own [kRows, R] slice of d_A (one slice per CTA column) and its [N, W] slice
//   of d_B (one per row block; W = 16 where B is block-diagonal, else R) with plain
//   stores, and the second kernel sums the slices in a fixed order: no atomics, nothing
//   to zero, the same bits every run. On one H200 at LoRA 8B's gate/up the atomics cost
//   ~11 of the kernel's 57 us (benchmarks/kernels/skinny_grads_variants.cu).
// - sums (where the partials' workspace would be too large: it grows with T): fp32
//   buffers [T, R] and [N, R] the caller keeps zeroed, added into through float4 atomics
//   (d_B: T / kRows adds an element, d_A: one per CTA along N) and zeroed again by the
//   second kernel. The atomics' order varies, so the last bits may differ between runs
//   (the caller falls back to cuBLAS where torch's deterministic mode is on).
//
// Shapes the caller guarantees (runtime/cuda/skinny_grads.py): T % kRows == 0,
// N % kCols == 0, R in {16, 32, 48, 64}; d_C's and A's rows 16-byte aligned (ld, lda
// multiples of 8: the LoRA step's A, its t = x A^T, may lie in x's spare columns,
// runtime/cuda/lora_kcat.py); B contiguous; all bf16; compute capability 8.0 or newer
// (bf16 mma.sync: on an older card the extension still builds, the kernel body compiled
// out).
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels.h"

namespace modulec {
namespace {

constexpr int kRows = 256;     // rows of d_C a CTA owns
constexpr int kCols = 128;     // columns of d_C per chunk
constexpr int kPad = 8;        // bf16 per shared row of padding: ldmatrix without conflicts
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;

template <int R>
struct Tiles {
  __nv_bfloat16 g[2][kRows][kCols + kPad];  // d_C tile, double-buffered
  __nv_bfloat16 b[2][kCols][R + kPad];      // the chunk's rows of B
  __nv_bfloat16 a[kRows][R + kPad];         // the CTA's rows of A
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
               "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// d += a b (m16 n8 k16, bf16 in, fp32 accumulators)
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Adds a warp's 16 x 8 accumulator tile (rows row0.., columns col0..) into `sum` [*, R]:
// lane pairs swap halves so each lane adds four consecutive floats with one atomic.
template <int R>
__device__ __forceinline__ void add_tile(float* sum, int64_t row0, int col0,
                                         const float (&c)[4], int lane) {
  const float p0 = __shfl_xor_sync(0xffffffffu, c[0], 1);
  const float p1 = __shfl_xor_sync(0xffffffffu, c[1], 1);
  const float p2 = __shfl_xor_sync(0xffffffffu, c[2], 1);
  const float p3 = __shfl_xor_sync(0xffffffffu, c[3], 1);
  const int col = col0 + 2 * (lane % 4);
  const int64_t row = row0 + lane / 4;
  float4* at;
  float4 v;
  if (lane % 2 == 0) {  // this row's columns col..col+3
    at = reinterpret_cast<float4*>(sum + row * R + col);
    v = make_float4(c[0], c[1], p0, p1);
  } else {  // row + 8's columns col-2..col+1
    at = reinterpret_cast<float4*>(sum + (row + 8) * R + col - 2);
    v = make_float4(p2, p3, c[2], c[3]);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(at, v);
#else
  atomicAdd(&at->x, v.x);
  atomicAdd(&at->y, v.y);
  atomicAdd(&at->z, v.z);
  atomicAdd(&at->w, v.w);
#endif
}

// Stores a warp's 16 x 8 accumulator tile into `part` [*, W] (rows row0.., columns
// col0..): plain stores, each lane its two pairs of floats.
template <int W>
__device__ __forceinline__ void store_tile(float* part, int64_t row0, int col0,
                                           const float (&c)[4], int lane) {
  float* at = part + (row0 + lane / 4) * W + col0 + 2 * (lane % 4);
  *reinterpret_cast<float2*>(at) = make_float2(c[0], c[1]);
  *reinterpret_cast<float2*>(at + 8 * W) = make_float2(c[2], c[3]);
}

template <int R>
__device__ __forceinline__ void load_chunk(Tiles<R>& s, int stage, const __nv_bfloat16* g,
                                           int64_t ldg, const __nv_bfloat16* b, int64_t t0,
                                           int64_t n0) {
  constexpr int kRowPieces = kCols / 8;  // 16-byte pieces in a d_C tile row
  for (int i = threadIdx.x; i < kRows * kRowPieces; i += kThreads) {
    const int r = i / kRowPieces, p = i % kRowPieces;
    copy16(&s.g[stage][r][p * 8], g + (t0 + r) * ldg + n0 + p * 8);
  }
  constexpr int kBPieces = R / 8;
  for (int i = threadIdx.x; i < kCols * kBPieces; i += kThreads) {
    const int r = i / kBPieces, p = i % kBPieces;
    copy16(&s.b[stage][r][p * 8], b + (n0 + r) * R + p * 8);
  }
}

// d_A's rows of this warp (2 m-tiles of 16) += tile . B_chunk, over the chunk's columns;
// BLOCKED: the chunk's B rows are block `blk` of a block-diagonal B (columns 16 blk ..
// 16 blk + 15, zero elsewhere), so only that block's two n-tiles are summed
template <int R, bool BLOCKED>
__device__ __forceinline__ void accumulate_da(const Tiles<R>& s, int stage, int warp, int lane,
                                              float (&acc)[2][R / 8][4], int blk) {
  for (int k = 0; k < kCols; k += 16) {
    uint32_t a[2][4];
    for (int m = 0; m < 2; ++m)
      ldmatrix_x4(a[m], &s.g[stage][warp * 32 + m * 16 + lane % 16][k + (lane / 16) * 8]);
#pragma unroll
    for (int n = 0; n < R / 8; n += 2) {
      if (BLOCKED && n / 2 != blk) continue;  // uniform across the CTA: registers stay static
      uint32_t b[4];  // n-tiles n and n + 1
      ldmatrix_x4_trans(b, &s.b[stage][k + lane % 8 + ((lane / 8) % 2) * 8][n * 8 + (lane / 16) * 8]);
      for (int m = 0; m < 2; ++m) {
        mma(acc[m][n], a[m], b[0], b[1]);
        mma(acc[m][n + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// the d_B columns a chunk sums: all R, or (BLOCKED) its block's 16
template <int R, bool BLOCKED>
constexpr int kDbTiles = BLOCKED ? 2 : R / 8;

// the columns of a row block's d_B partial: all R, or (BLOCKED) each row's own block's 16
template <int R, bool BLOCKED>
constexpr int kDbWidth = 8 * kDbTiles<R, BLOCKED>;

// this warp's 16 columns of the chunk: d_B rows += tile^T . A, over the CTA's rows, for A's
// columns first .. first + 8 kDbTiles - 1 (BLOCKED: the chunk's block; the others' d_B is
// zero in a block-diagonal B's gradient and is left so)
template <int R, bool BLOCKED>
__device__ __forceinline__ void accumulate_db(const Tiles<R>& s, int stage, int warp, int lane,
                                              float (&acc)[kDbTiles<R, BLOCKED>][4],
                                              int first) {
  const int col = warp * 16;
  for (int k = 0; k < kRows; k += 16) {
    uint32_t a[4];  // the tile transposed: rows are d_C's columns
    ldmatrix_x4_trans(a, &s.g[stage][k + lane % 8 + (lane / 16) * 8][col + ((lane / 8) % 2) * 8]);
#pragma unroll
    for (int n = 0; n < kDbTiles<R, BLOCKED>; n += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(
          b, &s.a[k + lane % 8 + ((lane / 8) % 2) * 8][first + n * 8 + (lane / 16) * 8]);
      mma(acc[n], a, b[0], b[1]);
      mma(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// which block of `blocks` column n of d_C (row n of B) lies in
__device__ __forceinline__ int block_of(const SkinnyBlocks& blocks, int64_t n) {
  int b = 0;
#pragma unroll
  for (int i = 0; i < kSkinnyMaxBlocks - 1; ++i)
    if (i < blocks.n - 1 && n >= blocks.end[i]) ++b;
  return b;
}

// PARTIAL: da and db are the partials' workspaces (this CTA's slices: da's blockIdx.y-th
// [T, R], db's blockIdx.x-th [N, kDbWidth]); else the sums, added into.
template <int R, bool BLOCKED, bool PARTIAL>
__global__ void __launch_bounds__(kThreads, 1)
    skinny_nt_backward_kernel(const __nv_bfloat16* __restrict__ g, int64_t ldg,
                              const __nv_bfloat16* __restrict__ a_in, int64_t lda,
                              const __nv_bfloat16* __restrict__ b_in, float* __restrict__ da,
                              float* __restrict__ db, int64_t n_cols, int chunks_per_cta,
                              SkinnyBlocks blocks) {
  static_assert(kCols == kWarps * 16, "one warp per 16 columns of a chunk for d_B");
  static_assert(kRows == kWarps * 32, "two m-tiles of rows per warp for d_A");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync needs sm_80; skinny_grads.py covers() launches none below
#else
  extern __shared__ __align__(128) unsigned char raw[];
  Tiles<R>& s = *reinterpret_cast<Tiles<R>*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int first = blockIdx.y * chunks_per_cta;
  const int chunks = min(chunks_per_cta, static_cast<int>(n_cols / kCols) - first);
  if (chunks <= 0) return;

  constexpr int kAPieces = R / 8;
  for (int i = threadIdx.x; i < kRows * kAPieces; i += kThreads) {
    const int r = i / kAPieces, p = i % kAPieces;
    copy16(&s.a[r][p * 8], a_in + (t0 + r) * lda + p * 8);
  }
  load_chunk(s, 0, g, ldg, b_in, t0, static_cast<int64_t>(first) * kCols);
  commit();

  float acc_a[2][R / 8][4] = {};
  for (int c = 0; c < chunks; ++c) {
    const int stage = c % 2;
    if (c + 1 < chunks) {
      load_chunk(s, 1 - stage, g, ldg, b_in, t0, static_cast<int64_t>(first + c + 1) * kCols);
      commit();
      wait_groups<1>();
    } else {
      wait_groups<0>();
    }
    __syncthreads();
    const int64_t chunk0 = static_cast<int64_t>(first + c) * kCols;
    const int blk = BLOCKED ? block_of(blocks, chunk0) : 0;
    accumulate_da<R, BLOCKED>(s, stage, warp, lane, acc_a, blk);
    float acc_b[kDbTiles<R, BLOCKED>][4] = {};
    accumulate_db<R, BLOCKED>(s, stage, warp, lane, acc_b, blk * 16);
    const int64_t n0 = chunk0 + warp * 16;
    constexpr int kWidth = kDbWidth<R, BLOCKED>;
#pragma unroll
    for (int n = 0; n < kDbTiles<R, BLOCKED>; ++n) {
      if constexpr (PARTIAL)
        store_tile<kWidth>(db + blockIdx.x * n_cols * kWidth, n0, n * 8, acc_b[n], lane);
      else
        add_tile<R>(db, n0, blk * 16 + n * 8, acc_b[n], lane);
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
  const int64_t rows = static_cast<int64_t>(gridDim.x) * kRows;
  for (int m = 0; m < 2; ++m)
    for (int n = 0; n < R / 8; ++n) {
      const int64_t row0 = t0 + warp * 32 + m * 16;
      if constexpr (PARTIAL)
        store_tile<R>(da + blockIdx.y * rows * R, row0, n * 8, acc_a[m][n], lane);
      else
        add_tile<R>(da, row0, n * 8, acc_a[m][n], lane);
    }
#endif
}

// The second kernel: d_a = alpha (the CTAs' parts of d_A), d_b likewise, in bf16 (one
// launch for both: the parts are small, a launch is not). A thread takes 4 consecutive
// elements (a float4: every rank and block width is a multiple of 4), its grid one thread a
// float4: with one block an SM each thread walked ~30 elements of gate/up's 983K one
// dependent load at a time (14.8 us a call in the LoRA 8B replay). d_a's rows lie `ld_a`
// apart (the LoRA step writes d_t straight beside d_y: lora_kcat.py); with `blocks` only
// d_b's diagonal blocks are summed, so only they are written, into d_b's diagonal blocks
// or, `compact`, into d_b [cols, 16] (each row's own block).
__device__ __forceinline__ void store_quad(__nv_bfloat16* out, float4 v, float alpha) {
  out[0] = __float2bfloat16(alpha * v.x);
  out[1] = __float2bfloat16(alpha * v.y);
  out[2] = __float2bfloat16(alpha * v.z);
  out[3] = __float2bfloat16(alpha * v.w);
}

// the quad of the sums at `sum`, zeroed for the next call
__device__ __forceinline__ float4 take_quad(float* sum) {
  float4* at = reinterpret_cast<float4*>(sum);
  const float4 v = *at;
  *at = make_float4(0.f, 0.f, 0.f, 0.f);
  return v;
}

// the quads at `part`, `part + stride`, ... (`parts` of them) summed in that order, eight
// loads in flight at a time (they come from the L2, which the kernel just wrote)
__device__ __forceinline__ float4 sum_quads(const float* part, int parts, int64_t stride) {
  constexpr int kBatch = 8;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = 0; i < parts; i += kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (i + j < parts) v[j] = *reinterpret_cast<const float4*>(part + (i + j) * stride);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (i + j < parts) {
        s.x += v[j].x;
        s.y += v[j].y;
        s.z += v[j].z;
        s.w += v[j].w;
      }
    }
  }
  return s;
}

// where element k of d_b's parts lies in a dense [cols, rank] d_b: the same place, or
// (blocked: k in rows of 16) in row k / 16's own block
__device__ __forceinline__ int64_t d_b_index(int64_t k, int rank, const SkinnyBlocks& blocks) {
  if (blocks.n == 0) return k;
  const int64_t row = k / 16;
  return row * rank + 16 * block_of(blocks, row) + k % 16;
}

// n_a: d_A's elements (rows x rank), n_b: d_B's parts' (cols x rank or, blocked, x 16).
// parts_a / parts_b = 0: `da` / `db` are the sums (zeroed as they are read); else the
// partials, parts_a slices of n_a floats at da and parts_b slices of n_b at db.
__global__ void finish_kernel(float* __restrict__ da, float* __restrict__ db, int parts_a,
                              int parts_b, __nv_bfloat16* __restrict__ d_a,
                              __nv_bfloat16* __restrict__ d_b, int64_t n_a, int64_t n_b,
                              int rank, int64_t ld_a, float alpha, SkinnyBlocks blocks) {
  const int64_t quads_a = n_a / 4, quads = (n_a + n_b) / 4;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (q < quads_a) {
      const int64_t i = 4 * q;
      const float4 v = parts_a ? sum_quads(da + i, parts_a, n_a) : take_quad(da + i);
      store_quad(d_a + (i / rank) * ld_a + i % rank, v, alpha);
      continue;
    }
    const int64_t k = 4 * (q - quads_a), j = d_b_index(k, rank, blocks);
    // the sums are laid dense [cols, rank]; the partials as d_b's parts
    const float4 v = parts_b ? sum_quads(db + k, parts_b, n_b) : take_quad(db + j);
    store_quad(d_b + (blocks.compact ? k : j), v, alpha);
  }
}

// the kernel's grid: row blocks (x) by CTAs along N (y), each `per_cta` chunks
struct Grid {
  int row_blocks, per_cta, columns;
};

Grid grid_of(int64_t rows, int64_t cols, int sm_count) {
  const int row_blocks = static_cast<int>(rows / kRows);
  const int chunks = static_cast<int>(cols / kCols);
  const int splits = std::max(1, std::min(chunks, (sm_count + row_blocks - 1) / row_blocks));
  const int per_cta = (chunks + splits - 1) / splits;
  return {row_blocks, per_cta, (chunks + per_cta - 1) / per_cta};
}

template <int R, bool BLOCKED, bool PARTIAL>
cudaError_t launch(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                   float* da, float* db, int64_t rows, int64_t cols,
                   const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  const Grid grid = grid_of(rows, cols, sm_count);
  const size_t smem = sizeof(Tiles<R>);
  const auto kernel = skinny_nt_backward_kernel<R, BLOCKED, PARTIAL>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<dim3(grid.row_blocks, grid.columns), kThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(g), ldg, static_cast<const __nv_bfloat16*>(a), lda,
      static_cast<const __nv_bfloat16*>(b), da, db, cols, grid.per_cta, blocks);
  return cudaGetLastError();
}

// the blocked kernel and finishing pass apply: `blocks` names rank / 16 blocks of 16
bool sums_blocks(int rank, const SkinnyBlocks& blocks) {
  return rank > 16 && blocks.n == rank / 16;
}

// R's kernel, BLOCKED where `blocks` names R / 16 blocks (each 16 wide), dense otherwise
template <int R, bool PARTIAL>
cudaError_t launch_rank(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                        float* da, float* db, int64_t rows, int64_t cols,
                        const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  if constexpr (R > 16) {
    if (sums_blocks(R, blocks))
      return launch<R, true, PARTIAL>(g, ldg, a, lda, b, da, db, rows, cols, blocks, sm_count,
                                      stream);
  }
  return launch<R, false, PARTIAL>(g, ldg, a, lda, b, da, db, rows, cols, blocks, sm_count,
                                   stream);
}

template <bool PARTIAL>
cudaError_t launch_parts(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                         float* da, float* db, int64_t rows, int64_t cols, int rank,
                         const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  const auto run = [&](auto rank_kernel) {
    return rank_kernel(g, ldg, a, lda, b, da, db, rows, cols, blocks, sm_count, stream);
  };
  switch (rank) {
    case 16: return run(launch_rank<16, PARTIAL>);
    case 32: return run(launch_rank<32, PARTIAL>);
    case 48: return run(launch_rank<48, PARTIAL>);
    case 64: return run(launch_rank<64, PARTIAL>);
    default: return cudaErrorInvalidValue;
  }
}

// d_B's parts' elements: cols x rank, or where the kernel sums blocks, cols x 16
int64_t d_b_parts(int64_t cols, int rank, const SkinnyBlocks& blocks) {
  return cols * (sums_blocks(rank, blocks) ? 16 : rank);
}

}  // namespace

int skinny_rows_multiple() { return kRows; }
int skinny_cols_multiple() { return kCols; }

int64_t skinny_partial_floats(int64_t rows, int64_t cols, int rank,
                              const SkinnyBlocks& blocks, int sm_count) {
  const Grid grid = grid_of(rows, cols, sm_count);
  return grid.columns * rows * rank + grid.row_blocks * d_b_parts(cols, rank, blocks);
}

cudaError_t launch_skinny_nt_backward(const void* d_c, int64_t ld, const void* a,
                                      int64_t lda, const void* b, const SkinnySums& sums,
                                      void* d_a, int64_t ld_a, void* d_b, int64_t rows,
                                      int64_t cols, int rank, float alpha,
                                      const SkinnyBlocks& blocks,
                                      int sm_count, cudaStream_t stream) {
  if (blocks.n < 0 || blocks.n > kSkinnyMaxBlocks) return cudaErrorInvalidValue;
  for (int i = 0; i + 1 < blocks.n; ++i)
    if (blocks.end[i] % kCols != 0) return cudaErrorInvalidValue;
  const bool partial = sums.partials != nullptr;
  const int64_t n_a = rows * rank, n_b = d_b_parts(cols, rank, blocks);
  const Grid grid = grid_of(rows, cols, sm_count);
  float* da = partial ? sums.partials : sums.da;
  float* db = partial ? sums.partials + grid.columns * n_a : sums.db;
  const cudaError_t err =
      partial ? launch_parts<true>(d_c, ld, a, lda, b, da, db, rows, cols, rank, blocks,
                                   sm_count, stream)
              : launch_parts<false>(d_c, ld, a, lda, b, da, db, rows, cols, rank, blocks,
                                    sm_count, stream);
  if (err != cudaSuccess) return err;
  const unsigned threads = static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((n_a + n_b + 1023) / 1024, 1 << 20)));  // a thread a float4
  finish_kernel<<<threads, 256, 0, stream>>>(
      da, db, partial ? grid.columns : 0, partial ? grid.row_blocks : 0,
      static_cast<__nv_bfloat16*>(d_a), static_cast<__nv_bfloat16*>(d_b), n_a, n_b, rank,
      ld_a, alpha,
      sums_blocks(rank, blocks) ? blocks : SkinnyBlocks{});  // compact only with blocks
  return cudaGetLastError();
}

}  // namespace modulec
