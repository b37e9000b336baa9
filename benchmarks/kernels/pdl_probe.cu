// Programmatic dependent launch (PDL) in a captured graph, one H200: is it worth launching
// the step's own kernels with it? A chain of 200 kernel pairs (a ~5 us compute kernel on
// every multiprocessor, then a memory-bound copy) captured in one CUDA graph and replayed:
// without PDL, with only the copy launched with programmatic stream serialization
// (griddepcontrol.wait first), and with both so launched (the compute kernel also letting
// its dependents launch early). In the step the kernel before ours is mostly cuBLAS's or
// cuDNN's, which we do not launch, so "short kernel PDL" is the case that applies.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
//       benchmarks/kernels/pdl_probe.cu -o /tmp/pdl && /tmp/pdl
// Results: results_pdl_h200.txt; decisions.md "Captured steps: memset nodes as kernel nodes".
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ void wait_primary() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void let_dependents() {
  asm volatile("griddepcontrol.launch_dependents;");
}

__global__ void busy(float* x, int iters, bool pdl) {
  if (pdl) wait_primary();
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int i = 0; i < iters; ++i) v = v * 1.0000001f + 0.5f;
  if (pdl) let_dependents();
  x[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

__global__ void stream_copy(const float4* a, float4* b, int n, bool pdl) {
  if (pdl) wait_primary();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    b[i] = a[i];
  if (pdl) let_dependents();
}

template <typename K, typename... A>
void launch(K kernel, dim3 grid, dim3 block, cudaStream_t s, bool pdl, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid; cfg.blockDim = block; cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess) printf("launch: %s\n", cudaGetErrorString(e));
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* x; float4 *a, *b; const int n = 4 << 20;  // 64 MB each way
  cudaMalloc(&x, sms * 256 * 4); cudaMalloc(&a, n * 16); cudaMalloc(&b, n * 16);
  cudaMemset(x, 0, sms * 256 * 4); cudaMemset(a, 0, n * 16);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const int pairs = 200;
  const char* names[] = {"no PDL", "short kernel PDL", "both PDL"};
  for (int copy_n : {1 << 16, 1 << 20}) {
    for (int mode = 0; mode < 3; ++mode) {
      cudaGraph_t g; cudaGraphExec_t ge;
      cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
      for (int p = 0; p < pairs; ++p) {
        launch(busy, dim3(sms), dim3(256), s, mode == 2, x, 2000, mode == 2);
        launch(stream_copy, dim3(sms * 4), dim3(256), s, mode >= 1, (const float4*)a, b,
               copy_n, mode >= 1);
      }
      cudaStreamEndCapture(s, &g);
      if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) {
        printf("instantiate failed\n");
        return 1;
      }
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      for (int w = 0; w < 3; ++w) cudaGraphLaunch(ge, s);
      float best = 1e9;
      for (int r = 0; r < 10; ++r) {
        cudaEventRecord(e0, s); cudaGraphLaunch(ge, s); cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        best = ms < best ? ms : best;
      }
      printf("copy %8d float4  %-18s %.3f us a pair  (%s)\n", copy_n, names[mode],
             1000 * best / pairs, cudaGetErrorString(cudaGetLastError()));
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    }
  }
  return 0;
}
