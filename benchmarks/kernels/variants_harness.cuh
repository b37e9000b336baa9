// What the standalone kernel-variant harnesses (skinny_grads_variants.cu,
// rms_backward_variants.cu, swiglu_lora_variants.cu) share: a checked CUDA call, the L2
// flushed before each timed run (a 256 MB memset: the operands come from HBM, as in a
// step), the median of timed runs after warm-up ones, reproducible bf16 inputs (on the host
// or uploaded), bf16 results brought back, the largest difference of two bf16 results,
// the largest error of fp32 results against a reference's, and a kernel that only reads
// (the least a kernel reading those bytes costs). Call init_flush() first.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

static char* flush_buf;
static void init_flush() { CK(cudaMalloc(&flush_buf, 256 << 20)); }
static void flush() { cudaMemsetAsync(flush_buf, 0, 256 << 20); }

// median microseconds of `iters` runs of f(), each after an L2 flush, `warmup` runs first
template <class F>
static float time_us(F f, int iters = 15, int warmup = 2) {
  std::vector<float> t;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int i = 0; i < iters + warmup; ++i) {
    flush();
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    if (i >= warmup) t.push_back(ms * 1000.f);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGetLastError());
  return t[t.size() / 2];
}

// values in [-0.5, 0.5) from a linear congruential sequence: the same on every run
static void fill(std::vector<__nv_bfloat16>& v, unsigned seed) {
  for (size_t i = 0; i < v.size(); ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = __float2bfloat16(((seed >> 9) & 0xffff) / 65536.f - 0.5f);
  }
}

// max |got - ref| over max |ref| of n fp32 values on the device
static double max_rel(const float* ref_d, const float* got_d, size_t n) {
  std::vector<float> r(n), g(n);
  CK(cudaMemcpy(r.data(), ref_d, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g.data(), got_d, n * 4, cudaMemcpyDeviceToHost));
  double scale = 0, err = 0;
  for (size_t i = 0; i < n; ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(r[i])));
    err = std::max(err, static_cast<double>(std::fabs(r[i] - g[i])));
  }
  return err / (scale + 1e-30);
}

// n reproducible bf16 values (fill's, times `scale`) in a new device buffer
static __nv_bfloat16* upload(size_t n, unsigned seed, float scale = 1.f) {
  std::vector<__nv_bfloat16> h(n);
  fill(h, seed);
  if (scale != 1.f)
    for (auto& v : h) v = __float2bfloat16(__bfloat162float(v) * scale);
  __nv_bfloat16* d;
  CK(cudaMalloc(&d, n * 2));
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

static std::vector<__nv_bfloat16> download(const __nv_bfloat16* d, size_t n) {
  std::vector<__nv_bfloat16> h(n);
  CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

// max |a - b| of n bf16 values on the device (0: the same values)
static double max_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n) {
  const auto ha = download(a, n), hb = download(b, n);
  double m = 0;
  for (size_t i = 0; i < n; ++i)
    m = std::max(m, (double)std::fabs(__bfloat162float(ha[i]) - __bfloat162float(hb[i])));
  return m;
}

// Reads rows x vecs_row 16-byte pieces of bf16 rows `ld` elements apart, a thread a piece a
// step, from the first row or (REVERSE) from the last; an xor of everything read keeps the
// loads alive. A contiguous buffer of n pieces: rows 1, vecs_row n.
template <bool REVERSE>
__global__ void read_rows(const __nv_bfloat16* p, int64_t rows, int64_t vecs_row, int64_t ld,
                          float* sink) {
  const int64_t total = rows * vecs_row;
  uint32_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = REVERSE ? total - 1 - i : i;
    const int64_t r = j / vecs_row, c = (j - r * vecs_row) * 8;
    const uint4 v = *reinterpret_cast<const uint4*>(p + r * ld + c);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = 1.f;
}
