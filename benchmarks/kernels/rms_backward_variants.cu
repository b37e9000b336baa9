// What limits the frozen-weight RMSNorm backward (csrc/kernels/norms.cu, d_x alone, fused
// d_residual: LoRA's norms) at LoRA 8B's shape (2048 x 4096 bf16): the one-row-a-block
// kernel's row cache (vectors a thread keeps, so threads a row) at several depths, beside
// the forward (as many bytes) and a plain stream of the same bytes (3 read, 1 written);
// each timed alone with L2 flushed, d_x compared with the cache-2 kernel's; then the row
// cache kept packed (bf16 as loaded) with registers bounded for more blocks a
// multiprocessor, and the shipped dispatch, which at 4096 columns runs the rows pipelined
// (a persistent grid whose blocks load their next row before the current row's sum),
// apart and in place (d_x over d_residual_out). Figures:
// results_rms_backward_h100.txt, docs/decisions.md "RMSNorm backward of a frozen weight".
// On a GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/rms_backward_variants.cu csrc/kernels/fp8_amax.cu -o /tmp/rms_variants && \
//     /tmp/rms_variants
#include "../../csrc/kernels/norms.cu"
#include "variants_harness.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

using bf16 = __nv_bfloat16;

namespace exp_ {
// d_x = d_y + x + d_res, one 16-byte vector a thread: the bytes of the backward, no row sum
__global__ void stream3(const uint4* a, const uint4* b, const uint4* c, uint4* out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    uint4 x = a[i], y = b[i], z = c[i];
    out[i] = make_uint4(x.x ^ y.x ^ z.x, x.y ^ y.y ^ z.y, x.z ^ y.z ^ z.z, x.w ^ y.w ^ z.w);
  }
}

__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return u;
}

// d_x of 8 columns as the shipped store_dx computes it: r (g w - (x r) mean_gn) + d_res
__device__ __forceinline__ uint4 dx8(const uint4& xr, const uint4& gr, const uint4& dr,
                                     const bf16* weight, int64_t i, float r, float mean_gn) {
  float a[8], g[8], d[8], w[8], o[8];
  unpack8(xr, a);
  unpack8(gr, g);
  unpack8(dr, d);
  modulec::load_scale<bf16, 8>(weight, i, 0.f, w);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float n = a[j] * r;
    o[j] = r * (g[j] * w[j] - n * mean_gn);
    o[j] += d[j];
  }
  return pack8(o);
}

// The frozen backward with its cached row vectors kept as loaded (8 bf16 in a uint4: 4
// registers, not 8 floats) and converted where used: fewer registers a thread, so more
// rows in flight on a multiprocessor. One row a group; d_res and d_x may be one buffer.
template <int CACHE, int MIN_BLOCKS = 1>
__global__ void __launch_bounds__(256, MIN_BLOCKS)
rms_backward_packed(const bf16* __restrict__ d_y, const bf16* __restrict__ x,
                    const bf16* __restrict__ weight, const float* __restrict__ rstd,
                    const bf16* d_res, bf16* d_x, int64_t rows, int64_t C, int group) {
  const int64_t nvec = C / 8;
  const int lane = threadIdx.x % group;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) +
                      threadIdx.x / group;
  const bool valid = row < rows;
  const int64_t n = valid ? nvec : 0, off = valid ? row * C : 0;
  const uint4* xs = reinterpret_cast<const uint4*>(x + off);
  const uint4* gs = reinterpret_cast<const uint4*>(d_y + off);
  const uint4* ds = reinterpret_cast<const uint4*>(d_res + off);
  uint4* out = reinterpret_cast<uint4*>(d_x + off);
  const float r = valid ? rstd[row] : 0.f;
  uint4 xr[CACHE], gr[CACHE], dr[CACHE];
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < n) {
      xr[k] = xs[i];
      gr[k] = gs[i];
      dr[k] = ds[i];
      float a[8], g[8], w[8];
      unpack8(xr[k], a);
      unpack8(gr[k], g);
      modulec::load_scale<bf16, 8>(weight, i, 0.f, w);
      dot += modulec::dot_gn<8>(g, a, w, r);
    }
  }
  for (int64_t i = lane + CACHE * static_cast<int64_t>(group); i < n; i += group) {
    float a[8], g[8], w[8];
    unpack8(xs[i], a);
    unpack8(gs[i], g);
    modulec::load_scale<bf16, 8>(weight, i, 0.f, w);
    dot += modulec::dot_gn<8>(g, a, w, r);
  }
  const float mean_gn = modulec::group_sum(dot, group) / static_cast<float>(C);
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * group;
    if (i < n) out[i] = dx8(xr[k], gr[k], dr[k], weight, i, r, mean_gn);
  }
  for (int64_t i = lane + CACHE * static_cast<int64_t>(group); i < n; i += group)
    out[i] = dx8(xs[i], gs[i], ds[i], weight, i, r, mean_gn);
}

}  // namespace exp_

// the figures in docs/decisions.md were taken with 25 runs after 3
template <class F>
static float timed(F f) { return time_us(f, 25, 3); }

template <int CACHE>
static void launch(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                   const bf16* dres, bf16* dx, int64_t rows, int64_t C) {
  const modulec::RowConfig cfg = modulec::row_config(C / 8, CACHE);
  const int64_t per_block = cfg.rows_per_block();
  modulec::rms_backward_kernel<bf16, 8, false, CACHE>
      <<<(unsigned)((rows + per_block - 1) / per_block), cfg.threads>>>(
          dy, x, w, 0.f, rstd, dres, dx, nullptr, rows, C, cfg.group, C, C);
}

template <int CACHE, int MIN_BLOCKS = 1>
static void launch_packed(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                          const bf16* dres, bf16* dx, int64_t rows, int64_t C) {
  const modulec::RowConfig cfg = modulec::row_config(C / 8, CACHE);
  const int threads = 256, per_block = threads / cfg.group;
  exp_::rms_backward_packed<CACHE, MIN_BLOCKS>
      <<<(unsigned)((rows + per_block - 1) / per_block), threads>>>(
          dy, x, w, rstd, dres, dx, rows, C, cfg.group);
}

// registers a thread and blocks a multiprocessor of `kernel` at `threads` a block
template <class K>
static void occupancy(const char* what, K kernel, int threads) {
  cudaFuncAttributes a;
  cudaFuncGetAttributes(&a, kernel);
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0);
  printf("  %-34s %3d registers, %d blocks of %d a multiprocessor, %d bytes spilled\n", what,
         a.numRegs, blocks, threads, (int)a.localSizeBytes);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  init_flush();
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
  printf("%s, %d SMs\n", p.name, sms);
  for (int64_t rows : {2048, 8192}) {
    const int64_t C = 4096, n = rows * C;
    bf16 *dy = upload(n, 1), *x = upload(n, 2), *dres = upload(n, 3), *w = upload(C, 4);
    bf16 *dx, *dx2, *y, *res;
    float* rstd;
    CK(cudaMalloc(&dx, n * 2)); CK(cudaMalloc(&dx2, n * 2));
    CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&res, n * 2));
    CK(cudaMalloc(&rstd, rows * 4));
    const double mb = 4.0 * n * 2 / 1e6;
    auto report = [&](const char* what, float us) {
      printf("rows %-5ld %-34s %7.1f us %5.2f TB/s\n", (long)rows, what, us, mb / us);
    };
    report("forward (fused residual)", timed([&] {
      modulec::launch_rmsnorm_forward(modulec::DType::BF16, x, dres, w, res, y, rstd, rows, C,
                                      1e-5f, 0.f, 0, C); }));
    report("stream: 3 read, 1 written", timed([&] {
      exp_::stream3<<<sms * 8, 512>>>((const uint4*)dy, (const uint4*)x, (const uint4*)dres,
                                      (uint4*)dx2, n / 8); }));
    launch<2>(dy, x, w, rstd, dres, dx, rows, C);
    report("one row a block, cache 2", timed([&] { launch<2>(dy, x, w, rstd, dres, dx, rows, C); }));
    char buf[96];
    launch<1>(dy, x, w, rstd, dres, dx2, rows, C);
    snprintf(buf, sizeof buf, "backward cache 1 (diff %.1e)", max_diff(dx, dx2, n));
    report(buf, timed([&] { launch<1>(dy, x, w, rstd, dres, dx2, rows, C); }));
    launch<4>(dy, x, w, rstd, dres, dx2, rows, C);
    snprintf(buf, sizeof buf, "backward cache 4 (diff %.1e)", max_diff(dx, dx2, n));
    report(buf, timed([&] { launch<4>(dy, x, w, rstd, dres, dx2, rows, C); }));
    // the packed cache (session 21): the shipped kernel's bits; registers bounded for
    // 1-4 blocks of 256 a multiprocessor (more rows in flight)
    auto packed = [&](const char* what, auto run) {
      run();
      snprintf(buf, sizeof buf, "%s (diff %.1e)", what, max_diff(dx, dx2, n));
      report(buf, timed(run));
    };
    packed("packed cache 2", [&] { launch_packed<2>(dy, x, w, rstd, dres, dx2, rows, C); });
    packed("packed cache 2, 3 blocks", [&] {
      launch_packed<2, 3>(dy, x, w, rstd, dres, dx2, rows, C); });
    packed("packed cache 2, 4 blocks", [&] {
      launch_packed<2, 4>(dy, x, w, rstd, dres, dx2, rows, C); });
    packed("packed cache 4, 2 blocks", [&] {
      launch_packed<4, 2>(dy, x, w, rstd, dres, dx2, rows, C); });
    // the shipped dispatch: at 4096 columns a frozen weight's d_x runs the rows pipelined
    // (norms.cu rms_backward_pipelined_kernel: a persistent grid of 2 blocks of 256 a
    // multiprocessor, each loading its next row before the current row's sum)
    packed("shipped: rows pipelined", [&] {
      modulec::launch_rmsnorm_backward(modulec::DType::BF16, dy, x, w, 0.f, rstd, dres, dx2,
                                       nullptr, nullptr, rows, C, 0, C, C); });
    // in place, as the step runs it (d_x written over d_residual_out): the shipped dispatch
    CK(cudaMemcpy(dx2, dres, n * 2, cudaMemcpyDeviceToDevice));
    modulec::launch_rmsnorm_backward(modulec::DType::BF16, dy, x, w, 0.f, rstd, dx2, dx2,
                                     nullptr, nullptr, rows, C, 0, C, C);
    snprintf(buf, sizeof buf, "shipped, in place: diff %.1e", max_diff(dx, dx2, n));
    printf("rows %-5ld %s\n", (long)rows, buf);
    if (rows == 2048) {
      occupancy("one row a block, cache 2", modulec::rms_backward_kernel<bf16, 8, false, 2>, 256);
      occupancy("packed cache 2", exp_::rms_backward_packed<2>, 256);
      occupancy("packed cache 2, 3 blocks", exp_::rms_backward_packed<2, 3>, 256);
      occupancy("packed cache 2, 4 blocks", exp_::rms_backward_packed<2, 4>, 256);
      occupancy("packed cache 4, 2 blocks", exp_::rms_backward_packed<4, 2>, 256);
      occupancy("shipped: rows pipelined",
                modulec::rms_backward_pipelined_kernel<bf16, 8, true>, 256);
    }
    cudaFree(dy); cudaFree(x); cudaFree(dres); cudaFree(w); cudaFree(dx); cudaFree(dx2);
    cudaFree(y); cudaFree(res); cudaFree(rstd);
  }
  return 0;
}
