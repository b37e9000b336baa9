// Cross-entropy loss and gradient in one kernel, in place on a chunk of logits (the fused
// LM head, runtime/cuda/lm_head.py): the torch path upcasts the chunk to fp32 and runs
// logsumexp, gather, sub, exp, scatter_add and mul over it, then casts back; here each
// logit is read once and its gradient written once, in the logits' own dtype.
//
// One block per row, two passes. Pass 1: each thread keeps a running (max, sum of exp) over
// its logits, then one block reduction merges them into lse. Pass 2: each thread writes
// (exp(x - lse) - [j == label]) * scale over the same logits. A thread keeps its first
// kCache vectors in registers as loaded (bf16: 4 registers per 8 logits), so rows of up to
// kCache * 512 vectors (32k bf16 logits) are read from memory once; a longer row keeps
// kLongCache vectors a thread and streams the rest (kLongBatch loads in flight), read
// again in pass 2 (partly from L2). Nothing is shared between threads but the
// reduction, so the in-place writes need no other barrier. __launch_bounds__(512, 2) holds
// the kernel to 64 registers (no spills): two rows in flight per SM.
//
// H200, 2048 x 32000 bf16: 0.094 ms (2.8 TB/s read + write) against 1.29 ms for the torch
// ops with their fp32 copy; 2048 x 128256: 0.43 ms against 4.84 ms
// (benchmarks/kernels/bench_cross_entropy.py).
//
// A row is cut into an unaligned head (up to the first 16-byte boundary, < VEC logits),
// 16-byte vectors and a tail (< VEC logits): with an odd V every other row starts off a
// 16-byte boundary, and the vectors still take the wide path. The head and tail logits
// belong to the first threads, one each.
#include <cmath>

#include "common.cuh"

namespace modulec {
namespace {

constexpr int kMaxThreads = 512;  // threads per row at most
constexpr int kCache = 8;         // row vectors a thread keeps in registers, as loaded
// A row longer than kCache * kMaxThreads vectors (a Llama-3 vocabulary: 16,032 bf16
// vectors) is mostly streamed: there a thread keeps kLongCache vectors and loads the rest
// kLongBatch at a time before using any (one load in flight a thread read the streamed
// part at ~1.9 TB/s: 543 us for 2048 x 128256 bf16 in the LoRA 8B step on one H100). 4 + 3
// vectors are what fit in 64 registers a thread (__launch_bounds__(512, 2)) without spills
// for bf16 (4 + 4 spilled).
constexpr int kLongCache = 4, kLongBatch = 3;

// exp(d) as one multiply and the hardware exp2 (MUFU.EX2, ~2 ulp), for d = x - m already
// rounded as the reference rounds it: expf's range reduction costs ~6 more instructions per
// logit, and the two exps per logit would otherwise make the kernel compute-bound. The
// multiply adds a relative error of ~1e-7 * |d|: ~1e-6 where exp(d) is not negligible.
__device__ __forceinline__ float exp_of(float d) { return exp2f(d * 1.4426950408889634f); }

// A running max m and sum s of exp(x - m); m = -inf while every logit seen is -inf.
struct MaxSum {
  float m, s;
};

// Both rescaled to the larger max. -inf - -inf would be NaN: two empty sums stay empty.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;
  return {m, a.s * exp_of(a.m - m) + b.s * exp_of(b.m - m)};
}

// Adds N logits: the sum is rescaled once per N when the max grows, not once per logit.
template <int N>
__device__ __forceinline__ void accumulate(MaxSum& a, const float (&x)[N]) {
  float m = a.m;
#pragma unroll
  for (int j = 0; j < N; ++j) m = fmaxf(m, x[j]);
  if (m == -INFINITY) return;
  if (m != a.m) {
    a.s *= exp_of(a.m - m);
    a.m = m;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) a.s += exp_of(x[j] - m);
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  return v;
}

// The merge over the block, returned to every thread (merge is commutative bit for bit, so
// every thread gets the same lse). Called once per block: no leading barrier needed.
__device__ __forceinline__ MaxSum block_merge(MaxSum v) {
  __shared__ float part_m[32], part_s[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_merge(v);
  if (lane == 0) {
    part_m[warp] = v.m;
    part_s[warp] = v.s;
  }
  __syncthreads();
  return warp_merge(lane < warps ? MaxSum{part_m[lane], part_s[lane]} : MaxSum{-INFINITY, 0.f});
}

// d_logit of one logit, in the reference's order: (exp(x - lse) - onehot) * scale
__device__ __forceinline__ float grad_of(float x, float lse, bool is_label, float scale) {
  float p = exp_of(x - lse);
  if (is_label) p -= 1.f;
  return p * scale;
}

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Vec<T, VEC>& r, float (&out)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_float(r.v[j]);
}

// An empty asm that "changes" the cached words: pass 2 must unpack them again, so the
// compiler keeps the cache packed instead of pass 1's unpacked floats (for bf16 that
// would take twice the registers and halve the blocks per SM).
template <typename T, int VEC>
__device__ __forceinline__ void keep_packed(Vec<T, VEC>& r) {
  static_assert(sizeof(r) == 16, "16-byte vectors");
  auto* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(w[j]));
}

// Vector i of the body (logits first + i * VEC ..) overwritten with its gradient.
template <typename T, int VEC>
__device__ __forceinline__ void store_grad(Vec<T, VEC>* body, int64_t i, const Vec<T, VEC>& r,
                                           int64_t first, int64_t label, float lse,
                                           float scale) {
  float x[VEC];
  unpack(r, x);
  const int64_t hit = label - (first + i * VEC);  // the label's slot in this vector, if any
#pragma unroll
  for (int j = 0; j < VEC; ++j) x[j] = grad_of(x[j], lse, j == hit, scale);
  store_vec<T, VEC>(reinterpret_cast<T*>(body), i, x);
}

// head: logits before the first 16-byte boundary; then nvec vectors; the tail from
// tail_start to V (< VEC logits). Row starts are always aligned to sizeof(T).
struct RowParts {
  int64_t head, nvec, tail_start;
};

template <typename T, int VEC>
__device__ __forceinline__ RowParts row_parts(const T* row, int64_t V) {
  const int64_t off = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16) / sizeof(T);
  const int64_t head = off ? min(VEC - off, V) : 0;
  const int64_t nvec = (V - head) / VEC;
  return {head, nvec, head + nvec * VEC};
}

// An ignored row: gradient 0, loss 0.
template <typename T, int VEC>
__device__ void zero_row(T* row, const RowParts& p, int64_t V, float* loss) {
  const float zeros[VEC] = {};
  for (int64_t i = threadIdx.x; i < p.nvec; i += blockDim.x)
    store_vec<T, VEC>(row + p.head, i, zeros);
  if (threadIdx.x < p.head) row[threadIdx.x] = from_float<T>(0.f);
  if (p.tail_start + threadIdx.x < V) row[p.tail_start + threadIdx.x] = from_float<T>(0.f);
  if (threadIdx.x == 0) *loss = 0.f;
}

template <typename T, int CACHE, int BATCH>
__global__ void __launch_bounds__(kMaxThreads, 2)
cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ labels,
                     const float* __restrict__ scale, float* __restrict__ losses, int64_t V,
                     int64_t ignore_index) {
  constexpr int VEC = 16 / sizeof(T);
  T* row = logits + static_cast<int64_t>(blockIdx.x) * V;
  const int64_t label = labels[blockIdx.x];
  const RowParts p = row_parts<T, VEC>(row, V);
  if (label == ignore_index) {  // uniform over the block: no thread waits at a barrier
    zero_row<T, VEC>(row, p, V, losses + blockIdx.x);
    return;
  }
  auto* body = reinterpret_cast<Vec<T, VEC>*>(row + p.head);
  const int t = threadIdx.x, threads = blockDim.x;
  // thread 0 reads the label's logit before the reduction's barrier, which every write
  // follows; a label outside [0, V) reads nothing and gives a NaN loss (a visible error,
  // where torch would assert), and no logit gets the one-hot term
  const bool in_range = label >= 0 && label < V;
  const float picked = t == 0 && in_range ? to_float(row[label]) : NAN;
  // the head and tail logits this thread owns (-1: none); blockDim.x >= 64 > VEC
  const int64_t head_j = t < p.head ? t : -1;
  const int64_t tail_j = p.tail_start + t < V ? p.tail_start + t : -1;

  // ---- pass 1: running max and sum over this thread's logits, then lse over the row
  Vec<T, VEC> cache[CACHE];
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {  // every load in flight before the first use
    const int64_t i = t + static_cast<int64_t>(k) * threads;
    if (i < p.nvec) cache[k] = body[i];
  }
  MaxSum acc{-INFINITY, 0.f};
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    if (t + static_cast<int64_t>(k) * threads < p.nvec) {
      float x[VEC];
      unpack(cache[k], x);
      accumulate(acc, x);
    }
  }
  for (int64_t i0 = t + static_cast<int64_t>(CACHE) * threads; i0 < p.nvec;
       i0 += BATCH * threads) {  // BATCH loads in flight, then their sums in order
    Vec<T, VEC> r[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (i0 + b * threads < p.nvec) r[b] = body[i0 + b * threads];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      if (i0 + b * threads < p.nvec) {
        float x[VEC];
        unpack(r[b], x);
        accumulate(acc, x);
      }
    }
  }
  const float head_x[1] = {head_j >= 0 ? to_float(row[head_j]) : 0.f};
  const float tail_x[1] = {tail_j >= 0 ? to_float(row[tail_j]) : 0.f};
  if (head_j >= 0) accumulate(acc, head_x);
  if (tail_j >= 0) accumulate(acc, tail_x);
  const MaxSum total = block_merge(acc);
  const float lse = total.m + logf(total.s);

  // ---- pass 2: the gradient, in place
  const float sc = *scale;
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t i = t + static_cast<int64_t>(k) * threads;
    if (i < p.nvec) {
      keep_packed(cache[k]);
      store_grad(body, i, cache[k], p.head, label, lse, sc);
    }
  }
  for (int64_t i0 = t + static_cast<int64_t>(CACHE) * threads; i0 < p.nvec;
       i0 += BATCH * threads) {  // the loads ahead of the stores (they write the same row)
    Vec<T, VEC> r[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (i0 + b * threads < p.nvec) r[b] = body[i0 + b * threads];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (i0 + b * threads < p.nvec)
        store_grad(body, i0 + b * threads, r[b], p.head, label, lse, sc);
  }
  if (head_j >= 0) row[head_j] = from_float<T>(grad_of(head_x[0], lse, head_j == label, sc));
  if (tail_j >= 0) row[tail_j] = from_float<T>(grad_of(tail_x[0], lse, tail_j == label, sc));
  if (t == 0) losses[blockIdx.x] = lse - picked;
}

// Enough threads that the row's vectors fit the register cache, in whole warps, at least
// 64 (the head and tail need VEC threads) and at most kMaxThreads.
int row_threads(int64_t nvec) {
  const int64_t t = (nvec + kCache - 1) / kCache;
  return static_cast<int>(std::clamp<int64_t>((t + 31) / 32 * 32, 64, kMaxThreads));
}

template <typename T>
cudaError_t launch_typed(void* logits, const int64_t* labels, const float* scale,
                         float* losses, int64_t rows, int64_t V, int64_t ignore_index,
                         cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t nvec = (V + VEC - 1) / VEC;
  const unsigned grid = static_cast<unsigned>(rows);
  if (nvec > static_cast<int64_t>(kCache) * kMaxThreads)
    cross_entropy_kernel<T, kLongCache, kLongBatch><<<grid, kMaxThreads, 0, stream>>>(
        static_cast<T*>(logits), labels, scale, losses, V, ignore_index);
  else
    cross_entropy_kernel<T, kCache, 1><<<grid, row_threads(nvec), 0, stream>>>(
        static_cast<T*>(logits), labels, scale, losses, V, ignore_index);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_cross_entropy(DType dt, void* logits, const int64_t* labels,
                                 const float* scale, float* losses, int64_t rows, int64_t V,
                                 int64_t ignore_index, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (V == 0) return cudaErrorInvalidValue;  // no logits: no loss to write
  if (dt == DType::BF16)
    return launch_typed<__nv_bfloat16>(logits, labels, scale, losses, rows, V, ignore_index,
                                       stream);
  if (dt == DType::F16)
    return launch_typed<__half>(logits, labels, scale, losses, rows, V, ignore_index, stream);
  return launch_typed<float>(logits, labels, scale, losses, rows, V, ignore_index, stream);
}

}  // namespace modulec
