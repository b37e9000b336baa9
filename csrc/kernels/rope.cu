// rope forward and backward (std/primitives/rope.module). The first R = 2n channels of each
// head rotate, in pairs (i, i + n) (rotate-half, HF) or (2i, 2i + 1) (interleaved, GPT-J);
// the rest pass through (copied when out is not x). Pair i turns by angle = pos *
// inv_freq[i]: lo' = lo cos - hi sin, hi' = hi cos + lo sin, cos and sin times `scale` (the
// attention scaling of yarn / longrope); the backward rotates by -angle (sin negated).
// inv_freq (fp32 [n]) comes from the caller, computed as the reference computes it
// (runtime/kernels/rope_freq.py, float64 then fp32): every scaled RoPE variant is a table.
// cos and sin depend on (b, t, i) only; a thread may apply them to kHeads heads, but one
// head a thread measured fastest (more threads in flight beat the saved sincosf: one H100,
// benchmarks/kernels/bench_rope_pair.py, q and k in one launch, Llama-3-8B 23.8 / 21.7 /
// 21.8 us at 4 / 2 / 1 heads a thread, TinyLlama B=4 59.2 / 52.5 / 37.0 us). Where a
// call fits it (bf16 rotate-half, whole rotated heads of 4 or 8 vectors), rope_rows_kernel
// shares the angles among a warp's heads through shuffles instead, a block a position.
// x and out have strides of their own over (b, h, t) (the last dim contiguous), so the
// kernel reads the attention's q/k as the transposed views of the fused QKV projection
// they are, and writes where the caller wants: [B, T, H, D] for FlashAttention, or the
// head slots of the fused QKV gradient in the backward. `launch_rope_pair` rotates q and k
// in one launch (the grid's y covers q's head groups, then k's): k alone is a small launch
// whose tail the pair hides.
#include <cstdlib>

#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 1;  // heads per thread (blockIdx.y picks the group): see above

struct RopeShape {
  int64_t B, H, T, D;
  int64_t xb, xh, xt, ob, oh, ot;  // strides (elements) of x and out over b, h, t
  int64_t pos_batch_stride;
  const float* inv_freq;  // [n]
  int64_t n;              // frequencies; R = 2n channels rotate
  int64_t pass_units;     // vectors of the D - R pass-through channels to copy (0: in place)
  float scale, sign;      // attention scaling; sign: +1 forward, -1 backward
};

template <int VEC>
__device__ __forceinline__ void rope_angles(const RopeShape& s, float pos, int64_t i0,
                                            float (&cs)[VEC], float (&sn)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float angle = pos * s.inv_freq[i0 + j];
    sincosf(angle, &sn[j], &cs[j]);
    cs[j] *= s.scale;
    sn[j] *= s.sign * s.scale;
  }
}

// The offsets of a thread's two vectors for the VEC pairs from frequency i0: rotate-half
// reads VEC lows at i0 and VEC highs at i0 + n; interleaved reads 2 VEC channels from 2 i0
// (one scalar pair when VEC is 1).
template <int VEC, bool INTER>
__device__ __forceinline__ void pair_offsets(int64_t i0, int64_t n, int64_t& o0, int64_t& o1) {
  o0 = INTER ? 2 * i0 : i0;
  o1 = INTER ? (VEC == 1 ? 2 * i0 + 1 : 2 * i0 + VEC) : i0 + n;
}

// (v0, v1) as loaded -> (lo, hi) of pairs 0 .. VEC-1, and back (interleaved: pair m is
// channels 2m, 2m + 1 of the two vectors side by side)
template <int VEC, bool INTER>
__device__ __forceinline__ void split_pairs(const float (&v0)[VEC], const float (&v1)[VEC],
                                            float (&lo)[VEC], float (&hi)[VEC]) {
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    if constexpr (!INTER || VEC == 1) {
      lo[m] = v0[m];
      hi[m] = v1[m];
    } else {
      constexpr int h = VEC / 2;
      const int c = 2 * (m % h);
      lo[m] = m < h ? v0[c] : v1[c];
      hi[m] = m < h ? v0[c + 1] : v1[c + 1];
    }
  }
}

template <int VEC, bool INTER>
__device__ __forceinline__ void join_pairs(const float (&lo)[VEC], const float (&hi)[VEC],
                                           float (&v0)[VEC], float (&v1)[VEC]) {
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    if constexpr (!INTER || VEC == 1) {
      v0[m] = lo[m];
      v1[m] = hi[m];
    } else {
      constexpr int h = VEC / 2;
      const int c = 2 * (m % h);
      (m < h ? v0 : v1)[c] = lo[m];
      (m < h ? v0 : v1)[c + 1] = hi[m];
    }
  }
}

// pairs (lo, hi) turned by angles (cs, sn): both kernels' one arithmetic
template <int VEC>
__device__ __forceinline__ void turn(const float (&lo)[VEC], const float (&hi)[VEC],
                                     const float (&cs)[VEC], const float (&sn)[VEC],
                                     float (&a)[VEC], float (&c)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    a[j] = lo[j] * cs[j] - hi[j] * sn[j];
    c[j] = hi[j] * cs[j] + lo[j] * sn[j];
  }
}

// The pass-through channels [R, D) of one (b, t): a VEC copy in kHeads heads from head0.
template <typename T, int VEC>
__device__ __forceinline__ void copy_pass(const T* __restrict__ x, T* __restrict__ out,
                                          const RopeShape& s, int64_t b, int64_t t,
                                          int64_t unit, int64_t head0) {
  const int64_t c = 2 * s.n + unit * VEC;
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    if (head0 + k >= s.H) continue;
    float v[VEC];
    load_vec<T, VEC>(x + b * s.xb + (head0 + k) * s.xh + t * s.xt + c, 0, v);
    store_vec<T, VEC>(out + b * s.ob + (head0 + k) * s.oh + t * s.ot + c, 0, v);
  }
}

// One thread: VEC pairs of one (b, t) in kHeads heads of x [B, H, T, D] from head0 (or,
// for units past the pairs, a pass-through copy).
template <typename T, int VEC, bool INTER>
__device__ __forceinline__ void rope_heads(const T* __restrict__ x, T* __restrict__ out,
                                           const int32_t* __restrict__ position_ids,
                                           const RopeShape& s, int64_t head0) {
  const int64_t hv = s.n / VEC, units = hv + s.pass_units;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.B * s.T * units) return;
  const int64_t bt = idx / units, unit = idx - bt * units;
  const int64_t b = bt / s.T, t = bt - b * s.T;
  if (unit >= hv) return copy_pass<T, VEC>(x, out, s, b, t, unit - hv, head0);
  const int64_t i0 = unit * VEC;
  const float pos = position_ids ? static_cast<float>(position_ids[b * s.pos_batch_stride + t])
                                 : static_cast<float>(t);
  float cs[VEC], sn[VEC];
  rope_angles<VEC>(s, pos, i0, cs, sn);
  int64_t o0, o1;
  pair_offsets<VEC, INTER>(i0, s.n, o0, o1);
  float v0[kHeads][VEC], v1[kHeads][VEC];
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {  // all loads first: 2 * kHeads vectors in flight
    const int64_t base = b * s.xb + (head0 + k) * s.xh + t * s.xt;
    if (head0 + k < s.H) {
      load_vec<T, VEC>(x + base + o0, 0, v0[k]);
      load_vec<T, VEC>(x + base + o1, 0, v1[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    if (head0 + k >= s.H) continue;
    const int64_t base = b * s.ob + (head0 + k) * s.oh + t * s.ot;
    float lo[VEC], hi[VEC], a[VEC], c[VEC];
    split_pairs<VEC, INTER>(v0[k], v1[k], lo, hi);
    turn<VEC>(lo, hi, cs, sn, a, c);
    join_pairs<VEC, INTER>(a, c, v0[k], v1[k]);
    store_vec<T, VEC>(out + base + o0, 0, v0[k]);
    store_vec<T, VEC>(out + base + o1, 0, v1[k]);
  }
}

// Up to two tensors (q and k) of one shape but their heads: blockIdx.y below `split` is
// the first's head group, the rest the second's.
template <typename T>
struct RopeTargets {
  const T* x[2];
  T* out[2];
  RopeShape s[2];
  int split;
};

template <typename T, int VEC, bool INTER>
__global__ void rope_kernel(RopeTargets<T> p, const int32_t* __restrict__ position_ids) {
  const int which = static_cast<int>(blockIdx.y) >= p.split;
  const int64_t group = static_cast<int64_t>(blockIdx.y) - (which ? p.split : 0);
  rope_heads<T, VEC, INTER>(p.x[which], p.out[which], position_ids, p.s[which],
                            group * kHeads);
}

// One unit's VEC (cos, sin) at position pos, made by the warp's 32 / UNITS lanes of that
// unit (lane = UNITS h + unit), VEC UNITS / 32 each with rope_angles' arithmetic, and
// passed round by shuffles. Every lane of the warp calls it.
template <int VEC, int UNITS>
__device__ __forceinline__ void warp_angles(const RopeShape& s, float pos, int unit, int h,
                                            float (&cs)[VEC], float (&sn)[VEC]) {
  constexpr int kPerLane = VEC * UNITS / 32;
  float c_own[kPerLane], s_own[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float angle = pos * s.inv_freq[static_cast<int64_t>(unit) * VEC + h * kPerLane + j];
    sincosf(angle, &s_own[j], &c_own[j]);
    c_own[j] *= s.scale;
    s_own[j] *= s.sign * s.scale;
  }
#pragma unroll
  for (int f = 0; f < VEC; ++f) {
    const int from = (f / kPerLane) * UNITS + unit;
    cs[f] = __shfl_sync(0xffffffffu, c_own[f % kPerLane], from);
    sn[f] = __shfl_sync(0xffffffffu, s_own[f % kPerLane], from);
  }
}

// A position's angles shared by the heads of a warp (rotate-half, 16-byte vectors, a
// head's pairs UNITS vectors, nothing to copy through): a block one (b, t), its warps q's
// head groups then k's, a lane one head's vector `unit` (lane = UNITS h + unit, 32 / UNITS
// heads a warp). The warp makes a position's angles once (warp_angles), not once a head
// (the same bits; one H200, LoRA 8B's q and k alone: 18.1 -> 15.2 us,
// benchmarks/kernels/rope_angle_variants.cu). Every target shares B, T and the pairs' n.
template <typename T, int VEC, int UNITS>
__global__ void rope_rows_kernel(RopeTargets<T> p, const int32_t* __restrict__ position_ids) {
  constexpr int kPerWarp = 32 / UNITS;
  const int group = static_cast<int>(threadIdx.x / 32);
  const int which = group >= p.split;
  const RopeShape& s = p.s[which];
  const int lane = static_cast<int>(threadIdx.x % 32), unit = lane % UNITS, h = lane / UNITS;
  const int64_t head = static_cast<int64_t>(group - (which ? p.split : 0)) * kPerWarp + h;
  const int64_t b = blockIdx.x / s.T, t = blockIdx.x - b * s.T;
  const float pos = position_ids ? static_cast<float>(position_ids[b * s.pos_batch_stride + t])
                                 : static_cast<float>(t);
  const int64_t i0 = static_cast<int64_t>(unit) * VEC;
  float cs[VEC], sn[VEC];
  warp_angles<VEC, UNITS>(s, pos, unit, h, cs, sn);
  if (head >= s.H) return;
  const T* x = p.x[which] + b * s.xb + head * s.xh + t * s.xt + i0;
  T* out = p.out[which] + b * s.ob + head * s.oh + t * s.ot + i0;
  float lo[VEC], hi[VEC], a[VEC], c[VEC];
  load_vec<T, VEC>(x, 0, lo);
  load_vec<T, VEC>(x + s.n, 0, hi);
  turn<VEC>(lo, hi, cs, sn, a, c);
  store_vec<T, VEC>(out, 0, a);
  store_vec<T, VEC>(out + s.n, 0, c);
}

int head_groups(int64_t H) { return static_cast<int>((H + kHeads - 1) / kHeads); }

template <typename T, int VEC, bool INTER>
void launch_vec(const void* const* x, void* const* out, const int32_t* pos, const RopeShape* s,
                int count, cudaStream_t stream) {
  RopeTargets<T> p{};
  for (int i = 0; i < count; ++i) {
    p.x[i] = static_cast<const T*>(x[i]);
    p.out[i] = static_cast<T*>(out[i]);
    p.s[i] = s[i];
    if (p.s[i].pass_units) p.s[i].pass_units = (s[i].D - 2 * s[i].n) / VEC;
  }
  p.split = head_groups(s[0].H);
  const int groups = p.split + (count > 1 ? head_groups(s[1].H) : 0);
  int64_t items = 0;  // threads of the longer one (a tensor rotated in place copies nothing)
  for (int i = 0; i < count; ++i)
    items = std::max<int64_t>(items, s[i].B * s[i].T * (s[i].n / VEC + p.s[i].pass_units));
  const dim3 grid(static_cast<unsigned>((items + kThreads - 1) / kThreads),
                  static_cast<unsigned>(groups));
  rope_kernel<T, VEC, INTER><<<grid, kThreads, 0, stream>>>(p, pos);
}

template <typename T, int VEC>
void launch_layout(bool interleaved, const void* const* x, void* const* out,
                   const int32_t* pos, const RopeShape* s, int count, cudaStream_t stream) {
  if (interleaved)
    launch_vec<T, VEC, true>(x, out, pos, s, count, stream);
  else
    launch_vec<T, VEC, false>(x, out, pos, s, count, stream);
}

// whole vectors of pairs (n), and of the pass-through channels, keep every vector of
// every row 16-byte aligned, and so do strides that are whole vectors
template <typename T>
bool vectors(const void* x, const void* out, const RopeShape& s) {
  constexpr int wide = 16 / sizeof(T);
  bool vec = pick_vec<T>(s.n, {x, out}) == wide && (s.D - 2 * s.n) % wide == 0;
  for (int64_t st : {s.xb, s.xh, s.xt, s.ob, s.oh, s.ot}) vec = vec && st % wide == 0;
  return vec;
}

// rope_rows_kernel's launch where it covers the call (a head's pairs 4 or 8 vectors,
// rotate-half, nothing copied through, a block's warps at most 32); false where it does
// not. MODULEC_ROPE_ROWS=0 turns it off (the tests compare the two kernels' bits).
template <typename T, int VEC>
bool launch_rows(const void* const* x, void* const* out, const int32_t* pos,
                 const RopeShape* s, int count, bool interleaved, cudaStream_t stream) {
  const char* env = std::getenv("MODULEC_ROPE_ROWS");
  if (interleaved || (env && env[0] == '0') || s[0].n % VEC) return false;
  const int64_t units = s[0].n / VEC;
  if (units != 4 && units != 8) return false;
  const int64_t per_warp = 32 / units;
  int64_t warps = 0;
  RopeTargets<T> p{};
  for (int i = 0; i < count; ++i) {  // a block is one (b, t) of every target: alike
    if (s[i].pass_units || s[i].n != s[0].n || s[i].B != s[0].B || s[i].T != s[0].T)
      return false;
    p.x[i] = static_cast<const T*>(x[i]);
    p.out[i] = static_cast<T*>(out[i]);
    p.s[i] = s[i];
    warps += (s[i].H + per_warp - 1) / per_warp;
  }
  if (warps > 32) return false;
  p.split = static_cast<int>((s[0].H + per_warp - 1) / per_warp);
  const unsigned blocks = static_cast<unsigned>(s[0].B * s[0].T);
  const unsigned threads = static_cast<unsigned>(warps * 32);
  if (units == 8)
    rope_rows_kernel<T, VEC, 8><<<blocks, threads, 0, stream>>>(p, pos);
  else
    rope_rows_kernel<T, VEC, 4><<<blocks, threads, 0, stream>>>(p, pos);
  return true;
}

template <typename T>
cudaError_t rope_typed(const void* const* x, void* const* out, const int32_t* pos,
                       const RopeShape* s, int count, bool interleaved, cudaStream_t stream) {
  constexpr int wide = 16 / sizeof(T);
  bool vec = true;
  for (int i = 0; i < count; ++i) vec = vec && vectors<T>(x[i], out[i], s[i]);
  if constexpr (wide == 8)  // bf16
    if (vec && launch_rows<T, wide>(x, out, pos, s, count, interleaved, stream))
      return cudaGetLastError();
  if (vec)
    launch_layout<T, wide>(interleaved, x, out, pos, s, count, stream);
  else
    launch_layout<T, 1>(interleaved, x, out, pos, s, count, stream);
  return cudaGetLastError();
}

RopeShape rope_shape(const void* x, const int64_t* xs, const void* out, const int64_t* os,
                     int64_t pos_batch_stride, int64_t B, int64_t H, int64_t T, int64_t D,
                     const float* inv_freq, int64_t n, float scale, bool inverse) {
  // the pass-through channels are copied unless out is x (in place: already there)
  const bool copy = x != out && 2 * n < D;
  return RopeShape{B, H, T, D, xs[0], xs[1], xs[2], os[0], os[1], os[2],
                   pos_batch_stride, inv_freq, n, copy ? 1 : 0, scale, inverse ? -1.f : 1.f};
}

cudaError_t rope_dispatch(DType dt, const void* const* x, void* const* out, const int32_t* pos,
                          const RopeShape* s, int count, bool interleaved, cudaStream_t stream) {
  if (dt == DType::BF16)
    return rope_typed<__nv_bfloat16>(x, out, pos, s, count, interleaved, stream);
  return rope_typed<float>(x, out, pos, s, count, interleaved, stream);
}

}  // namespace

cudaError_t launch_rope(DType dt, const void* x, const int64_t* x_strides, void* out,
                        const int64_t* out_strides, const int32_t* position_ids,
                        int64_t pos_batch_stride, int64_t B, int64_t H, int64_t T, int64_t D,
                        const float* inv_freq, int64_t n, float scale, bool interleaved,
                        bool inverse, cudaStream_t stream) {
  if (n < 1 || 2 * n > D) return cudaErrorInvalidValue;
  if (B * H * T * D == 0) return cudaSuccess;
  const RopeShape s = rope_shape(x, x_strides, out, out_strides, pos_batch_stride, B, H, T, D,
                                 inv_freq, n, scale, inverse);
  return rope_dispatch(dt, &x, &out, position_ids, &s, 1, interleaved, stream);
}

cudaError_t launch_rope_pair(DType dt, const RopeTensor& q, const RopeTensor& k,
                             const int32_t* position_ids, int64_t pos_batch_stride, int64_t B,
                             int64_t T, int64_t D, const float* inv_freq, int64_t n,
                             float scale, bool interleaved, bool inverse,
                             cudaStream_t stream) {
  if (n < 1 || 2 * n > D || q.H < 1 || k.H < 1) return cudaErrorInvalidValue;
  if (B * T * D == 0) return cudaSuccess;
  const RopeShape s[2] = {
      rope_shape(q.x, q.x_strides, q.out, q.out_strides, pos_batch_stride, B, q.H, T, D,
                 inv_freq, n, scale, inverse),
      rope_shape(k.x, k.x_strides, k.out, k.out_strides, pos_batch_stride, B, k.H, T, D,
                 inv_freq, n, scale, inverse)};
  const void* x[2] = {q.x, k.x};
  void* out[2] = {q.out, k.out};
  return rope_dispatch(dt, x, out, position_ids, s, 2, interleaved, stream);
}

}  // namespace modulec
