// swiglu's backward at the LoRA 8B shape (T=2048, d_ff 14336): d_gate and d_up from d_h,
// gate and up (csrc/kernels/swiglu.cu), 293 MB moved a call. In the step's replay it took
// 91.6 us a layer on one H200 (3.2 TB/s), where swiglu's forward moves its 176 MB at 3.9.
// Timed here alone, L2 flushed, with the step's row strides (gate | up and d_gate | d_up the
// halves of [T, 2 d_ff + 32] buffers, d_h [T, d_ff]):
//   - the shipped kernel (one 16-byte vector of each operand a thread);
//   - U vectors a thread, a block's U x 256 vectors contiguous, every load issued before
//     any arithmetic (more bytes in flight a thread);
//   - the same with the inputs read through the streaming (evict-first) cache policy,
//     since no later kernel reads d_h, gate or up: d_gate and d_up may stay in the L2
//     for the kernels that read them next.
// Every form computes swiglu.cu's arithmetic, checked bit for bit against the shipped one.
// Then the pair the step runs: the backward and a read of d_gate | d_up right after it (no
// flush between; the one-pass adapter sums come next in the step), read from the first row
// or from the last (the last rows written are the ones still in the L2).
// On a GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/swiglu_backward_variants.cu csrc/kernels/fp8_amax.cu \
//     -o /tmp/swiglu_bwd && /tmp/swiglu_bwd
#include "../../csrc/kernels/swiglu.cu"
#include "variants_harness.cuh"

#include <cstdio>

using bf16 = __nv_bfloat16;


namespace exp_ {
using modulec::kSilu;
using modulec::store_vec;
using modulec::swiglu_grad;

struct Args {
  const bf16* dy; int64_t ld_dy;
  const bf16* g; int64_t ld_g;
  const bf16* u; int64_t ld_u;
  bf16* dg; int64_t ld_dg;
  bf16* du; int64_t ld_du;
  int64_t rows, cv;  // cv: 8-wide vectors a row (C % 8 == 0 here)
};

template <bool STREAM>
__device__ __forceinline__ uint4 load16(const bf16* p) {
  if constexpr (STREAM) return __ldcs(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void unpack(uint4 v, float (&f)[8]) {
  const bf16* h = reinterpret_cast<const bf16*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(h[j]);
}

// U vectors a thread, block b owning vectors [b U 256, (b + 1) U 256) of the rows x cv grid
template <int U, bool STREAM>
__global__ void __launch_bounds__(256) swiglu_backward_unrolled(Args a) {
  const int64_t total = a.rows * a.cv;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (256 * U) + threadIdx.x;
  uint4 dy[U], g[U], u[U];
  int64_t at_r[U], at_c[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t idx = first + k * 256;
    at_r[k] = idx < total ? idx / a.cv : -1;
    at_c[k] = idx < total ? (idx - at_r[k] * a.cv) * 8 : 0;
    if (at_r[k] < 0) continue;
    dy[k] = load16<STREAM>(a.dy + at_r[k] * a.ld_dy + at_c[k]);
    g[k] = load16<STREAM>(a.g + at_r[k] * a.ld_g + at_c[k]);
    u[k] = load16<STREAM>(a.u + at_r[k] * a.ld_u + at_c[k]);
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    if (at_r[k] < 0) continue;
    float dyf[8], gf[8], uf[8], dgf[8], duf[8];
    unpack(dy[k], dyf); unpack(g[k], gf); unpack(u[k], uf);
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grad<kSilu>(dyf[j], gf[j], uf[j], dgf[j], duf[j]);
    store_vec<bf16, 8>(a.dg + at_r[k] * a.ld_dg + at_c[k], 0, dgf);
    store_vec<bf16, 8>(a.du + at_r[k] * a.ld_du + at_c[k], 0, duf);
  }
}

}  // namespace exp_

int main() {
  init_flush();
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  const int64_t T = 2048, C = 14336, ld_gu = 2 * C + 32, ld_dh = C;
  bf16* gu = upload(T * ld_gu, 1, 8.f);
  bf16* dh = upload(T * ld_dh, 2, 0.1f);
  bf16 *ref, *got;
  float* sink;
  CK(cudaMalloc(&ref, T * ld_gu * 2)); CK(cudaMalloc(&got, T * ld_gu * 2));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(ref, 0, T * ld_gu * 2));
  const exp_::Args args{dh, ld_dh, gu, ld_gu, gu + C, ld_gu, got, ld_gu, got + C, ld_gu, T, C / 8};
  printf("%s, %d SMs: swiglu backward at LoRA 8B (T=%ld, d_ff=%ld)\n", prop.name, sms, (long)T,
         (long)C);
  const double mb = 5.0 * T * C * 2 / 1e6;
  auto report = [&](const char* what, float us, double bytes_mb) {
    printf("  %-52s %7.1f us %5.2f TB/s\n", what, us, bytes_mb / us);
  };
  auto shipped = [&] {
    CK(modulec::launch_swiglu_backward(modulec::DType::BF16, dh, ld_dh, gu, ld_gu,
                                       gu + C, ld_gu, ref, ld_gu, ref + C, ld_gu, nullptr, 0, T,
                                       C, modulec::kSilu, 0));
  };
  report("shipped", time_us(shipped), mb);
  auto unrolled = [&](auto kernel, int u) {
    const int64_t blocks = (T * (C / 8) + 256 * u - 1) / (256 * u);
    kernel<<<static_cast<unsigned>(blocks), 256>>>(args);
  };
  auto check = [&](const char* name, auto run) {
    CK(cudaMemset(got, 0, T * ld_gu * 2));
    run();
    CK(cudaDeviceSynchronize());
    printf("  check: %s max |difference| from the shipped kernel's %.3g\n", name,
           max_diff(ref, got, T * ld_gu));
  };
  shipped();
  check("U=1", [&] { unrolled(exp_::swiglu_backward_unrolled<1, false>, 1); });
  check("U=4 streaming", [&] { unrolled(exp_::swiglu_backward_unrolled<4, true>, 4); });
  report("U=1, loads first", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<1, false>, 1); }), mb);
  report("U=2", time_us([&] { unrolled(exp_::swiglu_backward_unrolled<2, false>, 2); }), mb);
  report("U=4", time_us([&] { unrolled(exp_::swiglu_backward_unrolled<4, false>, 4); }), mb);
  report("U=1 streaming loads", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<1, true>, 1); }), mb);
  report("U=2 streaming loads", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<2, true>, 2); }), mb);
  report("U=4 streaming loads", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<4, true>, 4); }), mb);
  // the backward, then d_gate | d_up read (the next kernel's bytes), in one timed run
  const double read_mb = 2.0 * T * C * 2 / 1e6;
  auto read = [&](bool reverse) {
    if (reverse)
      read_rows<true><<<sms * 8, 512>>>(ref, T, 2 * C / 8, ld_gu, sink);
    else
      read_rows<false><<<sms * 8, 512>>>(ref, T, 2 * C / 8, ld_gu, sink);
  };
  report("read of d_gate | d_up alone", time_us([&] { read(false); }), read_mb);
  report("shipped + read from the first row", time_us([&] { shipped(); read(false); }),
         mb + read_mb);
  report("shipped + read from the last row", time_us([&] { shipped(); read(true); }),
         mb + read_mb);
  report("U=2 streaming + read from the first row", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<2, true>, 2); read(false); }), mb + read_mb);
  report("U=2 streaming + read from the last row", time_us([&] {
    unrolled(exp_::swiglu_backward_unrolled<2, true>, 2); read(true); }), mb + read_mb);
  cudaFree(gu); cudaFree(dh); cudaFree(ref); cudaFree(got); cudaFree(sink);
  return 0;
}
