// swiglu's backward fused with LoRA's gate/up adapter gradients, tried and not kept (docs/
// decisions.md "LoRA step: swiglu's backward with the gate/up adapter sums, measured and not
// kept"): the kernel as measured, its reference check and its timing.
//
// LoRA's fused gate/up delta C = s t B^T (t = x A^T [T, 32], B = block_diag(B_gate, B_up)
// [2 d_ff, 32], rank 16 each) has d_C = [d_gate | d_up], which swiglu's backward writes and
// the one-pass skinny kernel (csrc/kernels/skinny_grads.cu) reads back. Here one kernel
// makes each tile of d_gate / d_up from d_y, gate and up, stores it and sums both adapter
// gradients from it on the tensor cores while it is in shared memory:
//   dt32 += d_C B  [T, 32],  db32 += d_C^T t  [2 d_ff, 32] (B's diagonal blocks)
// (skinny_grads.cu's fp32 sums; its finishing launch would scale and cast them). A CTA (16
// warps, one a multiprocessor) owns 128 rows and a run of chunks of 256 gate columns and
// the same 256 of up, in tiles of 32 rows (512-byte row runs); d_y's, gate's and up's tiles
// come in by cp.async, three in flight, swizzled in 16-byte pieces; d_gate / d_up are
// written over d_y / gate in the stage, from which ldmatrix feeds the sums. silu'(g) is
// taken as s (1 + g (1 - s)), one exp and one division (swiglu.cu's form takes two of
// each). Checked here against naive fp32 kernels; timed alone with the L2 flushed, with and
// without the sums. On a GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/swiglu_lora_variants.cu -o /tmp/swiglu_lora && /tmp/swiglu_lora
#include "../../csrc/kernels/skinny_grads.cu"
#include "activations.cuh"
#include "variants_harness.cuh"

namespace exp_ {
using modulec::act;
using modulec::add_tile;
using modulec::commit;
using modulec::copy16;
using modulec::kSilu;
using modulec::ldmatrix_x4;
using modulec::ldmatrix_x4_trans;
using modulec::mma;
using modulec::wait_groups;

struct SwigluLoraBackward {
  const void* d_y; int64_t ld_dy;
  const void* gate; int64_t ld_g;
  const void* up; int64_t ld_u;
  void* d_gate; int64_t ld_dg;
  void* d_up; int64_t ld_du;
  const void* t; int64_t ld_t;  // [rows, 2 W]
  const void* b;                // [2 cols, 2 W], block-diagonal
  float* dt32;
  float* db32;
  int64_t rows, cols;
};

__device__ __forceinline__ float gate_grad(float g) {  // silu'(g)
  const float s = 1.f / (1.f + expf(-g));
  return s * (1.f + g * (1.f - s));
}

constexpr int W = 16;                   // the adapter's rank: each block's width
constexpr int kRowTiles = 4;            // tiles of rows a CTA owns
constexpr int kTileRows = 32;
constexpr int kRows = kRowTiles * kTileRows;
constexpr int kGateCols = 256;          // gate columns a chunk takes (and as many of up)
constexpr int kPieces = kGateCols / 8;  // 16-byte pieces a tile row holds
constexpr int kPad = 8;                 // bf16 of padding a shared row: ldmatrix without conflicts
constexpr int kThreads = 512;           // 16 warps: enough in flight for the elementwise part
constexpr int kWarps = kThreads / 32;
constexpr int kStages = 3;              // d_y / gate / up tiles in flight
constexpr int kDbCols = 2 * kGateCols / kWarps;        // d_C columns a warp sums d_B over (32)
constexpr int kDtCols = 2 * kGateCols / (kWarps / 2);  // ... and d_t over (64)

enum Part { kDy = 0, kGate = 1, kUp = 2 };  // a stage's tiles; d_gate over d_y, d_up over gate

struct Smem {
  __nv_bfloat16 in[kStages][3][kTileRows][kGateCols];  // swizzled rows (`at`)
  __nv_bfloat16 b[2][2 * kGateCols][W + kPad];  // a chunk's rows of B's blocks: gate's, up's
  __nv_bfloat16 t[kRows][2 * W + kPad];         // the CTA's rows of t
};

// where column `col` of tile row `row` lies: its 16-byte piece XOR the row's low bits
__device__ __forceinline__ int at(int row, int col) {
  return (((col >> 3) ^ (row & 7)) << 3) | (col & 7);
}

// d_C's tile column c (d_gate's 0 .. 255, d_up's after) of row `row` in stage `stage`
__device__ __forceinline__ const __nv_bfloat16* dc(const Smem& s, int stage, int row, int c) {
  return &s.in[stage][c < kGateCols ? kDy : kGate][row][at(row, c % kGateCols)];
}

union Pack8 {
  uint4 v;
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void store16(__nv_bfloat16* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void load_t(Smem& s, const __nv_bfloat16* t, int64_t ld_t,
                                       int64_t t0) {
  constexpr int kTPieces = 2 * W / 8;
  for (int i = threadIdx.x; i < kRows * kTPieces; i += kThreads) {
    const int r = i / kTPieces, p = i % kTPieces;
    copy16(&s.t[r][p * 8], t + (t0 + r) * ld_t + p * 8);
  }
}

// rows n0 .. n0 + 255 of B's gate block and cols + n0 .. of its up block
__device__ __forceinline__ void load_b(Smem& s, int buf, const __nv_bfloat16* b, int64_t cols,
                                       int64_t n0) {
  constexpr int kBPieces = W / 8;
  for (int i = threadIdx.x; i < 2 * kGateCols * kBPieces; i += kThreads) {
    const int r = i / kBPieces, p = i % kBPieces;
    const bool up = r >= kGateCols;
    const int64_t row = up ? cols + n0 + r - kGateCols : n0 + r;
    copy16(&s.b[buf][r][p * 8], b + row * (2 * W) + (up ? W : 0) + p * 8);
  }
}

// d_y's, gate's and up's tiles of rows r0 .., columns n0 .. into stage
__device__ __forceinline__ void load_in(Smem& s, int stage, const SwigluLoraBackward& p,
                                        int64_t r0, int64_t n0) {
  const __nv_bfloat16* from[3] = {static_cast<const __nv_bfloat16*>(p.d_y),
                                  static_cast<const __nv_bfloat16*>(p.gate),
                                  static_cast<const __nv_bfloat16*>(p.up)};
  const int64_t ld[3] = {p.ld_dy, p.ld_g, p.ld_u};
#pragma unroll
  for (int a = 0; a < 3; ++a)
#pragma unroll
    for (int i = threadIdx.x; i < kTileRows * kPieces; i += kThreads) {
      const int row = i / kPieces, col = (i % kPieces) * 8;
      copy16(&s.in[stage][a][row][at(row, col)], from[a] + (r0 + row) * ld[a] + n0 + col);
    }
}

// d_gate, d_up of the stage's tile: stored (rows r0 .., columns n0 ..), and over d_y and
// gate in the stage
__device__ __forceinline__ void elementwise(Smem& s, int stage, const SwigluLoraBackward& p,
                                            int64_t r0, int64_t n0) {
  auto* d_gate = static_cast<__nv_bfloat16*>(p.d_gate);
  auto* d_up = static_cast<__nv_bfloat16*>(p.d_up);
#pragma unroll
  for (int i = threadIdx.x; i < kTileRows * kPieces; i += kThreads) {
    const int row = i / kPieces, col = (i % kPieces) * 8, where = at(row, col);
    Pack8 vy, vg, vu, dg, du;
    vy.v = *reinterpret_cast<const uint4*>(&s.in[stage][kDy][row][where]);
    vg.v = *reinterpret_cast<const uint4*>(&s.in[stage][kGate][row][where]);
    vu.v = *reinterpret_cast<const uint4*>(&s.in[stage][kUp][row][where]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 y = __bfloat1622float2(vy.h[j]), g = __bfloat1622float2(vg.h[j]),
                   u = __bfloat1622float2(vu.h[j]);
      // d_gate = d_y up silu'(g), d_up = d_y silu(g)
      dg.h[j] = __halves2bfloat162(__float2bfloat16_rn(y.x * u.x * gate_grad(g.x)),
                                   __float2bfloat16_rn(y.y * u.y * gate_grad(g.y)));
      du.h[j] = __halves2bfloat162(__float2bfloat16_rn(y.x * act<kSilu>(g.x)),
                                   __float2bfloat16_rn(y.y * act<kSilu>(g.y)));
    }
    const int64_t at_row = r0 + row;
    store16(d_gate + at_row * p.ld_dg + n0 + col, dg.v);
    store16(d_up + at_row * p.ld_du + n0 + col, du.v);
    *reinterpret_cast<uint4*>(&s.in[stage][kDy][row][where]) = dg.v;
    *reinterpret_cast<uint4*>(&s.in[stage][kGate][row][where]) = du.v;
  }
}

// d_t's sums of the tile: warp w takes its rows 16 (w % 2) .. against columns 64 (w / 2) ..
// (d_gate's for w < 8, against B's gate block: d_t's first W columns; d_up's after)
__device__ __forceinline__ void sum_dt(const Smem& s, int stage, int buf, int warp, int lane,
                                       float (&acc)[W / 8][4]) {
  const int row = (warp % 2) * 16 + lane % 16, k0 = (warp / 2) * kDtCols;
#pragma unroll
  for (int k = k0; k < k0 + kDtCols; k += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, dc(s, stage, row, k + (lane / 16) * 8));
    uint32_t b[4];  // n-tiles 0 and 1: the block's 16 columns
    ldmatrix_x4_trans(b, &s.b[buf][k + lane % 8 + ((lane / 8) % 2) * 8][(lane / 16) * 8]);
    mma(acc[0], a, b[0], b[1]);
    mma(acc[1], a, b[2], b[3]);
  }
}

// d_B's sums of the tile: warp w takes its columns 32 w .. 32 w + 31 (d_gate's for w < 8,
// against t's first W columns; d_up's after, against its last W) over all its rows
__device__ __forceinline__ void sum_db(const Smem& s, int stage, int warp, int lane,
                                       int t_row0, float (&acc)[2][W / 8][4]) {
  const int first = warp < kWarps / 2 ? 0 : W;
#pragma unroll
  for (int k = 0; k < kTileRows; k += 16) {
    uint32_t b[4];  // t's rows k .., the block's 16 columns
    ldmatrix_x4_trans(b, &s.t[t_row0 + k + lane % 8 + ((lane / 8) % 2) * 8]
                             [first + (lane / 16) * 8]);
    const int row = k + lane % 8 + (lane / 16) * 8;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint32_t a[4];  // the tile transposed: rows are d_C's columns
      ldmatrix_x4_trans(a, dc(s, stage, row, warp * kDbCols + m * 16 + ((lane / 8) % 2) * 8));
      mma(acc[m][0], a, b[0], b[1]);
      mma(acc[m][1], a, b[2], b[3]);
    }
  }
}

// the chunk's d_B sums of this warp into db32 (rows n0 + 32 w .. of gate's block, or
// cols + n0 + 32 (w - 8) .. of up's), and from zero again
__device__ __forceinline__ void add_db(const SwigluLoraBackward& p, int warp, int lane,
                                       int64_t n0, float (&acc)[2][W / 8][4]) {
  const bool gate = warp < kWarps / 2;
  const int64_t row0 = (gate ? n0 : p.cols + n0) + (warp % (kWarps / 2)) * kDbCols;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < W / 8; ++n) {
      add_tile<2 * W>(p.db32, row0 + m * 16, (gate ? 0 : W) + n * 8, acc[m][n], lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
    }
}

template <bool SUMS>
__global__ void __launch_bounds__(kThreads, 1)
    swiglu_lora_backward_kernel(SwigluLoraBackward p, int chunks_per_cta) {
  static_assert(kTileRows == 32 && kDbCols == 32 && kDtCols % 16 == 0, "the warps' shares");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync needs sm_80
#else
  extern __shared__ __align__(128) unsigned char raw[];
  Smem& s = *reinterpret_cast<Smem*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int first = blockIdx.y * chunks_per_cta;
  const int chunks = min(chunks_per_cta, static_cast<int>(p.cols / kGateCols) - first);
  if (chunks <= 0) return;

  // tile i: chunk i / 4's columns, rows t0 + 32 (i % 4) ..; tiles i + 1 and i + 2 load
  // while tile i is computed
  const auto* b = static_cast<const __nv_bfloat16*>(p.b);
  const int tiles = chunks * kRowTiles;
  const auto n0_of = [&](int i) {
    return static_cast<int64_t>(first + i / kRowTiles) * kGateCols;
  };
  const auto r0_of = [&](int i) { return t0 + (i % kRowTiles) * kTileRows; };
  load_t(s, static_cast<const __nv_bfloat16*>(p.t), p.ld_t, t0);
  load_b(s, 0, b, p.cols, n0_of(0));
  load_in(s, 0, p, r0_of(0), n0_of(0));
  commit();
  if (tiles > 1) load_in(s, 1, p, r0_of(1), n0_of(1));
  commit();
  float acc_t[kRowTiles][W / 8][4] = {};  // this warp's d_t rows of each row tile
  float acc_b[2][W / 8][4] = {};
  for (int c = 0; c < chunks; ++c) {
    const int buf = c % 2;
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt) {
      const int i = c * kRowTiles + rt, stage = i % kStages;
      wait_groups<1>();  // tile i in (the group after it: tile i + 1's)
      __syncthreads();   // and every thread past tile i - 1's sums: its stage is free
      if (i + 2 < tiles) {
        if (rt == kRowTiles - 2) load_b(s, 1 - buf, b, p.cols, n0_of(i + 2));
        load_in(s, (i + 2) % kStages, p, r0_of(i + 2), n0_of(i + 2));
      }
      commit();  // maybe empty: the waits count one group a tile
      elementwise(s, stage, p, r0_of(i), n0_of(i));
      __syncthreads();
      if (!SUMS) continue;
      sum_dt(s, stage, buf, warp, lane, acc_t[rt]);
      sum_db(s, stage, warp, lane, rt * kTileRows, acc_b);
    }
    if (SUMS) add_db(p, warp, lane, n0_of(c * kRowTiles), acc_b);
  }
  const int block = warp < kWarps / 2 ? 0 : W;  // d_t's columns of this warp's block
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int n = 0; n < W / 8; ++n)
      add_tile<2 * W>(p.dt32, t0 + rt * kTileRows + (warp % 2) * 16, block + n * 8,
                      acc_t[rt][n], lane);
#endif
}

template <bool SUMS>
void launch(const SwigluLoraBackward& p, int sm_count) {
  const int row_blocks = static_cast<int>(p.rows / kRows);
  const int chunks = static_cast<int>(p.cols / kGateCols);
  const int splits = std::max(1, std::min(chunks, (sm_count + row_blocks - 1) / row_blocks));
  const int per_cta = (chunks + splits - 1) / splits;
  const int grid_y = (chunks + per_cta - 1) / per_cta;
  CK(cudaFuncSetAttribute(swiglu_lora_backward_kernel<SUMS>,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem)));
  swiglu_lora_backward_kernel<SUMS><<<dim3(row_blocks, grid_y), kThreads, sizeof(Smem)>>>(
      p, per_cta);
}

// the reference: d_C [rows, 2 cols] in fp32 as the kernel rounds it, then the two sums
__global__ void reference_dc(SwigluLoraBackward p, float* d_c) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= p.rows * p.cols) return;
  const int64_t r = i / p.cols, c = i % p.cols;
  const float y = __bfloat162float(static_cast<const __nv_bfloat16*>(p.d_y)[r * p.ld_dy + c]);
  const float g = __bfloat162float(static_cast<const __nv_bfloat16*>(p.gate)[r * p.ld_g + c]);
  const float u = __bfloat162float(static_cast<const __nv_bfloat16*>(p.up)[r * p.ld_u + c]);
  d_c[r * 2 * p.cols + c] = __bfloat162float(__float2bfloat16_rn(y * u * gate_grad(g)));
  d_c[r * 2 * p.cols + p.cols + c] = __bfloat162float(__float2bfloat16_rn(y * act<kSilu>(g)));
}

__global__ void reference_sums(SwigluLoraBackward p, const float* d_c, float* dt, float* db) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t n = 2 * p.cols;
  const auto* t = static_cast<const __nv_bfloat16*>(p.t);
  const auto* b = static_cast<const __nv_bfloat16*>(p.b);
  if (i < p.rows * 2 * W) {  // dt[r, j] = sum_n d_C[r, n] B[n, j]
    const int64_t r = i / (2 * W), j = i % (2 * W);
    float acc = 0.f;
    for (int64_t c = 0; c < n; ++c) acc += d_c[r * n + c] * __bfloat162float(b[c * 2 * W + j]);
    dt[i] = acc;
  }
  if (i < n * 2 * W) {  // db[c, j] = sum_r d_C[r, c] t[r, j]
    const int64_t c = i / (2 * W), j = i % (2 * W);
    float acc = 0.f;
    for (int64_t r = 0; r < p.rows; ++r)
      acc += d_c[r * n + c] * __bfloat162float(t[r * p.ld_t + j]);
    db[i] = (j < W) == (c < p.cols) ? acc : 0.f;  // the diagonal blocks
  }
}

}  // namespace exp_

int main() {
  const int64_t T = 2048, ff = 14336, R = 2 * exp_::W;
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  init_flush();
  std::vector<__nv_bfloat16> host(T * 2 * ff), blocks(2 * ff * R);
  fill(host, 1);
  fill(blocks, 2);
  for (int64_t c = 0; c < 2 * ff; ++c)  // B block-diagonal: gate's rows use columns 0..15
    for (int64_t j = 0; j < R; ++j)
      if ((j < exp_::W) != (c < ff)) blocks[c * R + j] = __float2bfloat16(0.f);
  __nv_bfloat16 *gate_up, *d_y, *d_c, *t, *b;
  float *dt32, *db32, *ref_dc, *ref_dt, *ref_db;
  CK(cudaMalloc(&gate_up, T * 2 * ff * 2));
  CK(cudaMalloc(&d_y, T * ff * 2));
  CK(cudaMalloc(&d_c, T * (2 * ff + R) * 2));
  CK(cudaMalloc(&t, T * R * 2));
  CK(cudaMalloc(&b, 2 * ff * R * 2));
  CK(cudaMalloc(&dt32, T * R * 4));
  CK(cudaMalloc(&db32, 2 * ff * R * 4));
  CK(cudaMalloc(&ref_dc, T * 2 * ff * 4));
  CK(cudaMalloc(&ref_dt, T * R * 4));
  CK(cudaMalloc(&ref_db, 2 * ff * R * 4));
  CK(cudaMemcpy(gate_up, host.data(), T * 2 * ff * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_y, host.data() + 7, T * ff * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(t, host.data() + 13, T * R * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, blocks.data(), 2 * ff * R * 2, cudaMemcpyHostToDevice));
  const int64_t ld_c = 2 * ff + R;  // d_gate | d_up | d_t, as the one-GEMM d_x's scratch
  exp_::SwigluLoraBackward p{d_y, ff, gate_up, 2 * ff, gate_up + ff, 2 * ff, d_c, ld_c,
                             d_c + ff, ld_c, t, R, b, dt32, db32, T, ff};

  CK(cudaMemset(dt32, 0, T * R * 4));
  CK(cudaMemset(db32, 0, 2 * ff * R * 4));
  exp_::launch<true>(p, sms);
  exp_::reference_dc<<<(T * ff + 255) / 256, 256>>>(p, ref_dc);
  exp_::reference_sums<<<(2 * ff * R + 255) / 256, 256>>>(p, ref_dc, ref_dt, ref_db);
  CK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> stored(T * ld_c);
  std::vector<float> ref(T * 2 * ff);
  CK(cudaMemcpy(stored.data(), d_c, T * ld_c * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ref.data(), ref_dc, T * 2 * ff * 4, cudaMemcpyDeviceToHost));
  int64_t differ = 0;
  for (int64_t r = 0; r < T; ++r)
    for (int64_t c = 0; c < 2 * ff; ++c)
      differ += __bfloat162float(stored[r * ld_c + c]) != ref[r * 2 * ff + c];
  printf("d_gate | d_up elements unlike the reference's: %lld; sums' max relative error: "
         "d_t %.1e, d_B %.1e\n", static_cast<long long>(differ), max_rel(ref_dt, dt32, T * R),
         max_rel(ref_db, db32, 2 * ff * R));

  const double mb = T * ff * 2.0 * 5 / 1e6;  // swiglu's bytes: three read, two written
  for (bool sums : {true, false}) {
    const float us = time_us([&] {
      sums ? exp_::launch<true>(p, sms) : exp_::launch<false>(p, sms);
    });
    printf("fused kernel, %s: %.1f us, %.2f TB/s of swiglu's bytes\n",
           sums ? "with the sums" : "elementwise part alone", us, mb / us);
  }
  return 0;
}
