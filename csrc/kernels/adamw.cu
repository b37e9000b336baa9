// AdamW on fp32 master weights with fp32 moments, reading bf16 (or fp32) gradients and
// writing the bf16 compute copy in the same pass, so that a training step keeps no fp32
// gradient buffers and needs no separate cast of the weights. The arithmetic is
// torch.optim.AdamW's (fused and foreach agree on it):
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = b2 * v + (1 - b2) * g * g
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The step t is read from device memory, so a captured CUDA graph stays right on replay.
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

struct AdamW {
  float lr, beta1, beta2, eps, wd;
};

template <typename G, int VEC>
__global__ void adamw_kernel(float* __restrict__ p, const G* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v,
                             __nv_bfloat16* __restrict__ c, const float* __restrict__ step,
                             int64_t n, AdamW h) {
  const float t = *step;
  const float bc1 = 1.f - powf(h.beta1, t), bc2 = 1.f - powf(h.beta2, t);
  const float step_size = h.lr / bc1, bc2_sqrt = sqrtf(bc2), decay = 1.f - h.lr * h.wd;
  const int64_t nvec = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += stride) {
    float pv[VEC], gv[VEC], mv[VEC], vv[VEC];
    load_vec<float, VEC>(p, i, pv);
    load_vec<G, VEC>(g, i, gv);
    load_vec<float, VEC>(m, i, mv);
    load_vec<float, VEC>(v, i, vv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      pv[j] *= decay;
      mv[j] += (1.f - h.beta1) * (gv[j] - mv[j]);
      vv[j] = h.beta2 * vv[j] + (1.f - h.beta2) * gv[j] * gv[j];
      const float denom = sqrtf(vv[j]) / bc2_sqrt + h.eps;
      pv[j] -= step_size * mv[j] / denom;
    }
    store_vec<float, VEC>(p, i, pv);
    store_vec<float, VEC>(m, i, mv);
    store_vec<float, VEC>(v, i, vv);
    if (c) store_vec<__nv_bfloat16, VEC>(c, i, pv);
  }
  // the scalar tail (n % VEC elements), by the first threads
  const int64_t tail = nvec * VEC + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (VEC > 1 && tail < n) {
    float pv = p[tail] * decay, gv = to_float(g[tail]), mv = m[tail], vv = v[tail];
    mv += (1.f - h.beta1) * (gv - mv);
    vv = h.beta2 * vv + (1.f - h.beta2) * gv * gv;
    pv -= step_size * mv / (sqrtf(vv) / bc2_sqrt + h.eps);
    p[tail] = pv;
    m[tail] = mv;
    v[tail] = vv;
    if (c) c[tail] = __float2bfloat16_rn(pv);
  }
}

template <typename G>
cudaError_t adamw_typed(float* p, const void* g, float* m, float* v, void* c, const float* step,
                        int64_t n, const AdamW& h, cudaStream_t s) {
  const G* gp = static_cast<const G*>(g);
  auto* cp = static_cast<__nv_bfloat16*>(c);
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * 8;
  auto blocks = [&](int vec) {
    const int64_t work = std::max<int64_t>(n / vec, n % vec);
    return static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, max_blocks));
  };
  // 4 elements a thread: 16-byte fp32 accesses (8 bytes of a bf16 gradient / copy)
  bool vec = true;
  for (const void* ptr : {static_cast<const void*>(p), g, static_cast<const void*>(m),
                          static_cast<const void*>(v)})
    vec = vec && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  vec = vec && (!c || reinterpret_cast<uintptr_t>(c) % 8 == 0);
  if (vec)
    adamw_kernel<G, 4><<<blocks(4), kThreads, 0, s>>>(p, gp, m, v, cp, step, n, h);
  else
    adamw_kernel<G, 1><<<blocks(1), kThreads, 0, s>>>(p, gp, m, v, cp, step, n, h);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adamw(DType grad_dt, float* param, const void* grad, float* exp_avg,
                         float* exp_avg_sq, void* compute_bf16, const float* step, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const AdamW h{lr, beta1, beta2, eps, weight_decay};
  if (grad_dt == DType::BF16)
    return adamw_typed<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, compute_bf16, step, n,
                                      h, stream);
  return adamw_typed<float>(param, grad, exp_avg, exp_avg_sq, compute_bf16, step, n, h, stream);
}

}  // namespace modulec
