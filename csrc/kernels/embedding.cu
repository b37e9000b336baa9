// embedding backward (std/primitives/embedding.module): d_weight[v] = the sum of the d_y
// rows whose id is v, deterministic. The caller sorts the ids (stable: `order` lists the
// rows by id, each id's rows in their original order); a block per vocabulary row finds
// its run of the sorted ids by binary search and sums those rows in that order, in fp32,
// one column vector per thread. No atomics, so the same batch gives the same bits, and
// rows no token uses are written as zeros (no separate fill of the [V, D] buffer).
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t lower_bound(const int64_t* sorted, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (sorted[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <typename T, int VEC>
__global__ void embedding_backward_kernel(const T* __restrict__ d_y,
                                          const int64_t* __restrict__ sorted_ids,
                                          const int64_t* __restrict__ order,
                                          T* __restrict__ d_weight, int64_t n, int64_t D) {
  const int64_t v = blockIdx.x;
  __shared__ int64_t run[2];
  if (threadIdx.x == 0) {
    run[0] = lower_bound(sorted_ids, n, v);
    run[1] = lower_bound(sorted_ids, n, v + 1);
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < D / VEC; c += blockDim.x) {
    float acc[VEC] = {};
    for (int64_t i = run[0]; i < run[1]; ++i) {
      float a[VEC];
      load_vec<T, VEC>(d_y + order[i] * D, c, a);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += a[j];
    }
    store_vec<T, VEC>(d_weight + v * D, c, acc);
  }
}

template <typename T>
cudaError_t backward_typed(const void* d_y, const int64_t* sorted_ids, const int64_t* order,
                           void* d_weight, int64_t n, int64_t V, int64_t D,
                           cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T);
  auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(V), kThreads, 0, stream>>>(
        static_cast<const T*>(d_y), sorted_ids, order, static_cast<T*>(d_weight), n, D);
  };
  if (pick_vec<T>(D, {d_y, d_weight}) == wide)
    launch(embedding_backward_kernel<T, wide>);
  else
    launch(embedding_backward_kernel<T, 1>);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_embedding_backward(DType dt, const void* d_y, const int64_t* sorted_ids,
                                      const int64_t* order, void* d_weight, int64_t n,
                                      int64_t V, int64_t D, cudaStream_t stream) {
  if (V == 0 || D == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16>(d_y, sorted_ids, order, d_weight, n, V, D, stream);
  return backward_typed<float>(d_y, sorted_ids, order, d_weight, n, V, D, stream);
}

}  // namespace modulec
