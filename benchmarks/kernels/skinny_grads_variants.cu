// What limits skinny_nt_backward (csrc/kernels/skinny_grads.cu) at LoRA 8B's shapes: plain
// reads of d_C (one or several loads in flight a thread; the kernel's tiles read into
// registers by one CTA or four a multiprocessor), the shipped kernel both ways (its parts
// met in sums through atomics, or stored as partials and summed by the finishing launch;
// dense and block-diagonal B) and variants of it with the tile shape, the pipeline depth
// and which atomics run as template knobs (MODE bits: 1 d_A's atomics, 2 d_B's, 4 the
// mma, 8 d_B's partials stored, summed by `finish_partials`), each timed alone with L2
// flushed before each run; a full variant's sums are checked against the shipped kernel's
// (err). Results: results_skinny_variants_h100.txt, results_skinny_variants_h200.txt,
// docs/decisions.md "LoRA step: the adapter gradients in one pass over d_y". On a GPU
// machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/skinny_grads_variants.cu -o /tmp/skinny_variants && /tmp/skinny_variants
#include "../../csrc/kernels/skinny_grads.cu"
#include "variants_harness.cuh"

#include <cstdio>
#include <vector>
#include <algorithm>
#include <cmath>

namespace exp_ {
using modulec::copy16;
using modulec::commit;
using modulec::ldmatrix_x4;
using modulec::ldmatrix_x4_trans;
using modulec::mma;
using modulec::add_tile;
using modulec::store_tile;

// MODE bits: 1 = da atomics, 2 = db atomics, 4 = compute (mma); 7 = the real thing;
// 8 = db partials stored (with 1 and 4: 13, the real thing without db's atomics)

// d_B = the row blocks' partials summed (`parts` slices of n floats each), into db: a
// float4 a thread, the partials in order (the same sum every run)
__global__ void finish_partials(const float* __restrict__ part, int parts, int64_t n,
                                float* __restrict__ db) {
  const int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (4 * q >= n) return;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int p = 0; p < parts; ++p) {
    const float4 v = reinterpret_cast<const float4*>(part + p * n)[q];
    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
  }
  reinterpret_cast<float4*>(db)[q] = sum;
}
template <int R, int KR, int KC, int S>
struct Tiles {
  __nv_bfloat16 g[S][KR][KC + 8];
  __nv_bfloat16 b[S][KC][R + 8];
  __nv_bfloat16 a[KR][R + 8];
};

template <int R, int KR, int KC, int S>
__device__ __forceinline__ void load_chunk(Tiles<R, KR, KC, S>& s, int stage,
                                           const __nv_bfloat16* g, int64_t ldg,
                                           const __nv_bfloat16* b, int64_t t0, int64_t n0) {
  constexpr int kRowPieces = KC / 8;
  for (int i = threadIdx.x; i < KR * kRowPieces; i += 256) {
    const int r = i / kRowPieces, p = i % kRowPieces;
    copy16(&s.g[stage][r][p * 8], g + (t0 + r) * ldg + n0 + p * 8);
  }
  constexpr int kBPieces = R / 8;
  for (int i = threadIdx.x; i < KC * kBPieces; i += 256) {
    const int r = i / kBPieces, p = i % kBPieces;
    copy16(&s.b[stage][r][p * 8], b + (n0 + r) * R + p * 8);
  }
}

template <int N>
__device__ __forceinline__ void wait_n() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int R, int KR, int KC, int S, int MODE>
__global__ void __launch_bounds__(256, 1)
    kernel(const __nv_bfloat16* __restrict__ g, int64_t ldg, const __nv_bfloat16* __restrict__ a_in,
           const __nv_bfloat16* __restrict__ b_in, float* __restrict__ da, float* __restrict__ db,
           int64_t n_cols, int chunks_per_cta) {
  constexpr int MT = KR / 128;          // m-tiles of 16 rows per warp for d_A
  constexpr int CG = KC / 16;           // column groups of 16 for d_B
  constexpr int RP = CG >= 8 ? 1 : 8 / CG;   // row parts for d_B (a warp's share of rows)
  constexpr int CGW = CG >= 8 ? CG / 8 : 1;  // column groups a warp (KC 256: 2)
  static_assert(MT >= 1 && RP >= 1 && CG % (8 / RP) == 0, "tile");
  extern __shared__ __align__(128) unsigned char raw[];
  auto& s = *reinterpret_cast<Tiles<R, KR, KC, S>*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * KR;
  const int first = blockIdx.y * chunks_per_cta;
  const int chunks = min(chunks_per_cta, static_cast<int>(n_cols / KC) - first);
  if (chunks <= 0) return;
  constexpr int kAPieces = R / 8;
  for (int i = threadIdx.x; i < KR * kAPieces; i += 256) {
    const int r = i / kAPieces, p = i % kAPieces;
    copy16(&s.a[r][p * 8], a_in + (t0 + r) * R + p * 8);
  }
  for (int st = 0; st < S - 1; ++st) {
    if (st < chunks) load_chunk(s, st, g, ldg, b_in, t0, static_cast<int64_t>(first + st) * KC);
    commit();
  }
  float acc_a[MT][R / 8][4] = {};
  const int rp = CG >= 8 ? 0 : warp / CG;
  for (int c = 0; c < chunks; ++c) {
    const int stage = c % S;
    wait_n<S - 2>();
    __syncthreads();
    {
      const int nc = c + S - 1;
      if (nc < chunks) load_chunk(s, nc % S, g, ldg, b_in, t0, static_cast<int64_t>(first + nc) * KC);
      commit();
    }
    if (MODE & 4) {
      for (int k = 0; k < KC; k += 16) {
        uint32_t a[MT][4];
        for (int m = 0; m < MT; ++m)
          ldmatrix_x4(a[m], &s.g[stage][warp * 16 * MT + m * 16 + lane % 16][k + (lane / 16) * 8]);
        for (int n = 0; n < R / 8; n += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &s.b[stage][k + lane % 8 + ((lane / 8) % 2) * 8][n * 8 + (lane / 16) * 8]);
          for (int m = 0; m < MT; ++m) {
            mma(acc_a[m][n], a[m], b[0], b[1]);
            mma(acc_a[m][n + 1], a[m], b[2], b[3]);
          }
        }
      }
      for (int q = 0; q < CGW; ++q) {
        const int cg = CG >= 8 ? warp * CGW + q : warp % CG;
        float acc_b[R / 8][4] = {};
        const int col = cg * 16;
        for (int k = rp * (KR / RP); k < (rp + 1) * (KR / RP); k += 16) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, &s.g[stage][k + lane % 8 + (lane / 16) * 8][col + ((lane / 8) % 2) * 8]);
          for (int n = 0; n < R / 8; n += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, &s.a[k + lane % 8 + ((lane / 8) % 2) * 8][n * 8 + (lane / 16) * 8]);
            mma(acc_b[n], a, b[0], b[1]);
            mma(acc_b[n + 1], a, b[2], b[3]);
          }
        }
        if (MODE & 2) {
          const int64_t n0 = static_cast<int64_t>(first + c) * KC + col;
          for (int n = 0; n < R / 8; ++n) add_tile<R>(db, n0, n * 8, acc_b[n], lane);
        } else if (MODE & 8) {  // this row block's (and row part's) slice of the partials
          const int64_t n0 = static_cast<int64_t>(first + c) * KC + col;
          float* part = db + (static_cast<int64_t>(blockIdx.x) * RP + rp) * n_cols * R;
          for (int n = 0; n < R / 8; ++n) store_tile<R>(part, n0, n * 8, acc_b[n], lane);
        } else if (acc_b[0][0] == 12345.f) {
          db[0] = acc_b[1][1];  // keep the work
        }
      }
    } else if (lane == 0 && s.g[stage][warp][0] == __float2bfloat16(12345.f)) {
      da[0] = 1.f;  // touch the tile so the loads stay
    }
  }
  wait_n<0>();
  if (MODE & 1) {
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < R / 8; ++n)
        add_tile<R>(da, t0 + warp * 16 * MT + m * 16, n * 8, acc_a[m][n], lane);
  } else if (acc_a[0][0][0] == 12345.f) {
    da[0] = acc_a[0][0][1];
  }
}

template <int R, int KR, int KC, int S, int MODE>
void launch(const __nv_bfloat16* g, const __nv_bfloat16* a, const __nv_bfloat16* b, float* da,
            float* db, int64_t rows, int64_t cols, int sms, int per_sm) {
  const int row_blocks = static_cast<int>(rows / KR);
  const int chunks = static_cast<int>(cols / KC);
  const int splits = std::max(1, std::min(chunks, (sms * per_sm) / row_blocks));
  const int per_cta = (chunks + splits - 1) / splits;
  const int grid_y = (chunks + per_cta - 1) / per_cta;
  const size_t smem = sizeof(Tiles<R, KR, KC, S>);
  cudaFuncSetAttribute(kernel<R, KR, KC, S, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(smem));
  kernel<R, KR, KC, S, MODE><<<dim3(row_blocks, grid_y), 256, smem>>>(g, cols, a, b, da, db, cols,
                                                                       per_cta);
}

__global__ void read_all(const float4* p, int64_t n, float* out) {
  float4 acc = make_float4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float4 v = p[i];
    acc.x += v.x; acc.y += v.y;
  }
  if (acc.x == 12345.f) out[0] = acc.y;
}

// A plain read with UNROLL independent 16-byte loads in flight a thread (the read_all loop
// keeps one): what the card gives a kernel that only streams d_C.
template <int UNROLL>
__global__ void read_unrolled(const uint4* p, int64_t n, float* out) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i + u * stride < n) v[u] = p[i + u * stride];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i + u * stride < n) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678u) out[0] = 1.f;
}

// The one-pass kernel's access pattern without shared memory: a CTA of 256 threads walks
// its KR rows x KC columns chunk after chunk (as the kernel's grid), each thread holding
// its KR * KC / 8 / 256 pieces of a chunk in registers (all loads in flight together).
template <int KR, int KC>
__global__ void __launch_bounds__(256) read_tiles(const __nv_bfloat16* g, int64_t ldg,
                                                  int64_t n_cols, int chunks_per_cta,
                                                  float* out) {
  constexpr int kRowPieces = KC / 8, kPer = KR * kRowPieces / 256;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * KR;
  const int first = blockIdx.y * chunks_per_cta;
  const int chunks = min(chunks_per_cta, static_cast<int>(n_cols / KC) - first);
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const int64_t n0 = static_cast<int64_t>(first + c) * KC;
    uint4 v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + j * 256, r = i / kRowPieces, q = i % kRowPieces;
      v[j] = *reinterpret_cast<const uint4*>(g + (t0 + r) * ldg + n0 + q * 8);
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc ^= v[j].x ^ v[j].w;
  }
  if (acc == 0x12345678u) out[0] = 1.f;
}

template <int KR, int KC>
void launch_read_tiles(const __nv_bfloat16* g, int64_t rows, int64_t cols, int ctas,
                       float* out) {
  const int row_blocks = static_cast<int>(rows / KR), chunks = static_cast<int>(cols / KC);
  const int splits = std::max(1, std::min(chunks, ctas / row_blocks));
  const int per_cta = (chunks + splits - 1) / splits;
  read_tiles<KR, KC><<<dim3(row_blocks, (chunks + per_cta - 1) / per_cta), 256>>>(
      g, cols, cols, per_cta, out);
}
}  // namespace exp_

template <int R>
struct Problem {
  const char* name; int64_t T, N;
  __nv_bfloat16 *g, *a, *b; float *da, *db, *da2, *db2;
  int sms;
  Problem(const char* name_, int64_t T_, int64_t N_, int sms_) : name(name_), T(T_), N(N_), sms(sms_) {
    std::vector<__nv_bfloat16> hg(T * N), ha(T * R), hb(N * R);
    fill(hg, 1); fill(ha, 2); fill(hb, 3);
    CK(cudaMalloc(&g, T * N * 2)); CK(cudaMalloc(&a, T * R * 2)); CK(cudaMalloc(&b, N * R * 2));
    cudaMemcpy(g, hg.data(), T * N * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(a, ha.data(), T * R * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(b, hb.data(), N * R * 2, cudaMemcpyHostToDevice);
    CK(cudaMalloc(&da, T * R * 4)); CK(cudaMalloc(&db, N * R * 4));
    CK(cudaMalloc(&da2, T * R * 4)); CK(cudaMalloc(&db2, N * R * 4));
  }
  void zero() { cudaMemset(da, 0, T * R * 4); cudaMemset(db, 0, N * R * 4); cudaMemset(da2, 0, T * R * 4); cudaMemset(db2, 0, N * R * 4); }
  double mb() const { return T * N * 2 / 1e6; }
  void report(const char* what, float us) const {
    printf("%-8s R=%-2d %-34s %8.1f us %6.2f TB/s\n", name, R, what, us, mb() / us);
  }
  template <int KR, int KC, int S, int PER_SM = 1>
  void variant() {
    // correctness of the full variant against the shipped kernel
    zero();
    modulec::launch<R, false, false>(g, N, a, R, b, da, db, T, N, modulec::SkinnyBlocks{}, sms, 0);
    exp_::launch<R, KR, KC, S, 7>(g, a, b, da2, db2, T, N, sms, PER_SM);
    CK(cudaDeviceSynchronize());
    const double ea = max_rel(da, da2, T * R), eb = max_rel(db, db2, N * R);
    char buf[128];
    snprintf(buf, sizeof buf, "KR%d KC%d S%d x%d (err %.1e %.1e)", KR, KC, S, PER_SM, ea, eb);
    report(buf, time_us([&] { exp_::launch<R, KR, KC, S, 7>(g, a, b, da2, db2, T, N, sms, PER_SM); }));
  }
  // d_B's partials stored by each row block (MODE 13) and summed by a second launch,
  // checked against the shipped kernel's sums; the partials take T / KR x RP slices of
  // N x R floats (gate/up at KR 256: 8 x 3.7 MB)
  template <int KR, int KC, int S>
  void partials() {
    constexpr int CG = KC / 16, RP = CG >= 8 ? 1 : 8 / CG;
    const int parts = static_cast<int>(T / KR) * RP;
    float* part;
    CK(cudaMalloc(&part, parts * N * R * 4));
    zero();
    modulec::launch<R, false, false>(g, N, a, R, b, da, db, T, N, modulec::SkinnyBlocks{}, sms, 0);
    exp_::launch<R, KR, KC, S, 13>(g, a, b, da2, part, T, N, sms, 1);
    exp_::finish_partials<<<(N * R / 4 + 255) / 256, 256>>>(part, parts, N * R, db2);
    CK(cudaDeviceSynchronize());
    const double ea = max_rel(da, da2, T * R), eb = max_rel(db, db2, N * R);
    char buf[128];
    snprintf(buf, sizeof buf, "KR%d KC%d S%d db partials (err %.1e %.1e)", KR, KC, S, ea, eb);
    report(buf, time_us([&] { exp_::launch<R, KR, KC, S, 13>(g, a, b, da2, part, T, N, sms, 1); }));
    snprintf(buf, sizeof buf, "  + their sum (%d partials)", parts);
    report(buf, time_us([&] {
      exp_::launch<R, KR, KC, S, 13>(g, a, b, da2, part, T, N, sms, 1);
      exp_::finish_partials<<<(N * R / 4 + 255) / 256, 256>>>(part, parts, N * R, db2);
    }));
    CK(cudaFree(part));
  }
  // as the step runs q/k/v and gate/up: B block-diagonal (R / 16 equal blocks of rows),
  // d_B stacked [N, 16]; sums (atomics) against partials, kernel + finish
  void blocked() {
    modulec::SkinnyBlocks blocks{};
    blocks.n = R / 16;
    blocks.compact = true;
    for (int i = 0; i < blocks.n; ++i) blocks.end[i] = N / blocks.n * (i + 1);
    __nv_bfloat16 *out_a, *out_b, *out_a2, *out_b2;
    float* work;
    const int64_t floats = modulec::skinny_partial_floats(T, N, R, blocks, sms);
    CK(cudaMalloc(&out_a, T * R * 2)); CK(cudaMalloc(&out_b, N * 16 * 2));
    CK(cudaMalloc(&out_a2, T * R * 2)); CK(cudaMalloc(&out_b2, N * 16 * 2));
    CK(cudaMalloc(&work, floats * 4));
    const modulec::SkinnySums sums{nullptr, da, db}, parts{work, nullptr, nullptr};
    zero();
    report("blocked: kernel + finish (sums)", time_us([&] {
      modulec::launch_skinny_nt_backward(g, N, a, R, b, sums, out_a, R, out_b, T, N, R, 1.f, blocks, sms, 0); }));
    report("blocked: partials + finish", time_us([&] {
      modulec::launch_skinny_nt_backward(g, N, a, R, b, parts, out_a2, R, out_b2, T, N, R, 1.f, blocks, sms, 0); }));
    CK(cudaDeviceSynchronize());
    printf("%-8s R=%-2d blocked partials against sums: d_A max diff %.1e, d_B %.1e (bf16)\n",
           name, R, max_diff(out_a, out_a2, T * R), max_diff(out_b, out_b2, N * 16));
    CK(cudaFree(out_a)); CK(cudaFree(out_b)); CK(cudaFree(out_a2)); CK(cudaFree(out_b2));
    CK(cudaFree(work));
  }
  template <int KR, int KC, int S, int MODE, int PER_SM = 1>
  void mode(const char* label) {
    report(label, time_us([&] { exp_::launch<R, KR, KC, S, MODE>(g, a, b, da2, db2, T, N, sms, PER_SM); }));
  }
  void run_all() {
    report("read d_C (float4 loop)", time_us([&] { exp_::read_all<<<sms * 8, 512>>>((const float4*)g, T * N * 2 / 16, da2); }));
    const int64_t pieces = T * N * 2 / 16;
    report("read d_C, 4 loads in flight", time_us([&] { exp_::read_unrolled<4><<<sms * 4, 512>>>((const uint4*)g, pieces, da2); }));
    report("read d_C, 8 loads in flight", time_us([&] { exp_::read_unrolled<8><<<sms * 4, 512>>>((const uint4*)g, pieces, da2); }));
    report("read tiles 256x128, 1 CTA an SM", time_us([&] { exp_::launch_read_tiles<256, 128>(g, T, N, sms, da2); }));
    report("read tiles 256x128, 4 CTAs an SM", time_us([&] { exp_::launch_read_tiles<256, 128>(g, T, N, 4 * sms, da2); }));
    report("read tiles 256x256, 4 CTAs an SM", time_us([&] { exp_::launch_read_tiles<256, 256>(g, T, N, 4 * sms, da2); }));
    report("read tiles 64x512, 4 CTAs an SM", time_us([&] { exp_::launch_read_tiles<64, 512>(g, T, N, 4 * sms, da2); }));
    report("shipped kernel alone", time_us([&] { modulec::launch<R, false, false>(g, N, a, R, b, da, db, T, N, modulec::SkinnyBlocks{}, sms, 0); }));
    // d_A / d_B in bf16 from the sums (atomics) and from the partials (shipped both ways)
    __nv_bfloat16 *out_a, *out_b, *out_a2, *out_b2;
    float* work;
    const int64_t floats = modulec::skinny_partial_floats(T, N, R, modulec::SkinnyBlocks{}, sms);
    CK(cudaMalloc(&out_a, T * R * 2)); CK(cudaMalloc(&out_b, N * R * 2));
    CK(cudaMalloc(&out_a2, T * R * 2)); CK(cudaMalloc(&out_b2, N * R * 2));
    CK(cudaMalloc(&work, floats * 4));
    const modulec::SkinnySums sums{nullptr, da, db}, parts{work, nullptr, nullptr};
    zero();
    report("shipped kernel + finish (sums)", time_us([&] {
      modulec::launch_skinny_nt_backward(g, N, a, R, b, sums, out_a, R, out_b, T, N, R, 1.f, modulec::SkinnyBlocks{}, sms, 0); }));
    report("shipped partials alone", time_us([&] { modulec::launch<R, false, true>(g, N, a, R, b, work, work + (floats - T / 256 * N * R), T, N, modulec::SkinnyBlocks{}, sms, 0); }));
    report("shipped partials + finish", time_us([&] {
      modulec::launch_skinny_nt_backward(g, N, a, R, b, parts, out_a2, R, out_b2, T, N, R, 1.f, modulec::SkinnyBlocks{}, sms, 0); }));
    CK(cudaDeviceSynchronize());
    printf("%-8s R=%-2d partials against sums: d_A max diff %.1e, d_B %.1e (bf16)\n", name, R,
           max_diff(out_a, out_a2, T * R), max_diff(out_b, out_b2, N * R));
    CK(cudaFree(out_a)); CK(cudaFree(out_b)); CK(cudaFree(out_a2)); CK(cudaFree(out_b2));
    CK(cudaFree(work));
    if (R > 16) blocked();
    mode<256, 128, 2, 0>("KR256 KC128 S2 loads only");
    mode<256, 128, 2, 4>("KR256 KC128 S2 compute, no atomics");
    mode<256, 128, 2, 5>("KR256 KC128 S2 compute + da atomics");
    mode<256, 128, 2, 6>("KR256 KC128 S2 compute + db atomics");
    variant<256, 128, 2>();
    // d_B's partials with plain stores, then their sum: no d_B atomics and no sums to zero
    // (the finishing launch's zeroing is ~2.2 of its 6.9 us at gate/up:
    // results_skinny_finish_h100.txt); session 23, one H100: results_skinny_variants_h100.txt
    partials<256, 128, 2>();
    variant<256, 64, 4>();
    variant<256, 64, 3>();
    variant<128, 128, 3>();
    variant<128, 128, 4>();
    variant<128, 64, 4>();
    mode<128, 128, 4, 0>("KR128 KC128 S4 loads only");
    mode<128, 128, 4, 4>("KR128 KC128 S4 compute, no atomics");
    mode<128, 128, 4, 6>("KR128 KC128 S4 compute + db atomics");
    // 512-byte row runs (KC 256): a CTA's tile reads fewer, longer pieces of each row
    // (copies in 16-row blocks of 256 columns ran at 2.7 TB/s against 1.4 in 64-column
    // strips: docs/decisions.md "LoRA step at the power cap"); not yet run on a GPU
    // two CTAs a multiprocessor (128-row tiles, two stages: 100 KB of shared memory each):
    // twice the tiles in flight of one CTA's
    mode<128, 128, 2, 0>("KR128 KC128 S2 loads only");
    mode<128, 128, 2, 0, 2>("KR128 KC128 S2 loads only, 2 an SM");
    mode<128, 128, 2, 4, 2>("KR128 KC128 S2 compute, 2 an SM");
    variant<128, 128, 2, 2>();
    variant<128, 256, 2>();
    mode<128, 256, 2, 0>("KR128 KC256 S2 loads only");
    mode<128, 256, 2, 6>("KR128 KC256 S2 compute + db atomics");
  }
};

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  init_flush();
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
  printf("%s, %d SMs\n", p.name, sms);
  { Problem<32> q("gate_up", 2048, 28672, sms); q.run_all(); }
  { Problem<48> q("qkv", 2048, 6144, sms); q.run_all(); }
  { Problem<16> q("o/down", 2048, 4096, sms); q.run_all(); }
  return 0;
}
