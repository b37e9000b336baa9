// What limits the frozen-weight RMSNorm backward (csrc/kernels/norms.cu, d_x alone, fused
// d_residual: LoRA's norms) at LoRA 8B's shape (2048 x 4096 bf16): the shipped kernel's
// row cache (vectors a thread keeps, so threads a row) against other depths, beside the
// forward (as many bytes) and a plain stream of the same bytes (3 read, 1 written); each
// timed alone with L2 flushed, the variants' d_x compared with the shipped one's. On a
// GPU machine:
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
}  // namespace exp_

// the figures in docs/decisions.md were taken with 25 runs after 3
template <class F>
static float timed(F f) { return time_us(f, 25, 3); }

static bf16* upload(size_t n, unsigned seed) {
  std::vector<bf16> h(n);
  fill(h, seed);
  bf16* d;
  CK(cudaMalloc(&d, n * 2));
  cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice);
  return d;
}

static double max_diff(const bf16* a, const bf16* b, size_t n) {
  std::vector<bf16> ha(n), hb(n);
  cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost);
  double m = 0;
  for (size_t i = 0; i < n; ++i)
    m = std::max(m, (double)std::fabs(__bfloat162float(ha[i]) - __bfloat162float(hb[i])));
  return m;
}

template <int CACHE>
static void launch(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                   const bf16* dres, bf16* dx, int64_t rows, int64_t C) {
  const modulec::RowConfig cfg = modulec::row_config(C / 8, CACHE);
  const int64_t per_block = cfg.rows_per_block();
  modulec::rms_backward_kernel<bf16, 8, false, CACHE>
      <<<(unsigned)((rows + per_block - 1) / per_block), cfg.threads>>>(
          dy, x, w, 0.f, rstd, dres, dx, nullptr, rows, C, cfg.group, C, C);
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
    report("backward cache 2 (shipped)", timed([&] { launch<2>(dy, x, w, rstd, dres, dx, rows, C); }));
    char buf[96];
    launch<1>(dy, x, w, rstd, dres, dx2, rows, C);
    snprintf(buf, sizeof buf, "backward cache 1 (diff %.1e)", max_diff(dx, dx2, n));
    report(buf, timed([&] { launch<1>(dy, x, w, rstd, dres, dx2, rows, C); }));
    launch<4>(dy, x, w, rstd, dres, dx2, rows, C);
    snprintf(buf, sizeof buf, "backward cache 4 (diff %.1e)", max_diff(dx, dx2, n));
    report(buf, timed([&] { launch<4>(dy, x, w, rstd, dres, dx2, rows, C); }));
    cudaFree(dy); cudaFree(x); cudaFree(dres); cudaFree(w); cudaFree(dx); cudaFree(dx2);
    cudaFree(y); cudaFree(res); cudaFree(rstd);
  }
  return 0;
}
