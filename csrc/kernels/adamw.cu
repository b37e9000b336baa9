// AdamW on fp32 master weights with fp32 moments, reading bf16 (or fp32) gradients and
// writing the bf16 compute copy in the same pass, so that a training step keeps no fp32
// gradient buffers and needs no separate cast of the weights. The arithmetic is
// torch.optim.AdamW's (fused and foreach agree on it):
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = b2 * v + (1 - b2) * g * g
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The step t is read from device memory, so a captured CUDA graph stays right on replay.
// So are, when given, the learning rate (`lr_now`: the rate is lr * *lr_now, so `lr` is
// then a per-parameter factor and a schedule updates one device float between replays)
// and a factor every gradient is multiplied by first (`grad_scale`: global gradient-norm
// clipping's min(1, max_norm / (norm + eps)), computed on the device).
//
// Two ways to hold the master (the kernel is one template over them):
// - FloatMaster: an fp32 array, plus the bf16 compute copy written when given (2 bytes a
//   parameter more than the master's 4);
// - SplitMaster: the fp32 value as two 16-bit halves, so the compute copy *is* part of
//   the master (4 bytes a parameter in all): `hi`, the bf16 compute copy, is the value's
//   top 16 bits rounded half away from zero, and `lo` (int16) what rounding took off:
//   bits(p) = bits(hi) * 2^16 + lo, exactly. Rounding up the magnitude is adding one to
//   its top 16 bits, which carries into the exponent as bf16 rounding does, and keeps
//   lo in [-2^15, 2^15). hi differs from round-to-nearest-even only on exact ties.
//
// With `norm_sq` given (a device double), the kernel also adds the sum of the gradient's
// squares to it (before `grad_scale`: the norm clipping reads is taken first, elsewhere),
// so the step's gradient norm costs no pass of its own over the gradients (a reduction,
// a square and an add a parameter before: ~1.4 ms and ~270 launches a TinyLlama step).
// Each block sums its threads' fp32 sums in a fixed order and adds that to the double
// atomically: only the blocks' order varies, and in fp64 the sum of a few thousand fp32
// partials rounds to the same fp32 norm whatever that order.
//
// The list form (`launch_adamw_split_list`) updates up to kAdamWListMax split masters in
// one launch (its blocks dealt to them in order), each with its own rate factor and weight
// decay: LoRA's adapters are 14 small tensors a layer, whose one launch each cost more than
// their update (448 launches a step on Llama-3-8B).
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

struct AdamW {
  float lr, beta1, beta2, eps, wd;
  const float* lr_now;      // null: lr as given
  const float* grad_scale;  // null: 1
  double* norm_sq;          // null: no squares summed
};

struct FloatMaster {
  float* p;
  __nv_bfloat16* c;  // the compute copy, or null

  template <int VEC>
  __device__ void load(int64_t i, float (&out)[VEC]) const { load_vec<float, VEC>(p, i, out); }
  template <int VEC>
  __device__ void store(int64_t i, const float (&in)[VEC]) const {
    store_vec<float, VEC>(p, i, in);
    if (c) store_vec<__nv_bfloat16, VEC>(c, i, in);
  }
  bool aligned(int vec) const {
    return reinterpret_cast<uintptr_t>(p) % (4 * vec) == 0 &&
           (!c || reinterpret_cast<uintptr_t>(c) % (2 * vec) == 0);
  }
};

struct SplitMaster {
  uint16_t* hi;
  int16_t* lo;

  __device__ static float join(uint16_t h, int16_t l) {
    return __uint_as_float((static_cast<uint32_t>(h) << 16) + static_cast<uint32_t>(
                                                                   static_cast<int32_t>(l)));
  }
  __device__ static void split(float value, uint16_t& h, int16_t& l) {
    const uint32_t bits = __float_as_uint(value);
    const uint32_t low = bits & 0xFFFFu, up = low >= 0x8000u;
    h = static_cast<uint16_t>((bits >> 16) + up);
    l = static_cast<int16_t>(static_cast<int32_t>(low) - static_cast<int32_t>(up << 16));
  }
  template <int VEC>
  __device__ void load(int64_t i, float (&out)[VEC]) const {
    const Vec<uint16_t, VEC> h = reinterpret_cast<const Vec<uint16_t, VEC>*>(hi)[i];
    const Vec<int16_t, VEC> l = reinterpret_cast<const Vec<int16_t, VEC>*>(lo)[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = join(h.v[j], l.v[j]);
  }
  template <int VEC>
  __device__ void store(int64_t i, const float (&in)[VEC]) const {
    Vec<uint16_t, VEC> h;
    Vec<int16_t, VEC> l;
#pragma unroll
    for (int j = 0; j < VEC; ++j) split(in[j], h.v[j], l.v[j]);
    reinterpret_cast<Vec<uint16_t, VEC>*>(hi)[i] = h;
    reinterpret_cast<Vec<int16_t, VEC>*>(lo)[i] = l;
  }
  bool aligned(int vec) const {
    return reinterpret_cast<uintptr_t>(hi) % (2 * vec) == 0 &&
           reinterpret_cast<uintptr_t>(lo) % (2 * vec) == 0;
  }
};

// The block's threads' sums (fixed order: warps by shuffles, then the warps' by warp 0)
// added to *total by thread 0. Every thread of the block calls it.
__device__ void add_block_sum(float value, double* total) {
  __shared__ float warps[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? warps[lane] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      value += __shfl_down_sync(0xffffffffu, value, offset);
    if (lane == 0) atomicAdd(total, static_cast<double>(value));
  }
}

template <typename Master, typename G, int VEC>
__device__ void adamw_update(const Master& master, const G* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v, int64_t i,
                             const AdamW& h, float step_size, float bc2_sqrt, float decay,
                             float scale, float& squares) {
  float pv[VEC], gv[VEC], mv[VEC], vv[VEC];
  master.template load<VEC>(i, pv);
  load_vec<G, VEC>(g, i, gv);
  load_vec<float, VEC>(m, i, mv);
  load_vec<float, VEC>(v, i, vv);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    squares += gv[j] * gv[j];
    gv[j] *= scale;
    pv[j] *= decay;
    mv[j] += (1.f - h.beta1) * (gv[j] - mv[j]);
    vv[j] = h.beta2 * vv[j] + (1.f - h.beta2) * gv[j] * gv[j];
    const float denom = sqrtf(vv[j]) / bc2_sqrt + h.eps;
    pv[j] -= step_size * mv[j] / denom;
  }
  master.template store<VEC>(i, pv);
  store_vec<float, VEC>(m, i, mv);
  store_vec<float, VEC>(v, i, vv);
}

// One tensor's update by the threads of blockIdx.x (grid-stride over its n elements): VEC
// elements a thread a time, then the scalar tail (n % VEC elements) by the first threads,
// as VEC = 1 updates.
template <typename Master, typename G, int VEC>
__device__ void adamw_range(const Master& master, const G* __restrict__ g,
                            float* __restrict__ m, float* __restrict__ v, float t, int64_t n,
                            const AdamW& h, int64_t block, int64_t blocks) {
  const float lr = h.lr_now ? h.lr * *h.lr_now : h.lr;
  const float scale = h.grad_scale ? *h.grad_scale : 1.f;
  const float bc1 = 1.f - powf(h.beta1, t), bc2 = 1.f - powf(h.beta2, t);
  const float step_size = lr / bc1, bc2_sqrt = sqrtf(bc2), decay = 1.f - lr * h.wd;
  const int64_t nvec = n / VEC;
  const int64_t first = block * blockDim.x + threadIdx.x;
  const int64_t stride = blocks * blockDim.x;
  float squares = 0.f;
  for (int64_t i = first; i < nvec; i += stride)
    adamw_update<Master, G, VEC>(master, g, m, v, i, h, step_size, bc2_sqrt, decay, scale,
                                 squares);
  if (VEC > 1 && nvec * VEC + first < n)
    adamw_update<Master, G, 1>(master, g, m, v, nvec * VEC + first, h, step_size, bc2_sqrt,
                               decay, scale, squares);
  if (h.norm_sq) add_block_sum(squares, h.norm_sq);
}

template <typename Master, typename G, int VEC>
__global__ void adamw_kernel(Master master, const G* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, const float* __restrict__ step, int64_t n,
                             AdamW h) {
  adamw_range<Master, G, VEC>(master, g, m, v, *step, n, h, blockIdx.x, gridDim.x);
}

// The list form: the grid's blocks dealt to the tensors of `list` in order, first[k] ..
// first[k + 1] - 1 to tensor k (as many as its own launch would have), each tensor with its
// own rate factor and weight decay. (A grid of the largest tensor's blocks for every
// tensor would leave most of a LoRA layer's blocks with nothing to do.)
struct ListGrid {
  AdamWSplitList list;
  int first[kAdamWListMax + 1];
};

template <typename G, int VEC>
__global__ void adamw_split_list_kernel(ListGrid grid, const float* __restrict__ step,
                                        AdamW h) {
  const AdamWSplitList& list = grid.list;
  int k = 0;
  while (k + 1 < list.count && static_cast<int>(blockIdx.x) >= grid.first[k + 1]) ++k;
  AdamW own = h;
  own.lr = list.lr[k];
  own.wd = list.weight_decay[k];
  const SplitMaster master{static_cast<uint16_t*>(list.hi[k]), list.lo[k]};
  adamw_range<SplitMaster, G, VEC>(master, static_cast<const G*>(list.grad[k]),
                                   list.exp_avg[k], list.exp_avg_sq[k], *step, list.n[k], own,
                                   blockIdx.x - grid.first[k], grid.first[k + 1] - grid.first[k]);
}

template <typename Master, typename G>
cudaError_t adamw_typed(const Master& master, const void* g, float* m, float* v,
                        const float* step, int64_t n, const AdamW& h, cudaStream_t s) {
  const G* gp = static_cast<const G*>(g);
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * 8;
  auto blocks = [&](int vec) {
    const int64_t work = std::max<int64_t>(n / vec, n % vec);
    return static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, max_blocks));
  };
  // 4 elements a thread: 16-byte fp32 accesses (8 bytes of a bf16 gradient or half)
  bool vec = master.aligned(4) && reinterpret_cast<uintptr_t>(g) % (4 * sizeof(G)) == 0;
  for (const float* ptr : {m, v}) vec = vec && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  if (vec)
    adamw_kernel<Master, G, 4><<<blocks(4), kThreads, 0, s>>>(master, gp, m, v, step, n, h);
  else
    adamw_kernel<Master, G, 1><<<blocks(1), kThreads, 0, s>>>(master, gp, m, v, step, n, h);
  return cudaGetLastError();
}

template <typename Master>
cudaError_t adamw_dispatch(DType grad_dt, const Master& master, const void* grad, float* m,
                           float* v, const float* step, int64_t n, const AdamW& h,
                           cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (grad_dt == DType::BF16)
    return adamw_typed<Master, __nv_bfloat16>(master, grad, m, v, step, n, h, s);
  return adamw_typed<Master, float>(master, grad, m, v, step, n, h, s);
}

template <typename G>
cudaError_t adamw_split_list_typed(const AdamWSplitList& list, const float* step,
                                   const AdamW& h, cudaStream_t s) {
  bool vec = true;  // 4 elements a thread where every tensor of the list is aligned for it
  int64_t most = 0;
  for (int k = 0; k < list.count; ++k) {
    const SplitMaster master{static_cast<uint16_t*>(list.hi[k]), list.lo[k]};
    vec = vec && master.aligned(4) &&
          reinterpret_cast<uintptr_t>(list.grad[k]) % (4 * sizeof(G)) == 0 &&
          reinterpret_cast<uintptr_t>(list.exp_avg[k]) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(list.exp_avg_sq[k]) % 16 == 0;
    most = std::max<int64_t>(most, list.n[k]);
  }
  if (list.count <= 0 || most == 0) return cudaSuccess;
  const int width = vec ? 4 : 1;
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * 8;
  ListGrid grid{list, {}};
  for (int k = 0; k < list.count; ++k) {  // a tensor's blocks as its own launch's, at least 1
    const int64_t work = std::max<int64_t>(list.n[k] / width, list.n[k] % width);
    const int64_t blocks = std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, max_blocks);
    grid.first[k + 1] = grid.first[k] + static_cast<int>(blocks);
  }
  const unsigned blocks = static_cast<unsigned>(grid.first[list.count]);
  if (vec)
    adamw_split_list_kernel<G, 4><<<blocks, kThreads, 0, s>>>(grid, step, h);
  else
    adamw_split_list_kernel<G, 1><<<blocks, kThreads, 0, s>>>(grid, step, h);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adamw_split_list(DType grad_dt, const AdamWSplitList& list,
                                    const float* step, float beta1, float beta2, float eps,
                                    const float* lr_now, const float* grad_scale,
                                    cudaStream_t stream, double* norm_sq) {
  const AdamW h{0.f, beta1, beta2, eps, 0.f, lr_now, grad_scale, norm_sq};  // lr, wd: per tensor
  if (grad_dt == DType::BF16)
    return adamw_split_list_typed<__nv_bfloat16>(list, step, h, stream);
  return adamw_split_list_typed<float>(list, step, h, stream);
}

cudaError_t launch_adamw(DType grad_dt, float* param, const void* grad, float* exp_avg,
                         float* exp_avg_sq, void* compute_bf16, const float* step, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         const float* lr_now, const float* grad_scale, cudaStream_t stream,
                         double* norm_sq) {
  const FloatMaster master{param, static_cast<__nv_bfloat16*>(compute_bf16)};
  return adamw_dispatch(grad_dt, master, grad, exp_avg, exp_avg_sq, step, n,
                        AdamW{lr, beta1, beta2, eps, weight_decay, lr_now, grad_scale, norm_sq},
                        stream);
}

cudaError_t launch_adamw_split(DType grad_dt, void* hi_bf16, int16_t* lo, const void* grad,
                               float* exp_avg, float* exp_avg_sq, const float* step, int64_t n,
                               float lr, float beta1, float beta2, float eps,
                               float weight_decay, const float* lr_now,
                               const float* grad_scale, cudaStream_t stream,
                               double* norm_sq) {
  const SplitMaster master{static_cast<uint16_t*>(hi_bf16), lo};
  return adamw_dispatch(grad_dt, master, grad, exp_avg, exp_avg_sq, step, n,
                        AdamW{lr, beta1, beta2, eps, weight_decay, lr_now, grad_scale, norm_sq},
                        stream);
}

}  // namespace modulec
