// rope forward and backward (std/primitives/rope.module), HF rotate-half convention:
// element i pairs with i + D/2; out[i] = x[i] cos - x[i+h] sin, out[i+h] = x[i+h] cos +
// x[i] sin; the backward rotates by -angle (sin negated). cos and sin are computed in
// fp32 here, as the reference builds its tables: inv_freq = theta^(-2i/D) (powf), angle
// = pos * inv_freq. They depend on (b, t, i) only, so a thread computes them once and
// applies them to kHeads heads: the transcendentals would otherwise rival the memory time.
// x and out have strides of their own over (b, h, t) (the last dim contiguous), so the
// kernel reads the attention's q/k as the transposed views of the fused QKV projection
// they are, and writes where the caller wants: [B, T, H, D] for FlashAttention, or the
// head slots of the fused QKV gradient in the backward.
#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 4;  // heads per thread (blockIdx.y picks the group)

struct RopeShape {
  int64_t B, H, T, D;
  int64_t xb, xh, xt, ob, oh, ot;  // strides (elements) of x and out over b, h, t
  int64_t pos_batch_stride;
  float theta, sign;  // sign: +1 forward, -1 backward
};

template <int VEC>
__device__ __forceinline__ void rope_angles(const RopeShape& s, float pos, int64_t i0,
                                            float (&cs)[VEC], float (&sn)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    // -(2i) / D then theta ** that, in fp32, as torch's `theta ** (-arange(0, D, 2) / D)`
    const float e = -static_cast<float>(2 * (i0 + j)) / static_cast<float>(s.D);
    const float angle = pos * powf(s.theta, e);
    sincosf(angle, &sn[j], &cs[j]);
    sn[j] *= s.sign;
  }
}

// One thread: VEC pairs of one (b, t) in kHeads heads of x [B, H, T, D].
template <typename T, int VEC>
__global__ void rope_kernel(const T* __restrict__ x, T* __restrict__ out,
                            const int32_t* __restrict__ position_ids, RopeShape s) {
  const int64_t h = s.D / 2, hv = h / VEC;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.B * s.T * hv) return;
  const int64_t bt = idx / hv, i0 = (idx - bt * hv) * VEC;
  const int64_t b = bt / s.T, t = bt - b * s.T;
  const float pos = position_ids ? static_cast<float>(position_ids[b * s.pos_batch_stride + t])
                                 : static_cast<float>(t);
  float cs[VEC], sn[VEC];
  rope_angles<VEC>(s, pos, i0, cs, sn);
  const int64_t head0 = static_cast<int64_t>(blockIdx.y) * kHeads;
  float lo[kHeads][VEC], hi[kHeads][VEC];
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {  // all loads first: 2 * kHeads vectors in flight
    const int64_t base = b * s.xb + (head0 + k) * s.xh + t * s.xt + i0;
    if (head0 + k < s.H) {
      load_vec<T, VEC>(x + base, 0, lo[k]);
      load_vec<T, VEC>(x + base + h, 0, hi[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    if (head0 + k >= s.H) continue;
    const int64_t base = b * s.ob + (head0 + k) * s.oh + t * s.ot + i0;
    float a[VEC], c[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      a[j] = lo[k][j] * cs[j] - hi[k][j] * sn[j];
      c[j] = hi[k][j] * cs[j] + lo[k][j] * sn[j];
    }
    store_vec<T, VEC>(out + base, 0, a);
    store_vec<T, VEC>(out + base + h, 0, c);
  }
}

template <typename T, int VEC>
void launch_vec(const void* x, void* out, const int32_t* pos, const RopeShape& s,
                cudaStream_t stream) {
  const int64_t items = s.B * s.T * (s.D / 2 / VEC);
  const dim3 grid(static_cast<unsigned>((items + kThreads - 1) / kThreads),
                  static_cast<unsigned>((s.H + kHeads - 1) / kHeads));
  rope_kernel<T, VEC><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                     static_cast<T*>(out), pos, s);
}

template <typename T>
cudaError_t rope_typed(const void* x, void* out, const int32_t* pos, const RopeShape& s,
                       cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T);
  // a half row of whole vectors keeps both halves of every row 16-byte aligned, and so
  // do strides that are whole vectors
  bool vec = pick_vec<T>(s.D / 2, {x, out}) == wide;
  for (int64_t st : {s.xb, s.xh, s.xt, s.ob, s.oh, s.ot}) vec = vec && st % wide == 0;
  if (vec)
    launch_vec<T, wide>(x, out, pos, s, stream);
  else
    launch_vec<T, 1>(x, out, pos, s, stream);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope(DType dt, const void* x, const int64_t* x_strides, void* out,
                        const int64_t* out_strides, const int32_t* position_ids,
                        int64_t pos_batch_stride, int64_t B, int64_t H, int64_t T, int64_t D,
                        float theta, bool inverse, cudaStream_t stream) {
  if (B * H * T * D == 0) return cudaSuccess;
  const RopeShape s{B, H, T, D,
                    x_strides[0], x_strides[1], x_strides[2],
                    out_strides[0], out_strides[1], out_strides[2],
                    pos_batch_stride, theta, inverse ? -1.f : 1.f};
  if (dt == DType::BF16) return rope_typed<__nv_bfloat16>(x, out, position_ids, s, stream);
  return rope_typed<float>(x, out, position_ids, s, stream);
}

}  // namespace modulec
