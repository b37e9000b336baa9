// The one-pass adapter gradients' finishing launch (csrc/kernels/skinny_grads.cu
// finish_kernel) alone at gate/up's LoRA 8B size (T=2048, N=28672, rank 32 in two 16-wide
// blocks, d_B stacked: runtime/cuda/stacked_blocks.py), its sums just written by float4
// atomics as the one-pass kernel leaves them. Variants: shipped; the four bf16 stores
// packed into one 8-byte store (checked: the shipped kernel's bits); the sums not zeroed
// (what the zeroing costs; not a correct finish); shipped with the sums in HBM.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/skinny_finish_variants.cu -o /tmp/finish && /tmp/finish
// Figures: benchmarks/kernels/results_skinny_finish_h100.txt.
#include "../../csrc/kernels/skinny_grads.cu"
#include "variants_harness.cuh"

#include <cstring>

namespace {

__global__ void touch(float* sum, int64_t n) {  // float4 atomics over every quad
  const int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (4 * q < n) atomicAdd(reinterpret_cast<float4*>(sum) + q, make_float4(1.f, 2.f, 3.f, 4.f));
}

__global__ void finish_packed(float* __restrict__ da32, float* __restrict__ db32,
                              __nv_bfloat16* __restrict__ d_a, __nv_bfloat16* __restrict__ d_b,
                              int64_t n_a, int64_t n_b, int rank, int64_t ld_a, float alpha,
                              modulec::SkinnyBlocks blocks, bool zero) {
  const int64_t quads_a = n_a / 4, quads = (n_a + n_b) / 4;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float* sum;
    __nv_bfloat16* out;
    if (q < quads_a) {
      const int64_t i = 4 * q;
      sum = da32 + i;
      out = d_a + (i / rank) * ld_a + i % rank;
    } else {
      const int64_t k = 4 * (q - quads_a), row = k / 16;
      sum = db32 + row * rank + 16 * modulec::block_of(blocks, row) + k % 16;
      out = d_b + k;
    }
    float4* at = reinterpret_cast<float4*>(sum);
    const float4 v = *at;
    if (zero) *at = make_float4(0.f, 0.f, 0.f, 0.f);
    __nv_bfloat162 lo = __floats2bfloat162_rn(alpha * v.x, alpha * v.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(alpha * v.z, alpha * v.w);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(out) = packed;
  }
}

}  // namespace

int main() {
  init_flush();
  const int64_t T = 2048, N = 28672, R = 32;
  float *da32, *db32;
  __nv_bfloat16 *d_a, *d_b;
  CK(cudaMalloc(&da32, T * R * 4));
  CK(cudaMalloc(&db32, N * R * 4));
  CK(cudaMalloc(&d_a, T * R * 2));
  CK(cudaMalloc(&d_b, N * 16 * 2));
  CK(cudaMemset(da32, 0, T * R * 4));
  CK(cudaMemset(db32, 0, N * R * 4));
  modulec::SkinnyBlocks blocks{};
  blocks.n = 2;
  blocks.end[0] = N / 2;
  blocks.end[1] = N;
  blocks.compact = true;
  const int64_t n_a = T * R, n_b = N * 16;
  const unsigned grid = static_cast<unsigned>((n_a + n_b + 1023) / 1024);
  auto touched = [&](auto f) {  // time f() right after the atomics wrote the sums
    std::vector<float> t;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 25; ++i) {
      flush();
      touch<<<(N * R / 4 + 255) / 256, 256>>>(db32, N * R);
      touch<<<(T * R / 4 + 255) / 256, 256>>>(da32, T * R);
      cudaEventRecord(e0);
      f();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      if (i >= 5) t.push_back(ms * 1000.f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  int dev;
  cudaGetDevice(&dev);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, dev);
  printf("%s: finishing launch, T %lld, N %lld, rank %lld blocked, d_B stacked\n", prop.name,
         (long long)T, (long long)N, (long long)R);
  // the packed stores give the shipped kernel's bits (the sums written alike before each)
  std::vector<__nv_bfloat16> shipped(N * 16), packed(N * 16);
  touch<<<(N * R / 4 + 255) / 256, 256>>>(db32, N * R);
  modulec::finish_kernel<<<grid, 256>>>(da32, db32, 0, 0, d_a, d_b, n_a, n_b, R, R, 2.f, blocks);
  CK(cudaMemcpy(shipped.data(), d_b, N * 16 * 2, cudaMemcpyDeviceToHost));
  touch<<<(N * R / 4 + 255) / 256, 256>>>(db32, N * R);
  finish_packed<<<grid, 256>>>(da32, db32, d_a, d_b, n_a, n_b, R, R, 2.f, blocks, true);
  CK(cudaMemcpy(packed.data(), d_b, N * 16 * 2, cudaMemcpyDeviceToHost));
  const bool same = memcmp(shipped.data(), packed.data(), N * 16 * 2) == 0;
  printf("packed stores give the shipped bits: %s\n", same ? "yes" : "NO");
  printf("shipped                     %6.2f us\n", touched([&] {
           modulec::finish_kernel<<<grid, 256>>>(da32, db32, 0, 0, d_a, d_b, n_a, n_b, R, R, 2.f, blocks);
         }));
  printf("packed stores               %6.2f us\n", touched([&] {
           finish_packed<<<grid, 256>>>(da32, db32, d_a, d_b, n_a, n_b, R, R, 2.f, blocks, true);
         }));
  printf("packed, sums not zeroed     %6.2f us\n", touched([&] {
           finish_packed<<<grid, 256>>>(da32, db32, d_a, d_b, n_a, n_b, R, R, 2.f, blocks, false);
         }));
  printf("shipped, from HBM (flushed) %6.2f us\n", time_us([&] {
           modulec::finish_kernel<<<grid, 256>>>(da32, db32, 0, 0, d_a, d_b, n_a, n_b, R, R, 2.f, blocks);
         }));
  return same ? 0 : 1;
}
