// The backward of a skinny NT matmul C = alpha A B^T (A [T, R], B [N, R], R <= 64: LoRA's
// delta h (s B)^T, the adapters' rank-wide products) in one pass over d_C [T, N]:
//   d_A = alpha d_C B      [T, R]   (a sum over N)
//   d_B = alpha d_C^T A    [N, R]   (a sum over T)
// cuBLAS runs them as two GEMMs, each reading all of d_C (by far the largest operand: a
// LoRA 8B layer's four are 176 MB at T=2048) and each too thin to reach the card's
// bandwidth. Here each CTA stages a tile of d_C (kRows x kCols, bf16) in shared memory
// once and feeds both products from it on the tensor cores (mma.sync m16n8k16, fp32
// accumulation): d_A's rows stay in registers across the CTA's run of column chunks,
// d_B's chunk is summed over the CTA's rows. Partial sums meet in fp32 buffers through
// float4 atomics (d_B: T / kRows adds an element, d_A: one per CTA along N); a second
// kernel scales by alpha, casts to bf16 and zeroes the sums again (the caller keeps them
// per problem, zeroed when made). The atomics' order varies, so the last bits
// of the sums may differ between runs (the caller falls back to cuBLAS where torch's
// deterministic mode is on).
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

template <int R, bool BLOCKED>
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
#pragma unroll
    for (int n = 0; n < kDbTiles<R, BLOCKED>; ++n)
      add_tile<R>(db, n0, blk * 16 + n * 8, acc_b[n], lane);
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
  for (int m = 0; m < 2; ++m)
    for (int n = 0; n < R / 8; ++n)
      add_tile<R>(da, t0 + warp * 32 + m * 16, n * 8, acc_a[m][n], lane);
#endif
}

// d_a = alpha da32, d_b = alpha db32 in bf16, and both sums zeroed for the next call (one
// launch for both: the sums are small, a launch is not). A thread takes 4 consecutive
// elements (a float4 of the sums: every rank and block width is a multiple of 4), its
// grid one thread a float4: with one block an SM each thread walked ~30 elements of
// gate/up's 983K one dependent load at a time (14.8 us a call in the LoRA 8B replay).
// d_a's rows lie `ld_a` apart (the LoRA step writes d_t straight beside d_y:
// lora_kcat.py); with `blocks` only d_b's diagonal blocks are summed, so only they are
// cast and zeroed (n_b: d_b's elements or, blocked, rows x 16), into d_b's diagonal blocks
// or, `compact`, into d_b [cols, 16] (each row's own block).
__device__ __forceinline__ void finish_quad(float* sum, __nv_bfloat16* out, float alpha) {
  float4* at = reinterpret_cast<float4*>(sum);
  const float4 v = *at;
  *at = make_float4(0.f, 0.f, 0.f, 0.f);
  out[0] = __float2bfloat16(alpha * v.x);
  out[1] = __float2bfloat16(alpha * v.y);
  out[2] = __float2bfloat16(alpha * v.z);
  out[3] = __float2bfloat16(alpha * v.w);
}

__global__ void finish_kernel(float* __restrict__ da32, float* __restrict__ db32,
                              __nv_bfloat16* __restrict__ d_a, __nv_bfloat16* __restrict__ d_b,
                              int64_t n_a, int64_t n_b, int rank, int64_t ld_a, float alpha,
                              SkinnyBlocks blocks) {
  const int64_t quads_a = n_a / 4, quads = (n_a + n_b) / 4;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (q < quads_a) {
      const int64_t i = 4 * q;
      finish_quad(da32 + i, d_a + (i / rank) * ld_a + i % rank, alpha);
      continue;
    }
    const int64_t k = 4 * (q - quads_a);
    int64_t j = k;
    if (blocks.n > 0) {  // row k / 16 of d_b, columns 16 (its block) + k % 16 ..
      const int64_t row = k / 16;
      j = row * rank + 16 * block_of(blocks, row) + k % 16;
    }
    finish_quad(db32 + j, d_b + (blocks.compact ? k : j), alpha);  // compact: [cols, 16]
  }
}

template <int R, bool BLOCKED>
cudaError_t launch(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                   float* da32, float* db32, int64_t rows, int64_t cols,
                   const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  const int row_blocks = static_cast<int>(rows / kRows);
  const int chunks = static_cast<int>(cols / kCols);
  const int splits = std::max(1, std::min(chunks, (sm_count + row_blocks - 1) / row_blocks));
  const int per_cta = (chunks + splits - 1) / splits;
  const int grid_y = (chunks + per_cta - 1) / per_cta;
  const size_t smem = sizeof(Tiles<R>);
  cudaError_t err = cudaFuncSetAttribute(skinny_nt_backward_kernel<R, BLOCKED>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  skinny_nt_backward_kernel<R, BLOCKED><<<dim3(row_blocks, grid_y), kThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(g), ldg, static_cast<const __nv_bfloat16*>(a), lda,
      static_cast<const __nv_bfloat16*>(b), da32, db32, cols, per_cta, blocks);
  return cudaGetLastError();
}

// the blocked kernel and finishing pass apply: `blocks` names rank / 16 blocks of 16
bool sums_blocks(int rank, const SkinnyBlocks& blocks) {
  return rank > 16 && blocks.n == rank / 16;
}

// R's kernel, BLOCKED where `blocks` names R / 16 blocks (each 16 wide), dense otherwise
template <int R>
cudaError_t launch_rank(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                        float* da32, float* db32, int64_t rows, int64_t cols,
                        const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  if constexpr (R > 16) {
    if (sums_blocks(R, blocks))
      return launch<R, true>(g, ldg, a, lda, b, da32, db32, rows, cols, blocks, sm_count,
                             stream);
  }
  return launch<R, false>(g, ldg, a, lda, b, da32, db32, rows, cols, blocks, sm_count, stream);
}

cudaError_t launch_sums(const void* g, int64_t ldg, const void* a, int64_t lda, const void* b,
                        float* da32, float* db32, int64_t rows, int64_t cols, int rank,
                        const SkinnyBlocks& blocks, int sm_count, cudaStream_t stream) {
  const auto run = [&](auto rank_kernel) {
    return rank_kernel(g, ldg, a, lda, b, da32, db32, rows, cols, blocks, sm_count, stream);
  };
  switch (rank) {
    case 16: return run(launch_rank<16>);
    case 32: return run(launch_rank<32>);
    case 48: return run(launch_rank<48>);
    case 64: return run(launch_rank<64>);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int skinny_rows_multiple() { return kRows; }
int skinny_cols_multiple() { return kCols; }

cudaError_t launch_skinny_nt_backward(const void* d_c, int64_t ld, const void* a,
                                      int64_t lda, const void* b, float* da32, float* db32,
                                      void* d_a, int64_t ld_a, void* d_b, int64_t rows,
                                      int64_t cols, int rank, float alpha,
                                      const SkinnyBlocks& blocks,
                                      int sm_count, cudaStream_t stream) {
  if (blocks.n < 0 || blocks.n > kSkinnyMaxBlocks) return cudaErrorInvalidValue;
  for (int i = 0; i + 1 < blocks.n; ++i)
    if (blocks.end[i] % kCols != 0) return cudaErrorInvalidValue;
  const cudaError_t err = launch_sums(d_c, ld, a, lda, b, da32, db32, rows, cols, rank, blocks,
                                      sm_count, stream);
  if (err != cudaSuccess) return err;
  const bool blocked = sums_blocks(rank, blocks);
  const int64_t n_a = rows * rank, n_b = cols * (blocked ? 16 : rank);
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((n_a + n_b + 1023) / 1024, 1 << 20)));  // a thread a float4
  finish_kernel<<<grid, 256, 0, stream>>>(
      da32, db32, static_cast<__nv_bfloat16*>(d_a), static_cast<__nv_bfloat16*>(d_b), n_a, n_b,
      rank, ld_a, alpha, blocked ? blocks : SkinnyBlocks{});  // compact only with blocks
  return cudaGetLastError();
}

}  // namespace modulec
