// moe_permute / moe_unpermute (std/primitives/moe_permute.module, moe_unpermute.module) as
// gathers: every output row is written by one block, from the rows it reads in a fixed
// order (an assignment's top-k slots in k order), so no atomics and the same bits on every
// run. `scatter` (scatter_indices) lists, per permuted row j, its assignment a = t * top_k
// + k; `pos` is its inverse (the permuted row of assignment a). fp32 arithmetic, I/O in
// bf16 or fp32, router weights in fp32.
#include <type_traits>

#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 128;

// permuted[j] = x[scatter[j] / top_k]
template <typename T, int VEC>
__global__ void gather_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ scatter,
                                   int top_k, T* __restrict__ out, int64_t C) {
  const int64_t j = blockIdx.x, t = scatter[j] / top_k;
  for (int64_t c = threadIdx.x; c < C / VEC; c += blockDim.x) {
    float a[VEC];
    load_vec<T, VEC>(x + t * C, c, a);
    store_vec<T, VEC>(out + j * C, c, a);
  }
}

// out[t] = sum over k of w[t * top_k + k] * rows[pos[t * top_k + k]] (w null: unit weights)
template <typename T, int VEC>
__global__ void combine_kernel(const T* __restrict__ rows, const float* __restrict__ w,
                               const int32_t* __restrict__ pos, int top_k, T* __restrict__ out,
                               int64_t C) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C / VEC; c += blockDim.x) {
    float acc[VEC] = {};
    for (int k = 0; k < top_k; ++k) {
      const int64_t a = t * top_k + k;
      const float s = w ? w[a] : 1.f;
      float r[VEC];
      load_vec<T, VEC>(rows + static_cast<int64_t>(pos[a]) * C, c, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += s * r[i];
    }
    store_vec<T, VEC>(out + t * C, c, acc);
  }
}

// The combine's backward, a block per permuted row j (assignment a, token t):
// d_rows[j] = w[a] * d_out[t]; d_w[a] = d_out[t] . rows[j]
template <typename T, int VEC>
__global__ void combine_backward_kernel(const T* __restrict__ d_out, const T* __restrict__ rows,
                                        const float* __restrict__ w,
                                        const int32_t* __restrict__ scatter, int top_k,
                                        T* __restrict__ d_rows, float* __restrict__ d_w,
                                        int64_t C) {
  const int64_t j = blockIdx.x, a = scatter[j], t = a / top_k;
  const float s = w[a];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < C / VEC; c += blockDim.x) {
    float d[VEC], r[VEC], o[VEC];
    load_vec<T, VEC>(d_out + t * C, c, d);
    load_vec<T, VEC>(rows + j * C, c, r);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o[i] = s * d[i];
      dot += d[i] * r[i];
    }
    store_vec<T, VEC>(d_rows + j * C, c, o);
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) d_w[a] = dot;
}

template <typename T, typename Launch>
cudaError_t dispatch(int64_t C, std::initializer_list<const void*> ptrs, Launch launch) {
  constexpr int wide = 16 / sizeof(T);
  if (pick_vec<T>(C, ptrs) == wide)
    launch(std::integral_constant<int, wide>{});
  else
    launch(std::integral_constant<int, 1>{});
  return cudaGetLastError();
}

template <typename T>
cudaError_t gather_typed(const void* x, const int32_t* scatter, int top_k, void* out, int64_t M,
                         int64_t C, cudaStream_t stream) {
  return dispatch<T>(C, {x, out}, [&](auto vec) {
    gather_rows_kernel<T, decltype(vec)::value><<<static_cast<unsigned>(M), kThreads, 0, stream>>>(
        static_cast<const T*>(x), scatter, top_k, static_cast<T*>(out), C);
  });
}

template <typename T>
cudaError_t combine_typed(const void* rows, const float* w, const int32_t* pos, int top_k,
                          void* out, int64_t N, int64_t C, cudaStream_t stream) {
  return dispatch<T>(C, {rows, out}, [&](auto vec) {
    combine_kernel<T, decltype(vec)::value><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<const T*>(rows), w, pos, top_k, static_cast<T*>(out), C);
  });
}

template <typename T>
cudaError_t backward_typed(const void* d_out, const void* rows, const float* w,
                           const int32_t* scatter, int top_k, void* d_rows, float* d_w,
                           int64_t M, int64_t C, cudaStream_t stream) {
  return dispatch<T>(C, {d_out, rows, d_rows}, [&](auto vec) {
    combine_backward_kernel<T, decltype(vec)::value>
        <<<static_cast<unsigned>(M), kThreads, 0, stream>>>(
            static_cast<const T*>(d_out), static_cast<const T*>(rows), w, scatter, top_k,
            static_cast<T*>(d_rows), d_w, C);
  });
}

}  // namespace

cudaError_t launch_moe_gather_rows(DType dt, const void* x, const int32_t* scatter, int top_k,
                                   void* out, int64_t M, int64_t C, cudaStream_t stream) {
  if (M == 0 || C == 0) return cudaSuccess;
  if (dt == DType::BF16) return gather_typed<__nv_bfloat16>(x, scatter, top_k, out, M, C, stream);
  return gather_typed<float>(x, scatter, top_k, out, M, C, stream);
}

cudaError_t launch_moe_combine(DType dt, const void* rows, const float* weights,
                               const int32_t* pos, int top_k, void* out, int64_t N, int64_t C,
                               cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return combine_typed<__nv_bfloat16>(rows, weights, pos, top_k, out, N, C, stream);
  return combine_typed<float>(rows, weights, pos, top_k, out, N, C, stream);
}

cudaError_t launch_moe_combine_backward(DType dt, const void* d_out, const void* rows,
                                        const float* weights, const int32_t* scatter, int top_k,
                                        void* d_rows, float* d_weights, int64_t M, int64_t C,
                                        cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16>(d_out, rows, weights, scatter, top_k, d_rows,
                                         d_weights, M, C, stream);
  return backward_typed<float>(d_out, rows, weights, scatter, top_k, d_rows, d_weights, M, C,
                               stream);
}

}  // namespace modulec
