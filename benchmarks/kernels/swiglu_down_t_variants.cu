// swiglu's forward with LoRA's down adapter input t = h A^T in the same pass (docs/gpu.md
// "LoRA", the leads): at LoRA 8B (T=2048, d_ff 14336, rank 16) the step writes
// h = silu(gate) up (58.7 MB) and a split-K GEMM then reads all of h back for t [T, 16]
// (25.2 + 1.6 us in the step's replay). Here the kernel that makes h also sums t on the
// tensor cores from the h it holds in registers:
//   a CTA owns 16 rows, its 16 warps a 896-column run each; per 16-column step a lane
//   loads its m16n8k16 fragment's 8 gate and 8 up values (bf16 pairs), makes their 8 h
//   (swiglu.cu's arithmetic, so its bits), stores them, and feeds them as the A operand
//   with A_down's 16 x 16 slice as B (bf16 pairs read from A [16, d_ff]); the warps'
//   fp32 partials meet in shared memory and are summed in warp order (deterministic),
//   t written in bf16.
// A second form splits a row block's columns over more, smaller CTAs (more warps a
// multiprocessor), each writing its t partial in fp32, summed in order by a second launch;
// a third keeps swiglu's 16-byte accesses and hands h to the mma through a shared tile
// (the best so far, one CTA of 16 warps a multiprocessor; its forms with 2 CTAs a
// multiprocessor, registers bounded at 64, ran slower: 96.4 and 103.9 against 87.9 us on
// one H200, session 24, where the two kernels apart take 49.4 + 23.6). (Staging gate and up through shared memory by cp.async, 16 rows x
// 512 columns, three chunks in flight, ran slower: 112.8 us, session 23.) Checked here: h
// against the shipped swiglu forward's bits, t against a float64 host sum of the same
// bf16 h, the other forms' t against the first's. Timed alone, L2 flushed: the shipped
// forward, the fused forms, and a plain read of h (the least the split-K GEMM it replaces
// costs). Results: results_swiglu_down_t_h100.txt, results_swiglu_down_t_h200.txt. On a
// GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/swiglu_down_t_variants.cu csrc/kernels/swiglu.cu \
//     csrc/kernels/fp8_amax.cu -o /tmp/swiglu_t && /tmp/swiglu_t
#include "../../csrc/kernels/skinny_grads.cu"
#include "activations.cuh"
#include "variants_harness.cuh"

#include <cstdio>
#include <vector>

using bf16 = __nv_bfloat16;

namespace exp_ {
using modulec::act;
using modulec::kSilu;
using modulec::mma;

constexpr int kRank = 16, kRowsCta = 16, kWarps = 16;

__device__ __forceinline__ uint32_t load_pair(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// h of a bf16 pair of gate and up: act(g) u in fp32, rounded as swiglu.cu's store_vec does
__device__ __forceinline__ uint32_t h_pair(uint32_t g2, uint32_t u2) {
  const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g2));
  const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u2));
  const __nv_bfloat162 h = __halves2bfloat162(__float2bfloat16_rn(act<kSilu>(g.x) * u.x),
                                              __float2bfloat16_rn(act<kSilu>(g.y) * u.y));
  return *reinterpret_cast<const uint32_t*>(&h);
}

struct Args {
  const bf16* gate; int64_t ld_g;
  const bf16* up; int64_t ld_u;
  const bf16* a;  // A_down [16, C]
  bf16* h; int64_t ld_h;
  bf16* t; int64_t ld_t;
  int64_t C;
};

// The warps' accumulators (rows lane / 4 (+ 8), ranks 8 n + 2 (lane % 4) (+ 1)) into
// shared memory, then summed in warp order: t in bf16, or (SPLIT > 1) this CTA's fp32
// partial of t for finish_t
template <int W, int SPLIT>
__device__ __forceinline__ void write_t(float (&part)[W][kRowsCta][kRank + 1],
                                        const float (&acc)[2][4], const Args& p,
                                        float* t_parts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = 2 * (lane % 4);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    part[warp][lane / 4][8 * n + q] = acc[n][0];
    part[warp][lane / 4][8 * n + q + 1] = acc[n][1];
    part[warp][lane / 4 + 8][8 * n + q] = acc[n][2];
    part[warp][lane / 4 + 8][8 * n + q + 1] = acc[n][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRowsCta * kRank; i += W * 32) {
    const int row = i / kRank, r = i % kRank;
    float sum = 0.f;
    for (int w = 0; w < W; ++w) sum += part[w][row][r];
    const int64_t at = static_cast<int64_t>(blockIdx.x) * kRowsCta + row;
    if (SPLIT == 1)
      p.t[at * p.ld_t + r] = __float2bfloat16_rn(sum);
    else
      t_parts[(static_cast<int64_t>(blockIdx.y) * gridDim.x * kRowsCta + at) * kRank + r] = sum;
  }
}

// W warps a CTA; SPLIT CTAs share a row block's columns, each writing its t partial (fp32,
// [SPLIT, T, 16]) for `finish_t` to sum in order; SPLIT 1 writes t itself
template <int UNROLL, int W = kWarps, int SPLIT = 1, int MIN_BLOCKS = 1>
__global__ void __launch_bounds__(W * 32, MIN_BLOCKS) swiglu_down_t(Args p, float* t_parts) {
  __shared__ float part[W][kRowsCta][kRank + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsCta + lane / 4, r1 = r0 + 8;
  const int64_t span = p.C / (W * SPLIT), first = (blockIdx.y * W + warp) * span;
  const int q = 2 * (lane % 4);
  float acc[2][4] = {};
  for (int64_t k = first; k < first + span; k += 16 * UNROLL) {
    uint32_t g[UNROLL][4], u[UNROLL][4], b[UNROLL][4];
#pragma unroll
    for (int s = 0; s < UNROLL; ++s) {  // every load of the run first: in flight together
      const int64_t c0 = k + 16 * s + q, c1 = c0 + 8;
      g[s][0] = load_pair(p.gate + r0 * p.ld_g + c0);
      g[s][1] = load_pair(p.gate + r1 * p.ld_g + c0);
      g[s][2] = load_pair(p.gate + r0 * p.ld_g + c1);
      g[s][3] = load_pair(p.gate + r1 * p.ld_g + c1);
      u[s][0] = load_pair(p.up + r0 * p.ld_u + c0);
      u[s][1] = load_pair(p.up + r1 * p.ld_u + c0);
      u[s][2] = load_pair(p.up + r0 * p.ld_u + c1);
      u[s][3] = load_pair(p.up + r1 * p.ld_u + c1);
      // B = A^T: B[k][n] = A[n][k], n = lane / 4 (+ 8 for the second n-tile)
      b[s][0] = load_pair(p.a + (lane / 4) * p.C + c0);
      b[s][1] = load_pair(p.a + (lane / 4) * p.C + c1);
      b[s][2] = load_pair(p.a + (lane / 4 + 8) * p.C + c0);
      b[s][3] = load_pair(p.a + (lane / 4 + 8) * p.C + c1);
    }
#pragma unroll
    for (int s = 0; s < UNROLL; ++s) {
      const int64_t c0 = k + 16 * s + q, c1 = c0 + 8;
      uint32_t h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = h_pair(g[s][i], u[s][i]);
      *reinterpret_cast<uint32_t*>(p.h + r0 * p.ld_h + c0) = h[0];
      *reinterpret_cast<uint32_t*>(p.h + r1 * p.ld_h + c0) = h[1];
      *reinterpret_cast<uint32_t*>(p.h + r0 * p.ld_h + c1) = h[2];
      *reinterpret_cast<uint32_t*>(p.h + r1 * p.ld_h + c1) = h[3];
      mma(acc[0], h, b[s][0], b[s][1]);
      mma(acc[1], h, b[s][2], b[s][3]);
    }
  }
  write_t<W, SPLIT>(part, acc, p, t_parts);
}

// t = the SPLIT partials summed in order, in bf16
__global__ void finish_t(const float* __restrict__ parts, int split, int64_t rows,
                         bf16* __restrict__ t, int64_t ld_t) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * kRank) return;
  float sum = 0.f;
  for (int s = 0; s < split; ++s) sum += parts[s * rows * kRank + i];
  t[(i / kRank) * ld_t + i % kRank] = __float2bfloat16_rn(sum);
}

// Vectors: gate and up read as swiglu.cu reads them (16 bytes a thread, consecutive
// threads along a row), h made and stored the same way and also put in a shared tile
// (16 rows x kSpan columns), from which each warp's 16 x 16 steps reach the mma by
// ldmatrix; the next tile's gate and up are loaded into registers before this one's mma.
// SPAN columns a tile; MIN_BLOCKS CTAs a multiprocessor (2: registers bounded at 64)
template <int SPAN>
constexpr int kVecs = kRowsCta * SPAN / 8 / (kWarps * 32);

template <int SPAN>
__device__ __forceinline__ void load_vectors(uint4 (&g)[kVecs<SPAN>], uint4 (&u)[kVecs<SPAN>],
                                             const Args& p, int64_t row0, int64_t col0) {
  constexpr int kSpan = SPAN;
#pragma unroll
  for (int v = 0; v < kVecs<SPAN>; ++v) {
    const int i = threadIdx.x + v * kWarps * 32;
    const int r = i / (kSpan / 8), c = (i % (kSpan / 8)) * 8;
    g[v] = *reinterpret_cast<const uint4*>(p.gate + (row0 + r) * p.ld_g + col0 + c);
    u[v] = *reinterpret_cast<const uint4*>(p.up + (row0 + r) * p.ld_u + col0 + c);
  }
}

template <int SPAN, int MIN_BLOCKS>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) swiglu_down_t_vectors(Args p) {
  constexpr int kSpan = SPAN, kVec = kVecs<SPAN>;
  using Tile = bf16[kRowsCta][kSpan + 8];
  using Part = float[kWarps][kRowsCta][kRank + 1];  // the warps' partials of t, at the end
  __shared__ __align__(16) unsigned char raw[sizeof(Tile) > sizeof(Part) ? sizeof(Tile)
                                                                          : sizeof(Part)];
  Tile& tile = *reinterpret_cast<Tile*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = 2 * (lane % 4);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsCta;
  const int spans = static_cast<int>(p.C / kSpan);
  uint4 g[kVec], u[kVec];
  load_vectors<SPAN>(g, u, p, row0, 0);
  float acc[2][4] = {};
  for (int sp = 0; sp < spans; ++sp) {
    const int64_t col0 = static_cast<int64_t>(sp) * kSpan;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {  // h: into global and into the tile
      const int i = threadIdx.x + v * kWarps * 32;
      const int r = i / (kSpan / 8), c = (i % (kSpan / 8)) * 8;
      uint4 h;
      h.x = h_pair(g[v].x, u[v].x);
      h.y = h_pair(g[v].y, u[v].y);
      h.z = h_pair(g[v].z, u[v].z);
      h.w = h_pair(g[v].w, u[v].w);
      *reinterpret_cast<uint4*>(p.h + (row0 + r) * p.ld_h + col0 + c) = h;
      *reinterpret_cast<uint4*>(&tile[r][c]) = h;
    }
    // the next tile's gate and up: in flight through this one's mma
    if (sp + 1 < spans) load_vectors<SPAN>(g, u, p, row0, col0 + kSpan);
    __syncthreads();
#pragma unroll
    for (int step = 0; step < kSpan / 16 / kWarps; ++step) {
      const int k = (warp * (kSpan / 16 / kWarps) + step) * 16;
      uint32_t a[4];
      modulec::ldmatrix_x4(a, &tile[lane % 16][k + (lane / 16) * 8]);
      const int64_t c0 = col0 + k + q, c1 = c0 + 8;
      const uint32_t b0 = load_pair(p.a + (lane / 4) * p.C + c0);
      const uint32_t b1 = load_pair(p.a + (lane / 4) * p.C + c1);
      const uint32_t b2 = load_pair(p.a + (lane / 4 + 8) * p.C + c0);
      const uint32_t b3 = load_pair(p.a + (lane / 4 + 8) * p.C + c1);
      mma(acc[0], a, b0, b1);
      mma(acc[1], a, b2, b3);
    }
    __syncthreads();  // the tile is rewritten next
  }
  // the tile is done with: the warps' partials of t go where it was
  write_t<kWarps, 1>(*reinterpret_cast<Part*>(raw), acc, p, nullptr);
}

}  // namespace exp_

int main() {
  init_flush();
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  const int64_t T = 2048, C = 14336, ld_gu = 2 * C, ld_h = C + 16;  // t beside h, as the step
  bf16* gu = upload(T * ld_gu, 1, 8.f);  // gate | up, values in [-4, 4)
  bf16* a = upload(exp_::kRank * C, 2, 0.05f);
  bf16 *h_ref, *h_got;
  float* sink;
  CK(cudaMalloc(&h_ref, T * ld_h * 2)); CK(cudaMalloc(&h_got, T * ld_h * 2));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(h_ref, 0, T * ld_h * 2)); CK(cudaMemset(h_got, 0, T * ld_h * 2));
  const exp_::Args args{gu, ld_gu, gu + C, ld_gu, a, h_got, ld_h, h_got + C, ld_h, C};
  printf("%s, %d SMs: swiglu forward at LoRA 8B (T=%ld, d_ff=%ld), t = h A^T (rank 16)\n",
         prop.name, sms, (long)T, (long)C);
  const double mb = 3.0 * T * C * 2 / 1e6;
  auto report = [&](const char* what, float us, double bytes_mb) {
    printf("  %-46s %7.1f us %5.2f TB/s\n", what, us, bytes_mb / us);
  };
  report("shipped swiglu forward", time_us([&] {
    CK(modulec::launch_swiglu_forward(modulec::DType::BF16, gu, ld_gu, gu + C, ld_gu, h_ref,
                                      ld_h, T, C, modulec::kSilu, 0)); }), mb);
  report("  h read once (the split-K GEMM's least)", time_us([&] {
    read_rows<false><<<sms * 8, 512>>>(h_ref, 1, T * ld_h / 8, 0, sink);  // h read once
  }), T * C * 2 / 1e6);
  float* t_parts;
  CK(cudaMalloc(&t_parts, 8 * T * exp_::kRank * 4));
  auto fused = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(T / exp_::kRowsCta), exp_::kWarps * 32>>>(args, nullptr);
  };
  // W warps a CTA, SPLIT CTAs a row block, then the partials' sum
  auto split = [&](auto kernel, int warps, int parts) {
    kernel<<<dim3(static_cast<unsigned>(T / exp_::kRowsCta), parts), warps * 32>>>(args, t_parts);
    exp_::finish_t<<<static_cast<unsigned>((T * exp_::kRank + 255) / 256), 256>>>(
        t_parts, parts, T, h_got + C, ld_h);
  };
  // checks: h's bits, t against float64 sums of the bf16 h
  fused(exp_::swiglu_down_t<2>);
  CK(cudaDeviceSynchronize());
  const auto hr = download(h_ref, T * ld_h), hg = download(h_got, T * ld_h);
  const auto ah = download(a, exp_::kRank * C);
  int64_t h_diff = 0;
  double t_err = 0, t_max = 0;
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t c = 0; c < C; ++c)
      h_diff += __bfloat162float(hr[r * ld_h + c]) != __bfloat162float(hg[r * ld_h + c]);
    for (int k = 0; k < exp_::kRank; ++k) {
      double want = 0;
      for (int64_t c = 0; c < C; ++c)
        want += (double)__bfloat162float(hr[r * ld_h + c]) * __bfloat162float(ah[k * C + c]);
      t_max = std::max(t_max, std::fabs(want));
      t_err = std::max(t_err, std::fabs(want - (double)__bfloat162float(hg[r * ld_h + C + k])));
    }
  }
  printf("  check: h elements differing from the shipped forward's %ld; t max error %.2e of max "
         "|t| %.2e (rel %.1e)\n", (long)h_diff, t_err, t_max, t_err / t_max);
  report("fused, 2 steps in flight", time_us([&] { fused(exp_::swiglu_down_t<2>); }), mb);
  // another form's h against the shipped forward's bits, its t against the first form's
  // (the same sums in another order)
  auto compare = [&](const char* name, auto run) {
    CK(cudaMemset(h_got, 0, T * ld_h * 2));
    run();
    CK(cudaDeviceSynchronize());
    const auto hs = download(h_got, T * ld_h);
    int64_t differ = 0;
    double s_err = 0;
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t c = 0; c < C; ++c)
        differ += __bfloat162float(hs[r * ld_h + c]) != __bfloat162float(hr[r * ld_h + c]);
      for (int k = 0; k < exp_::kRank; ++k)
        s_err = std::max(s_err, std::fabs((double)__bfloat162float(hs[r * ld_h + C + k]) -
                                          __bfloat162float(hg[r * ld_h + C + k])));
    }
    printf("  check: %s h elements differing from the shipped forward's %ld; t within %.2e "
           "of the first form's\n", name, (long)differ, s_err);
  };
  report("fused, 4 steps in flight", time_us([&] { fused(exp_::swiglu_down_t<4>); }), mb);
  // the vectors form: swiglu's own accesses, h to the mma through a shared tile
  auto vectors = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(T / exp_::kRowsCta), exp_::kWarps * 32>>>(args);
  };
  compare("vectors", [&] { vectors(exp_::swiglu_down_t_vectors<1024, 1>); });
  report("vectors: 16-byte accesses, h through a shared tile",
         time_us([&] { vectors(exp_::swiglu_down_t_vectors<1024, 1>); }), mb);
  report("vectors, 512-column tiles, 2 CTAs a multiprocessor",
         time_us([&] { vectors(exp_::swiglu_down_t_vectors<512, 2>); }), mb);
  report("vectors, 1024-column tiles, 2 CTAs a multiprocessor",
         time_us([&] { vectors(exp_::swiglu_down_t_vectors<1024, 2>); }), mb);
  // the column runs split over more CTAs (more warps a multiprocessor), t's partials summed
  compare("split", [&] { split(exp_::swiglu_down_t<2, 8, 8, 3>, 8, 8); });
  report("split: 8 warps a CTA, 8 CTAs a row block, + sum",
         time_us([&] { split(exp_::swiglu_down_t<2, 8, 8, 3>, 8, 8); }), mb);
  report("split: 8 warps a CTA, 4 CTAs a row block, + sum",
         time_us([&] { split(exp_::swiglu_down_t<2, 8, 4, 3>, 8, 4); }), mb);
  report("split: 4 warps a CTA, 8 CTAs a row block, + sum",
         time_us([&] { split(exp_::swiglu_down_t<2, 4, 8, 6>, 4, 8); }), mb);
  cudaFree(gu); cudaFree(a); cudaFree(h_ref); cudaFree(h_got); cudaFree(sink); cudaFree(t_parts);
  return 0;
}
