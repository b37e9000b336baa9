// gelu forward and backward (std/primitives/gelu.module): y = gelu(x), d_x = d_y * gelu'(x),
// in the tanh form (approximate, GPT-2's `gelu_new`) or the exact erf form (GPT-NeoX),
// with activations.cuh's formulas (the reference's, fp32). Contiguous tensors of n
// elements; one thread per VEC elements (16-byte accesses when every base is 16-byte
// aligned); the last n % VEC elements are done one by one by the thread that owns them.
// y may be x itself (the memory plan runs gelu in place: modulec/plan/from_graph.py
// IN_PLACE): each thread reads its elements before it writes them, so no __restrict__.
#include "activations.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC, int ACT>
__global__ void gelu_forward_kernel(const T* x, T* y, int64_t n) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= n) return;
  if (c + VEC <= n) {
    float a[VEC];
    load_vec<T, VEC>(x + c, 0, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] = act<ACT>(a[j]);
    store_vec<T, VEC>(y + c, 0, a);
  } else {
    for (int64_t j = c; j < n; ++j) y[j] = from_float<T>(act<ACT>(to_float(x[j])));
  }
}

template <typename T, int VEC, int ACT>
__global__ void gelu_backward_kernel(const T* d_y, const T* x,
                                     T* d_x, int64_t n) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= n) return;
  if (c + VEC <= n) {
    float g[VEC], a[VEC];
    load_vec<T, VEC>(d_y + c, 0, g);
    load_vec<T, VEC>(x + c, 0, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) g[j] *= act_grad<ACT>(a[j]);
    store_vec<T, VEC>(d_x + c, 0, g);
  } else {
    for (int64_t j = c; j < n; ++j)
      d_x[j] = from_float<T>(to_float(d_y[j]) * act_grad<ACT>(to_float(x[j])));
  }
}

unsigned blocks_for(int64_t n, int vec) {
  const int64_t threads = (n + vec - 1) / vec;
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

template <typename T, int ACT>
cudaError_t forward_typed(const void* x, void* y, int64_t n, cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
  if (pick_vec<T>(0, {x, y}) == wide)
    gelu_forward_kernel<T, wide, ACT><<<blocks_for(n, wide), kThreads, 0, st>>>(in, out, n);
  else
    gelu_forward_kernel<T, 1, ACT><<<blocks_for(n, 1), kThreads, 0, st>>>(in, out, n);
  return cudaGetLastError();
}

template <typename T, int ACT>
cudaError_t backward_typed(const void* d_y, const void* x, void* d_x, int64_t n,
                           cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  const T *g = static_cast<const T*>(d_y), *in = static_cast<const T*>(x);
  T* out = static_cast<T*>(d_x);
  if (pick_vec<T>(0, {d_y, x, d_x}) == wide)
    gelu_backward_kernel<T, wide, ACT><<<blocks_for(n, wide), kThreads, 0, st>>>(g, in, out, n);
  else
    gelu_backward_kernel<T, 1, ACT><<<blocks_for(n, 1), kThreads, 0, st>>>(g, in, out, n);
  return cudaGetLastError();
}

template <int ACT>
cudaError_t forward_act(DType dt, const void* x, void* y, int64_t n, cudaStream_t st) {
  if (dt == DType::BF16) return forward_typed<__nv_bfloat16, ACT>(x, y, n, st);
  return forward_typed<float, ACT>(x, y, n, st);
}

template <int ACT>
cudaError_t backward_act(DType dt, const void* d_y, const void* x, void* d_x, int64_t n,
                         cudaStream_t st) {
  if (dt == DType::BF16) return backward_typed<__nv_bfloat16, ACT>(d_y, x, d_x, n, st);
  return backward_typed<float, ACT>(d_y, x, d_x, n, st);
}

}  // namespace

cudaError_t launch_gelu_forward(DType dt, const void* x, void* y, int64_t n, bool approximate,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return approximate ? forward_act<kGeluTanh>(dt, x, y, n, stream)
                     : forward_act<kGeluErf>(dt, x, y, n, stream);
}

cudaError_t launch_gelu_backward(DType dt, const void* d_y, const void* x, void* d_x, int64_t n,
                                 bool approximate, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return approximate ? backward_act<kGeluTanh>(dt, d_y, x, d_x, n, stream)
                     : backward_act<kGeluErf>(dt, d_y, x, d_x, n, stream);
}

}  // namespace modulec
