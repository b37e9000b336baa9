// swiglu forward and backward (std/primitives/swiglu.module): y = silu(gate) * up,
// elementwise over two tensors of one shape. One thread per 16-byte vector; the last
// n % VEC elements are done one by one by the first threads.
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

// 1 / (1 + exp(-g)) with the precise expf, as the reference's sigmoid
__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__device__ __forceinline__ float swiglu_y(float g, float u) { return g * sigmoid(g) * u; }

// d_gate = d_y * up * silu'(g), silu'(g) = sigmoid(g) + silu(g) * sigmoid(-g);
// d_up = d_y * silu(g). sigmoid(-g) is computed, not 1 - sigmoid(g), as the reference.
__device__ __forceinline__ void swiglu_grad(float dy, float g, float u, float& d_gate,
                                            float& d_up) {
  const float s = sigmoid(g);
  const float silu = g * s;
  d_gate = dy * u * (s + silu * sigmoid(-g));
  d_up = dy * silu;
}

template <typename T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  if (i < nvec) {
    float g[VEC], u[VEC], o[VEC];
    load_vec<T, VEC>(gate, i, g);
    load_vec<T, VEC>(up, i, u);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = swiglu_y(g[j], u[j]);
    store_vec<T, VEC>(y, i, o);
  }
  const int64_t t = nvec * VEC + i;  // the scalar tail
  if (VEC > 1 && t < n) y[t] = from_float<T>(swiglu_y(to_float(gate[t]), to_float(up[t])));
}

template <typename T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ d_y, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ d_gate,
                                       T* __restrict__ d_up, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  if (i < nvec) {
    float dy[VEC], g[VEC], u[VEC], dg[VEC], du[VEC];
    load_vec<T, VEC>(d_y, i, dy);
    load_vec<T, VEC>(gate, i, g);
    load_vec<T, VEC>(up, i, u);
#pragma unroll
    for (int j = 0; j < VEC; ++j) swiglu_grad(dy[j], g[j], u[j], dg[j], du[j]);
    store_vec<T, VEC>(d_gate, i, dg);
    store_vec<T, VEC>(d_up, i, du);
  }
  const int64_t t = nvec * VEC + i;
  if (VEC > 1 && t < n) {
    float dg, du;
    swiglu_grad(to_float(d_y[t]), to_float(gate[t]), to_float(up[t]), dg, du);
    d_gate[t] = from_float<T>(dg);
    d_up[t] = from_float<T>(du);
  }
}

// enough threads for the vectors and for the tail
unsigned blocks_for(int64_t n, int vec) {
  const int64_t work = std::max<int64_t>(n / vec, n % vec);
  return static_cast<unsigned>((work + kThreads - 1) / kThreads);
}

template <typename T>
cudaError_t forward_typed(const void* gate, const void* up, void* y, int64_t n, cudaStream_t s) {
  constexpr int wide = 16 / sizeof(T);
  const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up);
  T* o = static_cast<T*>(y);
  // a vector path needs aligned bases only: the tail covers n % VEC
  if (pick_vec<T>(0, {gate, up, y}) == wide)
    swiglu_forward_kernel<T, wide><<<blocks_for(n, wide), kThreads, 0, s>>>(g, u, o, n);
  else
    swiglu_forward_kernel<T, 1><<<blocks_for(n, 1), kThreads, 0, s>>>(g, u, o, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* d_y, const void* gate, const void* up, void* d_gate,
                           void* d_up, int64_t n, cudaStream_t s) {
  constexpr int wide = 16 / sizeof(T);
  auto args = [&](auto kernel, int vec) {
    kernel<<<blocks_for(n, vec), kThreads, 0, s>>>(
        static_cast<const T*>(d_y), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(d_gate), static_cast<T*>(d_up), n);
  };
  if (pick_vec<T>(0, {d_y, gate, up, d_gate, d_up}) == wide)
    args(swiglu_backward_kernel<T, wide>, wide);
  else
    args(swiglu_backward_kernel<T, 1>, 1);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_swiglu_forward(DType dt, const void* gate, const void* up, void* y, int64_t n,
                                  cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (dt == DType::BF16) return forward_typed<__nv_bfloat16>(gate, up, y, n, stream);
  return forward_typed<float>(gate, up, y, n, stream);
}

cudaError_t launch_swiglu_backward(DType dt, const void* d_y, const void* gate, const void* up,
                                   void* d_gate, void* d_up, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16>(d_y, gate, up, d_gate, d_up, n, stream);
  return backward_typed<float>(d_y, gate, up, d_gate, d_up, n, stream);
}

}  // namespace modulec
