// The cross-entropy kernel's time on LoRA 8B's logits (2048 x 128256 bf16) and TinyLlama's
// (x 32000), for two versions of csrc/kernels/cross_entropy.cu built alike (an A/B of a
// kernel change in one device call; the first loss printed must agree):
//   git show REV:csrc/kernels/cross_entropy.cu > /tmp/ce_old.cu   # the version to compare against
//   for f in /tmp/ce_old.cu $PWD/csrc/kernels/cross_entropy.cu; do
//     nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//       -DCE_FILE="\"$f\"" benchmarks/kernels/cross_entropy_ab.cu -o /tmp/ce_$(basename $f .cu)
//   done; /tmp/ce_ce_old old; /tmp/ce_cross_entropy new
#include CE_FILE
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_bf16.h>

__global__ void init(__nv_bfloat16* x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(((i * 2654435761u) % 2001) / 100.f - 10.f);
}

int main(int argc, char** argv) {
  for (int64_t V : {128256L, 32000L}) {
    const int64_t rows = 2048, n = rows * V;
    __nv_bfloat16 *x, *keep; int64_t* labels; float *scale, *losses;
    cudaMalloc(&x, n * 2); cudaMalloc(&keep, n * 2); cudaMalloc(&labels, rows * 8);
    cudaMalloc(&scale, 4); cudaMalloc(&losses, rows * 4);
    init<<<1024, 256>>>(keep, n);
    std::vector<int64_t> hl(rows); for (int i = 0; i < rows; ++i) hl[i] = (i * 7919) % V;
    cudaMemcpy(labels, hl.data(), rows * 8, cudaMemcpyHostToDevice);
    float one = 1.f / rows; cudaMemcpy(scale, &one, 4, cudaMemcpyHostToDevice);
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> t;
    for (int it = 0; it < 22; ++it) {
      cudaMemcpy(x, keep, n * 2, cudaMemcpyDeviceToDevice);
      cudaEventRecord(a);
      modulec::launch_cross_entropy(modulec::DType::BF16, x, labels, scale, losses, rows, V, -100, 0);
      cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 2) t.push_back(ms * 1000);
    }
    std::sort(t.begin(), t.end());
    float l0; cudaMemcpy(&l0, losses, 4, cudaMemcpyDeviceToHost);
    printf("%s V=%ld: median %.1f us (min %.1f), %.2f TB/s r+w, loss[0] %.6f (%s)\n", argv[1], V, t[t.size()/2], t[0],
           2.0 * n * 2 / (t[t.size()/2] * 1e-6) / 1e12, l0, cudaGetErrorString(cudaGetLastError()));
    cudaFree(x); cudaFree(keep); cudaFree(labels); cudaFree(scale); cudaFree(losses);
  }
}
