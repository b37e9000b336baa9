// qk_norm_rope forward and backward (std/primitives/qk_norm_rope.module): Qwen3's per-head
// RMSNorm of q and k, then RoPE, in one pass over the heads. The unfused
// pair reads and writes every head row twice (and the training step copied the strided
// q/k views to contiguous ones first); here each row is read once and written once.
//
// Work item ("task"): one (b, t) and kHeads consecutive heads of q, or of k (q's tasks
// first, then k's), handled by a "group" of lanes, a power-of-two slice of a warp (<= 32),
// sized so that each lane holds one slot, two 16-byte vectors (a few scalars on the
// scalar path). The angles depend on (b, t, i) only, so a group computes cos/sin once for
// its kHeads heads (as rope.cu does: sincosf would otherwise rival the memory time). The
// frequencies come from the caller (inv_freq, fp32 [n], as rope.cu's: any scaled RoPE),
// cos and sin times `scale`. The first 2n channels rotate (partial rotary: the rest pass
// through, normalized), in rotate-half pairs (i, i + n) or interleaved ones (2i, 2i + 1).
// A lane's work is "slots" of two VEC vectors each (`slot_offsets`): rotated slots hold
// the VEC pairs from frequency j VEC (rotate-half: at j VEC and n + j VEC; interleaved:
// the 2 VEC channels from 2 j VEC, pairs side by side), pass-through slots two adjacent
// vectors after 2n, turned by the identity. D / (2 VEC) slots a row either way.
// A row's sum (of squares; of g w n in the backward) is an xor shuffle inside the group.
// Lane j holds slots j, j + group, ..., so the rotation's pairs never leave a lane.
//
// The backward undoes the rotation (the same formula with sin negated), then runs
// rmsnorm's backward on the row. The weight gradients are reduced as norms.cu reduces
// rmsnorm's: a persistent grid whose groups stride over tasks, each lane keeping the
// d_weight partials of its own columns in registers, one fp32 partial row per group at
// the end, then a column sum: deterministic, no atomics. The grid's first blocks take q's
// tasks and the rest k's (in proportion), so a group only ever holds one weight's partials.
//
// q, k, their outputs and the backward's d_rot have strides of their own over (b, h, t)
// (the last dim contiguous): the inputs are the transposed head views of the fused QKV
// projection, the outputs go where the caller wants ([B, T, H, D] for the attention, the
// head slots of the fused QKV gradient in the backward). fp32 arithmetic; bf16 or fp32
// I/O; rstd fp32 [B, H, T] contiguous.
#include <type_traits>

#include "common.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 4;        // heads a task covers (one angle computation for all)
constexpr int kMaxHeadDim = 256; // keeps a lane's share of a row in registers (<= 8 + 8)

template <int N>
using Int = std::integral_constant<int, N>;

struct Shape {
  QkRopeTensor q, k;
  int64_t T, D;
  const int32_t* pos;
  int64_t pos_stride;
  const float* inv_freq;   // [n]
  int64_t n;               // frequencies: 2n channels rotate
  bool inter;              // pairs (2i, 2i + 1), else (i, i + n)
  float eps, scale, sign;  // scale: cos and sin times it; sign: +1 forward, -1 backward
  int group;
  int64_t groups_q, groups_k;  // head groups (of kHeads) per (b, t)
  int64_t tasks_q, tasks;      // q's tasks, q's and k's
};

// The pointers of head `head0 + k` of a task.
template <typename T>
struct Head {
  const T *x, *d_rot, *w;
  T* out;
  float* rstd;
  bool ok;
};

struct Task {
  int64_t b, t, head0;
  float pos;
  bool valid, is_q;
};

__device__ __forceinline__ Task task_of(const Shape& s, int64_t task) {
  Task r;
  r.valid = task < s.tasks;
  int64_t id = r.valid ? task : 0;  // a group past the end still joins the shuffles
  r.is_q = id < s.tasks_q;
  if (!r.is_q) id -= s.tasks_q;
  const int64_t head_groups = r.is_q ? s.groups_q : s.groups_k;
  const int64_t bt = id / head_groups;
  r.head0 = (id - bt * head_groups) * kHeads;
  r.b = bt / s.T;
  r.t = bt - r.b * s.T;
  r.pos = s.pos ? static_cast<float>(s.pos[r.b * s.pos_stride + r.t]) : static_cast<float>(r.t);
  return r;
}

// q's field or k's, as a value: a reference into the kernel's parameter struct chosen at
// run time would make the compiler copy the struct to local memory
#define QK_PICK(field) (is_q ? s.q.field : s.k.field)

template <typename T>
__device__ __forceinline__ Head<T> head_of(const Shape& s, const Task& task, int k) {
  const bool is_q = task.is_q;
  const int64_t h = task.head0 + k;
  Head<T> r;
  r.ok = task.valid && h < QK_PICK(H);
  const int64_t hh = r.ok ? h : 0, b = task.b, t = task.t;
  r.x = static_cast<const T*>(QK_PICK(x)) + b * QK_PICK(x_strides[0]) +
        hh * QK_PICK(x_strides[1]) + t * QK_PICK(x_strides[2]);
  r.out = static_cast<T*>(QK_PICK(out)) + b * QK_PICK(out_strides[0]) +
          hh * QK_PICK(out_strides[1]) + t * QK_PICK(out_strides[2]);
  const T* d_rot = static_cast<const T*>(QK_PICK(d_rot));
  r.d_rot = d_rot ? d_rot + b * QK_PICK(d_strides[0]) + hh * QK_PICK(d_strides[1]) +
                        t * QK_PICK(d_strides[2])
                  : nullptr;
  r.w = static_cast<const T*>(QK_PICK(weight));
  r.rstd = QK_PICK(rstd) + (b * QK_PICK(H) + hh) * s.T + t;
  return r;
}

#undef QK_PICK

__device__ __forceinline__ float group_sum(float v, int group) {
  for (int off = group >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// scale * cos and sign * scale * sin of the angles of this lane's elements, in fp32 as the
// reference builds its table: angle = pos * inv_freq[i].
template <int VEC, int PAIRS>
__device__ __forceinline__ void angles(const Shape& s, float pos, int lane,
                                       float (&cs)[PAIRS][VEC], float (&sn)[PAIRS][VEC]) {
  const int64_t hv = s.n / VEC;  // rotated slots (the others: cos 1, sin 0, unscaled)
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int64_t j = lane + static_cast<int64_t>(p) * s.group;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      cs[p][e] = 1.f;
      sn[p][e] = 0.f;
      if (j >= hv) continue;
      sincosf(pos * s.inv_freq[j * VEC + e], &sn[p][e], &cs[p][e]);
      cs[p][e] *= s.scale;
      sn[p][e] *= s.sign * s.scale;
    }
  }
}

// The element offsets in a row of slot j's two vectors (module comment).
template <int VEC, bool INTER>
__device__ __forceinline__ void slot_offsets(const Shape& s, int64_t j, int64_t& o0,
                                             int64_t& o1) {
  const int64_t rotated = s.n / VEC;
  if (j >= rotated) {  // pass-through: two adjacent vectors (scalars) after 2n
    o0 = 2 * s.n + (j - rotated) * 2 * VEC;
    o1 = o0 + VEC;
  } else if (INTER) {
    o0 = 2 * j * VEC;
    o1 = o0 + VEC;
  } else {
    o0 = j * VEC;
    o1 = s.n + j * VEC;
  }
}

// (v0, v1), a slot's vectors as loaded, rotated in place: pair m is (v0[m], v1[m]), or,
// interleaved, channels 2m, 2m + 1 of v0 then v1 side by side; lo' = lo cos - hi sin,
// hi' = hi cos + lo sin
template <int VEC, bool INTER>
__device__ __forceinline__ void rotate(float (&v0)[VEC], float (&v1)[VEC], const float (&cs)[VEC],
                                       const float (&sn)[VEC]) {
  float lo[VEC], hi[VEC];
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    if constexpr (INTER && VEC > 1) {
      constexpr int h = VEC / 2;
      const int c = 2 * (m % h);
      lo[m] = m < h ? v0[c] : v1[c];
      hi[m] = m < h ? v0[c + 1] : v1[c + 1];
    } else {
      lo[m] = v0[m];
      hi[m] = v1[m];
    }
  }
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    const float a = lo[m] * cs[m] - hi[m] * sn[m], b = hi[m] * cs[m] + lo[m] * sn[m];
    if constexpr (INTER && VEC > 1) {
      constexpr int h = VEC / 2;
      const int c = 2 * (m % h);
      (m < h ? v0 : v1)[c] = a;
      (m < h ? v0 : v1)[c + 1] = b;
    } else {
      v0[m] = a;
      v1[m] = b;
    }
  }
}

template <typename T, int VEC, int PAIRS, bool INTER>
__global__ void __launch_bounds__(kThreads) qk_rope_forward_kernel(Shape s) {
  const int group = s.group, lane = threadIdx.x % group;
  const int64_t hv = s.D / 2 / VEC;  // slots a row
  const Task task = task_of(s, static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) +
                                   threadIdx.x / group);
  float cs[PAIRS][VEC], sn[PAIRS][VEC];
  angles<VEC, PAIRS>(s, task.pos, lane, cs, sn);
  float lo[kHeads][PAIRS][VEC], hi[kHeads][PAIRS][VEC];  // each slot's two vectors
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {  // every load first: 2 * kHeads * PAIRS in flight
    const Head<T> h = head_of<T>(s, task, k);
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
      const int64_t j = lane + static_cast<int64_t>(p) * group;
      if (h.ok && j < hv) {
        int64_t o0, o1;
        slot_offsets<VEC, INTER>(s, j, o0, o1);
        load_vec<T, VEC>(h.x + o0, 0, lo[k][p]);
        load_vec<T, VEC>(h.x + o1, 0, hi[k][p]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    const Head<T> h = head_of<T>(s, task, k);
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
      const int64_t j = lane + static_cast<int64_t>(p) * group;
      if (h.ok && j < hv)
        for (int e = 0; e < VEC; ++e) ss += lo[k][p][e] * lo[k][p][e] + hi[k][p][e] * hi[k][p][e];
    }
    const float r = rsqrtf(group_sum(ss, group) / static_cast<float>(s.D) + s.eps);
    if (!h.ok) continue;
    if (lane == 0) *h.rstd = r;
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
      const int64_t j = lane + static_cast<int64_t>(p) * group;
      if (j >= hv) continue;
      int64_t o0, o1;
      slot_offsets<VEC, INTER>(s, j, o0, o1);
      float wl[VEC], wh[VEC];
      load_vec<T, VEC>(h.w + o0, 0, wl);
      load_vec<T, VEC>(h.w + o1, 0, wh);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {  // (x * rstd) * weight, as the reference
        lo[k][p][e] = lo[k][p][e] * r * wl[e];
        hi[k][p][e] = hi[k][p][e] * r * wh[e];
      }
      rotate<VEC, INTER>(lo[k][p], hi[k][p], cs[p], sn[p]);
      store_vec<T, VEC>(h.out + o0, 0, lo[k][p]);
      store_vec<T, VEC>(h.out + o1, 0, hi[k][p]);
    }
  }
}

// One head row of the backward: g = the inverse rotation of d_rot (the gradient of the
// normalized row), n = x r, d_x = r (g w - n mean(g w n)); adds g n to dw. Everything
// after the rotation is per element, in the slots' loaded order.
template <typename T, int VEC, int PAIRS, bool INTER>
__device__ __forceinline__ void backward_row(const Shape& s, const Head<T>& h, int lane,
                                             const float (&cs)[PAIRS][VEC],
                                             const float (&sn)[PAIRS][VEC],
                                             float (&dw)[PAIRS][2][VEC]) {
  const int group = s.group;
  const int64_t hv = s.D / 2 / VEC;
  float gw[PAIRS][2][VEC], ns[PAIRS][2][VEC];  // g * w and n: all the second pass needs
  const float r = h.ok ? *h.rstd : 0.f;
  float dot = 0.f;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int64_t j = lane + static_cast<int64_t>(p) * group;
    if (!h.ok || j >= hv) continue;
    int64_t o0, o1;
    slot_offsets<VEC, INTER>(s, j, o0, o1);
    float g[2][VEC], w[2][VEC];
    load_vec<T, VEC>(h.d_rot + o0, 0, g[0]);
    load_vec<T, VEC>(h.d_rot + o1, 0, g[1]);
    load_vec<T, VEC>(h.x + o0, 0, ns[p][0]);
    load_vec<T, VEC>(h.x + o1, 0, ns[p][1]);
    load_vec<T, VEC>(h.w + o0, 0, w[0]);
    load_vec<T, VEC>(h.w + o1, 0, w[1]);
    rotate<VEC, INTER>(g[0], g[1], cs[p], sn[p]);  // sn holds -sin: the inverse rotation
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        ns[p][i][e] *= r;
        gw[p][i][e] = g[i][e] * w[i][e];
        dot += gw[p][i][e] * ns[p][i][e];
        dw[p][i][e] += g[i][e] * ns[p][i][e];
      }
  }
  const float mean_gn = group_sum(dot, group) / static_cast<float>(s.D);
  if (!h.ok) return;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int64_t j = lane + static_cast<int64_t>(p) * group;
    if (j >= hv) continue;
    int64_t o0, o1;
    slot_offsets<VEC, INTER>(s, j, o0, o1);
    float o[2][VEC];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[i][e] = r * (gw[p][i][e] - ns[p][i][e] * mean_gn);
    store_vec<T, VEC>(h.out + o0, 0, o[0]);
    store_vec<T, VEC>(h.out + o1, 0, o[1]);
  }
}

// Persistent grid: blocks [0, grid_q) take q's tasks, the rest k's; within a side, group
// g takes tasks g, g + groups, ...; a lane owns the same columns in every row, so its
// d_weight partials need neither atomics nor barriers. partial: [groups][D] fp32, the q
// blocks' groups first, every entry written.
template <typename T, int VEC, int PAIRS, bool INTER>
__global__ void __launch_bounds__(kThreads)
qk_rope_backward_kernel(Shape s, int grid_q, float* __restrict__ partial) {
  const int group = s.group, lane = threadIdx.x % group;
  const int64_t hv = s.D / 2 / VEC;
  const int64_t per_block = blockDim.x / group;
  const bool q_side = static_cast<int>(blockIdx.x) < grid_q;
  const int64_t block = q_side ? blockIdx.x : blockIdx.x - grid_q;
  const int64_t blocks = q_side ? grid_q : gridDim.x - grid_q;
  const int64_t first = q_side ? 0 : s.tasks_q, end = q_side ? s.tasks_q : s.tasks;
  float dw[PAIRS][2][VEC] = {};
  // the loop bound is uniform across the block: every group reaches every shuffle
  for (int64_t base = first + block * per_block; base < end; base += blocks * per_block) {
    const int64_t id = base + threadIdx.x / group;
    Task task = task_of(s, id < end ? id : s.tasks);  // past the side's end: no work
    float cs[PAIRS][VEC], sn[PAIRS][VEC];
    angles<VEC, PAIRS>(s, task.pos, lane, cs, sn);
#pragma unroll 1
    for (int k = 0; k < kHeads; ++k)
      backward_row<T, VEC, PAIRS, INTER>(s, head_of<T>(s, task, k), lane, cs, sn, dw);
  }
  float* part = partial + (static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / group) * s.D;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int64_t j = lane + static_cast<int64_t>(p) * group;
    if (j >= hv) continue;
    int64_t o[2];
    slot_offsets<VEC, INTER>(s, j, o[0], o[1]);
    for (int i = 0; i < 2; ++i)
      for (int e = 0; e < VEC; ++e) part[o[i] + e] = dw[p][i][e];
  }
}

// d_weight[c] = sum over the side's parts of partial[part][c] (blockIdx.y: 0 q's parts
// [0, parts_q), 1 k's [parts_q, parts)); common.cuh's column_sum_block.
template <typename T>
__global__ void weight_sum_kernel(const float* __restrict__ partial, int64_t parts_q,
                                  int64_t parts, int64_t D, T* __restrict__ d_q_weight,
                                  T* __restrict__ d_k_weight) {
  if (blockIdx.y)
    column_sum_block<T>(partial, parts_q, parts, D, d_k_weight);
  else
    column_sum_block<T>(partial, 0, parts_q, D, d_q_weight);
}

// ------------------------------------------------------------------- host dispatch
// Lanes per task: enough that a lane holds one 16-byte vector of each half (up to 32).
template <typename T>
int group_of(int64_t D) {
  constexpr int wide = 16 / sizeof(T);
  const int64_t vectors = (D / 2 + wide - 1) / wide;
  int group = 1;
  while (group < vectors && group < 32) group <<= 1;
  return group;
}

// The vector width: 16 bytes when every slot's vectors of every row of every tensor
// start on a 16-byte boundary (whole vectors of pairs and of pass-through pairs), else 1.
template <typename T>
int vec_of(const Shape& s) {
  constexpr int wide = 16 / sizeof(T);
  const QkRopeTensor &q = s.q, &k = s.k;
  bool ok = pick_vec<T>(s.n, {q.x, q.out, q.d_rot, q.weight, k.x, k.out, k.d_rot,
                              k.weight}) == wide &&
            (s.D - 2 * s.n) % (2 * wide) == 0;
  for (const QkRopeTensor* a : {&q, &k})
    for (int i = 0; i < 3; ++i)
      ok = ok && a->x_strides[i] % wide == 0 && a->out_strides[i] % wide == 0 &&
           (!a->d_rot || a->d_strides[i] % wide == 0);
  return ok ? wide : 1;
}

// f(Int<VEC>, Int<PAIRS>, bool_constant<INTER>) for the instantiation a row needs: D <=
// kMaxHeadDim gives the vector path one slot a lane, the scalar path 1 .. 8.
template <typename T, typename F>
void dispatch(int vec, int64_t D, int group, bool inter, F&& f) {
  constexpr int wide = 16 / sizeof(T);
  auto run = [&](auto v, auto p) {
    if (inter)
      f(v, p, std::true_type{});
    else
      f(v, p, std::false_type{});
  };
  if (vec == wide) return run(Int<wide>{}, Int<1>{});
  const int64_t pairs = (D / 2 + group - 1) / group;
  if (pairs <= 1) return run(Int<1>{}, Int<1>{});
  if (pairs <= 2) return run(Int<1>{}, Int<2>{});
  if (pairs <= 4) return run(Int<1>{}, Int<4>{});
  run(Int<1>{}, Int<8>{});
}

template <typename T>
Shape shape_of(const QkRopeTensor& q, const QkRopeTensor& k, const int32_t* pos,
               int64_t pos_stride, int64_t B, int64_t T_, int64_t D, float eps,
               const QkRopeRotation& rot, float sign) {
  Shape s{};
  s.q = q;
  s.k = k;
  s.T = T_;
  s.D = D;
  s.pos = pos;
  s.pos_stride = pos_stride;
  s.inv_freq = rot.inv_freq;
  s.n = rot.n;
  s.inter = rot.interleaved;
  s.eps = eps;
  s.scale = rot.scale;
  s.sign = sign;
  s.group = group_of<T>(D);
  s.groups_q = (q.H + kHeads - 1) / kHeads;
  s.groups_k = (k.H + kHeads - 1) / kHeads;
  s.tasks_q = B * T_ * s.groups_q;
  s.tasks = s.tasks_q + B * T_ * s.groups_k;
  return s;
}

template <typename T>
cudaError_t forward_typed(const Shape& s, cudaStream_t stream) {
  const int64_t per_block = kThreads / s.group;
  const unsigned blocks = static_cast<unsigned>((s.tasks + per_block - 1) / per_block);
  dispatch<T>(vec_of<T>(s), s.D, s.group, s.inter, [&](auto vec, auto pairs, auto inter) {
    qk_rope_forward_kernel<T, decltype(vec)::value, decltype(pairs)::value,
                           decltype(inter)::value><<<blocks, kThreads, 0, stream>>>(s);
  });
  return cudaGetLastError();
}

// The backward's grid, from the sizes alone (the workspace is sized before the launch,
// which may then take the scalar path or the interleaved kernel on the same grid): as
// many blocks as are resident at once (fewer when there are fewer tasks), split between
// q's tasks and k's in proportion, at least one block for a side that has tasks. The
// grid stays correct when fewer are resident: its groups stride over the tasks.
struct BackwardPlan {
  int grid, grid_q, per_block;
  int64_t parts() const { return static_cast<int64_t>(grid) * per_block; }
};

template <typename T>
BackwardPlan backward_plan(const Shape& s) {
  constexpr int wide = 16 / sizeof(T);
  int per_sm = 0;
  dispatch<T>((s.D / 2) % wide == 0 ? wide : 1, s.D, s.group, false,
              [&](auto vec, auto pairs, auto inter) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm,
        qk_rope_backward_kernel<T, decltype(vec)::value, decltype(pairs)::value,
                                decltype(inter)::value>,
        kThreads, 0);
  });
  const int per_block = kThreads / s.group;
  const int64_t tasks_k = s.tasks - s.tasks_q;
  const int64_t need_q = (s.tasks_q + per_block - 1) / per_block;
  const int64_t need_k = (tasks_k + per_block - 1) / per_block;
  const int64_t resident = std::max<int64_t>(2, static_cast<int64_t>(sm_count()) * std::max(per_sm, 1));
  const int64_t grid = std::min(need_q + need_k, resident);
  int64_t grid_q = need_k == 0 ? grid : need_q == 0 ? 0 : (grid * s.tasks_q + s.tasks / 2) / s.tasks;
  if (need_q > 0 && need_k > 0) grid_q = std::min(std::max<int64_t>(grid_q, 1), grid - 1);
  return {static_cast<int>(grid), static_cast<int>(grid_q), per_block};
}

template <typename T>
cudaError_t backward_typed(const Shape& s, void* d_q_weight, void* d_k_weight,
                           float* workspace, cudaStream_t stream) {
  const BackwardPlan plan = backward_plan<T>(s);
  dispatch<T>(vec_of<T>(s), s.D, s.group, s.inter, [&](auto vec, auto pairs, auto inter) {
    qk_rope_backward_kernel<T, decltype(vec)::value, decltype(pairs)::value,
                            decltype(inter)::value>
        <<<plan.grid, kThreads, 0, stream>>>(s, plan.grid_q, workspace);
  });
  const dim3 blocks(static_cast<unsigned>((s.D + 31) / 32), 2);
  weight_sum_kernel<T><<<blocks, dim3(32, 8), 0, stream>>>(
      workspace, static_cast<int64_t>(plan.grid_q) * plan.per_block, plan.parts(), s.D,
      static_cast<T*>(d_q_weight), static_cast<T*>(d_k_weight));
  return cudaGetLastError();
}

bool supported(int64_t D, const QkRopeRotation& rot) {
  return D % 2 == 0 && D <= kMaxHeadDim && rot.n >= 1 && 2 * rot.n <= D;
}

}  // namespace

cudaError_t launch_qk_norm_rope_forward(DType dt, const QkRopeTensor& q, const QkRopeTensor& k,
                                        const int32_t* position_ids, int64_t pos_batch_stride,
                                        int64_t B, int64_t T, int64_t D, float eps,
                                        const QkRopeRotation& rot, cudaStream_t stream) {
  if (!supported(D, rot)) return cudaErrorInvalidValue;
  if (B * T * (q.H + k.H) * D == 0) return cudaSuccess;
  if (dt == DType::BF16)
    return forward_typed<__nv_bfloat16>(
        shape_of<__nv_bfloat16>(q, k, position_ids, pos_batch_stride, B, T, D, eps, rot, 1.f),
        stream);
  return forward_typed<float>(
      shape_of<float>(q, k, position_ids, pos_batch_stride, B, T, D, eps, rot, 1.f), stream);
}

int64_t qk_norm_rope_backward_workspace(DType dt, int64_t B, int64_t T, int64_t Hq, int64_t Hk,
                                        int64_t D) {
  QkRopeRotation rot;  // the plan reads the sizes only
  rot.n = D / 2;
  if (!supported(D, rot) || B * T * (Hq + Hk) * D == 0) return 0;
  QkRopeTensor q, k;
  q.H = Hq;
  k.H = Hk;
  if (dt == DType::BF16)
    return backward_plan<__nv_bfloat16>(
               shape_of<__nv_bfloat16>(q, k, nullptr, 0, B, T, D, 0.f, rot, -1.f))
               .parts() * D;
  return backward_plan<float>(shape_of<float>(q, k, nullptr, 0, B, T, D, 0.f, rot, -1.f))
             .parts() * D;
}

cudaError_t launch_qk_norm_rope_backward(DType dt, const QkRopeTensor& q, const QkRopeTensor& k,
                                         const int32_t* position_ids, int64_t pos_batch_stride,
                                         int64_t B, int64_t T, int64_t D,
                                         const QkRopeRotation& rot, void* d_q_weight,
                                         void* d_k_weight, float* workspace, cudaStream_t stream) {
  if (!supported(D, rot)) return cudaErrorInvalidValue;
  if (D == 0) return cudaSuccess;
  const size_t bytes = D * (dt == DType::BF16 ? 2 : 4);
  if (B * T * (q.H + k.H) == 0) {  // no rows: the weight gradients are sums over nothing
    const cudaError_t err = cudaMemsetAsync(d_q_weight, 0, bytes, stream);
    return err != cudaSuccess ? err : cudaMemsetAsync(d_k_weight, 0, bytes, stream);
  }
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16>(
        shape_of<__nv_bfloat16>(q, k, position_ids, pos_batch_stride, B, T, D, 0.f, rot, -1.f),
        d_q_weight, d_k_weight, workspace, stream);
  return backward_typed<float>(
      shape_of<float>(q, k, position_ids, pos_batch_stride, B, T, D, 0.f, rot, -1.f),
      d_q_weight, d_k_weight, workspace, stream);
}

}  // namespace modulec
