// mamba_conv1d and mamba_selective_scan (std/primitives/mamba_conv1d.module,
// mamba_selective_scan.module): I/O in bf16 or fp32 (x, u, delta, B, C and their
// gradients), the small per-channel tensors (conv weight and bias, A, D, dt_bias) and the
// recurrent states in fp32, fp32 arithmetic.
//
// conv1d: one block per (batch, channel) row, threads over time; the backward recomputes
// the pre-activation at the W times each d_x reads, and its d_weight / d_bias are per-row
// partials (summed over the batch by the caller: deterministic).
//
// selective scan: one warp per (batch, channel) row, sequential over tiles of 128 time
// steps (kLaneSteps consecutive steps per lane); within a tile, per state n, each lane
// composes its steps' affine maps h -> a h + b, a warp scan (shuffles) gives each lane
// the state entering its steps, and the lane replays them. The states stay in fp32
// (shared memory carries between tiles). The backward keeps the state at every chunk
// start (chunk: the primitive's chunk_size, rounded up to whole tiles), then walks the
// chunks in reverse: it re-runs the forward over the chunk (the state entering each of its
// tiles into a per-row scratch) and scans the adjoint g_t = dL/dh_t backwards tile by tile
// (a reverse warp scan of c_t = a_t (c_{t+1} + dy_t C_t)). d_B and d_C sum over the
// channels of a group: the warps of a block (channels of one group) add theirs in shared
// memory, then one fp32 atomicAdd per element and block (so the order of the block sums
// varies between runs, as in mamba_ssm). d_A, d_D and d_dt_bias are per-row partials.
#include "common.cuh"
#include "mamba.h"

namespace modulec {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kConvThreads = 256;
constexpr int kMaxConvWidth = 8;
constexpr int kLaneSteps = 4;
constexpr int kTile = 32 * kLaneSteps;
constexpr int kForwardWarps = 4;

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|))
__device__ __forceinline__ float softplus_f(float x) {
  return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));
}

// ------------------------------------------------------------------------------ conv1d
// xp(s), s in [0, T + W - 1): conv_state[s] for s < W - 1 (zero without one), else x[s - W + 1]
template <typename T>
__device__ __forceinline__ float padded(const T* x, const T* state, int64_t s, int W) {
  if (s >= W - 1) return to_float(x[s - (W - 1)]);
  return state ? to_float(state[s]) : 0.f;
}

template <typename T>
__device__ __forceinline__ float conv_at(const T* x, const T* state,
                                         const float (&w)[kMaxConvWidth], float bias, int64_t t,
                                         int W) {
  float z = bias;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j)
    if (j < W) z += w[j] * padded(x, state, t + j, W);
  return z;
}

__device__ __forceinline__ float silu_grad(float z) {
  const float s = sigmoid_f(z);
  return s * (1.f + z * (1.f - s));
}

struct ConvRow {
  float w[kMaxConvWidth];
  float bias;
};

__device__ __forceinline__ ConvRow conv_row(const float* weight, const float* bias, int64_t d,
                                            int W) {
  ConvRow r;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) r.w[j] = j < W ? weight[d * W + j] : 0.f;
  r.bias = bias ? bias[d] : 0.f;
  return r;
}

template <typename T>
__global__ void conv_forward_kernel(const T* __restrict__ x, const float* __restrict__ weight,
                                    const float* __restrict__ bias, const T* __restrict__ state,
                                    T* __restrict__ y, int64_t D, int64_t len, int W, bool silu) {
  const int64_t row = blockIdx.x;
  const ConvRow r = conv_row(weight, bias, row % D, W);
  const T* xr = x + row * len;
  const T* sr = state ? state + row * (W - 1) : nullptr;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
    const float z = conv_at(xr, sr, r.w, r.bias, t, W);
    y[row * len + t] = from_float<T>(silu ? z * sigmoid_f(z) : z);
  }
}

// d_x[t] = sum_j w[j] dz[t + W - 1 - j] (dz = d_y * act'(z)); partial[row] = (sum_t dz[t]
// xp[t + j] for each j, sum_t dz[t])
template <typename T>
__global__ void conv_backward_kernel(const T* __restrict__ d_y, const T* __restrict__ x,
                                     const float* __restrict__ weight,
                                     const float* __restrict__ bias, const T* __restrict__ state,
                                     T* __restrict__ d_x, float* __restrict__ partial, int64_t D,
                                     int64_t len, int W, bool silu) {
  const int64_t row = blockIdx.x;
  const ConvRow r = conv_row(weight, bias, row % D, W);
  const T* xr = x + row * len;
  const T* gr = d_y + row * len;
  const T* sr = state ? state + row * (W - 1) : nullptr;
  float dw[kMaxConvWidth] = {};
  float db = 0.f;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
    float dx = 0.f, own = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j) {
      const int64_t s = t + W - 1 - j;
      if (j >= W || s >= len) continue;
      float dz = to_float(gr[s]);
      if (silu) dz *= silu_grad(conv_at(xr, sr, r.w, r.bias, s, W));
      dx += r.w[j] * dz;
      if (j == W - 1) own = dz;  // s == t
    }
    d_x[row * len + t] = from_float<T>(dx);
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j)
      if (j < W) dw[j] += own * padded(xr, sr, t + j, W);
    db += own;
  }
  float* out = partial + row * (W + 1);
  for (int j = 0; j < W; ++j) {
    const float s = block_sum(dw[j]);
    if (threadIdx.x == 0) out[j] = s;
  }
  const float s = block_sum(db);
  if (threadIdx.x == 0) out[W] = s;
}

// ------------------------------------------------------------------------ selective scan
// The pointers of one row (batch b, channel d, group g).
template <typename T>
struct ScanRow {
  const T* u;
  const T* delta;
  const T* B;  // [N, T] of group g
  const T* C;
  const float* A;  // [N]
  float D, dt_bias;
  int64_t row, batch, channel, group;
};

template <typename T>
__device__ __forceinline__ ScanRow<T> scan_row(const MambaScan& s, int64_t row) {
  ScanRow<T> r;
  r.row = row;
  r.batch = row / s.channels;
  r.channel = row % s.channels;
  r.group = r.channel / (s.channels / s.groups);
  r.u = static_cast<const T*>(s.u) + row * s.T;
  r.delta = static_cast<const T*>(s.delta) + row * s.T;
  const int64_t bc = (r.batch * s.groups + r.group) * s.N * s.T;
  r.B = static_cast<const T*>(s.B) + bc;
  r.C = static_cast<const T*>(s.C) + bc;
  r.A = s.A + r.channel * s.N;
  r.D = s.D[r.channel];
  r.dt_bias = s.dt_bias[r.channel];
  return r;
}

// Inclusive scan over lanes of h -> a h + b, lower lanes applied first.
__device__ __forceinline__ void scan_up(float& a, float& b, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float pa = __shfl_up_sync(kFull, a, off), pb = __shfl_up_sync(kFull, b, off);
    if (lane >= off) {
      b = a * pb + b;
      a = a * pa;
    }
  }
}

// Inclusive scan over lanes of c -> a c + b, higher lanes applied first (the reverse scan).
__device__ __forceinline__ void scan_down(float& a, float& b, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float na = __shfl_down_sync(kFull, a, off), nb = __shfl_down_sync(kFull, b, off);
    if (lane + off < 32) {
      b = a * nb + b;
      a = a * na;
    }
  }
}

// The lane's steps of a tile: u, dt = softplus(delta + dt_bias), and which are in range.
template <typename T>
struct LaneSteps {
  float u[kLaneSteps], dt[kLaneSteps], raw[kLaneSteps];  // raw: delta + dt_bias
  bool valid[kLaneSteps];

  __device__ __forceinline__ LaneSteps(const ScanRow<T>& r, int64_t t0, int64_t len) {
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) {
      const int64_t t = t0 + k;
      valid[k] = t < len;
      u[k] = valid[k] ? to_float(r.u[t]) : 0.f;
      raw[k] = valid[k] ? to_float(r.delta[t]) + r.dt_bias : 0.f;
      dt[k] = valid[k] ? softplus_f(raw[k]) : 0.f;
    }
  }
};

// The state-n coefficients of the lane's steps: a = exp(dt A_n), b = dt B_n u (identity
// a = 1, b = 0 past the end), and B_n, C_n themselves.
template <typename T>
struct StateSteps {
  float a[kLaneSteps], b[kLaneSteps], Bn[kLaneSteps], Cn[kLaneSteps];

  __device__ __forceinline__ StateSteps(const ScanRow<T>& r, const LaneSteps<T>& s, int64_t n,
                                        int64_t t0, int64_t len) {
    const float An = r.A[n];
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) {
      const int64_t t = t0 + k;
      Bn[k] = s.valid[k] ? to_float(r.B[n * len + t]) : 0.f;
      Cn[k] = s.valid[k] ? to_float(r.C[n * len + t]) : 0.f;
      a[k] = s.valid[k] ? expf(s.dt[k] * An) : 1.f;
      b[k] = s.dt[k] * Bn[k] * s.u[k];
    }
  }

  // (a, b) of the lane's steps composed, first step applied first
  __device__ __forceinline__ void compose(float& ca, float& cb) const {
    ca = 1.f;
    cb = 0.f;
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) {
      cb = a[k] * cb + b[k];
      ca = a[k] * ca;
    }
  }
};

// The state entering the lane's first step, given the state h0 entering the tile.
__device__ __forceinline__ float lane_entry(float ca, float cb, float h0, int lane) {
  scan_up(ca, cb, lane);
  float ea = __shfl_up_sync(kFull, ca, 1), eb = __shfl_up_sync(kFull, cb, 1);
  if (lane == 0) {
    ea = 1.f;
    eb = 0.f;
  }
  return ea * h0 + eb;
}

// carry[n] (shared, this warp's N states) advanced over the tile starting at t_start.
template <typename T>
__device__ void advance_tile(const ScanRow<T>& r, int64_t N, int64_t t_start, int64_t len,
                             float* carry, int lane) {
  const int64_t t0 = t_start + lane * kLaneSteps;
  const LaneSteps<T> s(r, t0, len);
  for (int64_t n = 0; n < N; ++n) {
    const StateSteps<T> c(r, s, n, t0, len);
    float ca, cb;
    c.compose(ca, cb);
    scan_up(ca, cb, lane);
    const float ta = __shfl_sync(kFull, ca, 31), tb = __shfl_sync(kFull, cb, 31);
    const float h0 = carry[n];
    __syncwarp();
    if (lane == 0) carry[n] = ta * h0 + tb;
    __syncwarp();
  }
}

template <typename T>
__global__ void scan_forward_kernel(MambaScan s, T* __restrict__ y, float* __restrict__ state_out) {
  extern __shared__ float shared[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kForwardWarps + warp;
  if (row >= s.batch * s.channels) return;  // the whole warp: no block barrier below
  const ScanRow<T> r = scan_row<T>(s, row);
  float* carry = shared + warp * s.N;
  for (int64_t n = lane; n < s.N; n += 32) carry[n] = s.state ? s.state[row * s.N + n] : 0.f;
  __syncwarp();
  for (int64_t t_start = 0; t_start < s.T; t_start += kTile) {
    const int64_t t0 = t_start + lane * kLaneSteps;
    const LaneSteps<T> st(r, t0, s.T);
    float out[kLaneSteps];
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) out[k] = r.D * st.u[k];
    for (int64_t n = 0; n < s.N; ++n) {
      const StateSteps<T> c(r, st, n, t0, s.T);
      float ca, cb;
      c.compose(ca, cb);
      float h = lane_entry(ca, cb, carry[n], lane);
#pragma unroll
      for (int k = 0; k < kLaneSteps; ++k) {
        h = c.a[k] * h + c.b[k];
        out[k] += c.Cn[k] * h;
      }
      const float last = __shfl_sync(kFull, h, 31);
      __syncwarp();
      if (lane == 0) carry[n] = last;
      __syncwarp();
    }
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k)
      if (st.valid[k]) y[row * s.T + t0 + k] = from_float<T>(out[k]);
  }
  if (state_out)
    for (int64_t n = lane; n < s.N; n += 32) state_out[row * s.N + n] = carry[n];
}

// The backward's outputs and scratch.
struct ScanGrads {
  void* d_u;
  void* d_delta;
  float* d_A;       // [batch, channels, N] partials
  float* d_B;       // [batch, G, N, T], zeroed by the caller (atomics)
  float* d_C;
  float* d_D;       // [batch, channels] partials
  float* d_dt_bias; // [batch, channels] partials
  float* checkpoints;  // [rows, chunks, N]
  float* scratch;      // [rows, tiles per chunk, N]
};

// Per warp, in shared memory: h[N] (forward carry), c[N] (adjoint carry), dA[N]; per block
// the d_B / d_C tile of each warp: red[warps][2][kTile].
struct BackwardShared {
  float *h, *c, *dA, *red;
};

// One tile of the adjoint scan (state by state), adding into the lane's d_u / d_dt.
template <typename T>
__device__ void backward_tile(const MambaScan& s, const ScanRow<T>& r, const T* dy_row,
                              const ScanGrads& g, const float* h_start, int64_t t_start,
                              const BackwardShared& sh, int warps, int warp, int lane) {
  const int64_t len = s.T, t0 = t_start + lane * kLaneSteps;
  const LaneSteps<T> st(r, t0, len);
  float dy[kLaneSteps], d_u[kLaneSteps], d_dt[kLaneSteps] = {};
#pragma unroll
  for (int k = 0; k < kLaneSteps; ++k) {
    dy[k] = st.valid[k] ? to_float(dy_row[t0 + k]) : 0.f;
    d_u[k] = r.D * dy[k];
  }
  for (int64_t n = 0; n < s.N; ++n) {
    const StateSteps<T> c(r, st, n, t0, len);
    const float An = r.A[n];
    float ca, cb;
    c.compose(ca, cb);
    float h = lane_entry(ca, cb, h_start[n], lane);
    float hp[kLaneSteps];  // the state entering each step
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) {
      hp[k] = h;
      h = c.a[k] * h + c.b[k];
    }
    // c_t = a_t (c_{t+1} + dy_t C_t): the lane's map from the c after its steps
    float ra = 1.f, rb = 0.f;
#pragma unroll
    for (int k = kLaneSteps - 1; k >= 0; --k) {
      rb = c.a[k] * (rb + dy[k] * c.Cn[k]);
      ra = c.a[k] * ra;
    }
    scan_down(ra, rb, lane);
    float sa = __shfl_down_sync(kFull, ra, 1), sb = __shfl_down_sync(kFull, rb, 1);
    if (lane == 31) {
      sa = 1.f;
      sb = 0.f;
    }
    float adj = sa * sh.c[warp * s.N + n] + sb;
    float dA = 0.f, dB[kLaneSteps], dC[kLaneSteps];
#pragma unroll
    for (int k = kLaneSteps - 1; k >= 0; --k) {
      const float gh = adj + dy[k] * c.Cn[k];  // dL/dh_t
      const float dlog = gh * hp[k] * c.a[k];  // dL/d(dt A_n)
      d_dt[k] += dlog * An + gh * c.Bn[k] * st.u[k];
      d_u[k] += gh * st.dt[k] * c.Bn[k];
      dA += dlog * st.dt[k];
      dB[k] = gh * st.dt[k] * st.u[k];
      dC[k] = dy[k] * (c.a[k] * hp[k] + c.b[k]);
      adj = c.a[k] * gh;
    }
    const float entry = __shfl_sync(kFull, adj, 0);
    dA = warp_sum(dA);
    __syncwarp();
    if (lane == 0) {
      sh.c[warp * s.N + n] = entry;
      sh.dA[warp * s.N + n] += dA;
    }
    float* red = sh.red + warp * 2 * kTile;
#pragma unroll
    for (int k = 0; k < kLaneSteps; ++k) {
      red[lane * kLaneSteps + k] = dB[k];
      red[kTile + lane * kLaneSteps + k] = dC[k];
    }
    __syncthreads();
    const int64_t bc = ((r.batch * s.groups + r.group) * s.N + n) * len;
    for (int i = threadIdx.x; i < 2 * kTile; i += blockDim.x) {
      const int64_t t = t_start + (i % kTile);
      if (t >= len) continue;
      float sum = 0.f;
      for (int w = 0; w < warps; ++w) sum += sh.red[w * 2 * kTile + i];
      atomicAdd((i < kTile ? g.d_B : g.d_C) + bc + t, sum);
    }
    __syncthreads();
  }
  T* du = static_cast<T*>(g.d_u) + r.row * len;
  T* dd = static_cast<T*>(g.d_delta) + r.row * len;
  float dD = 0.f, dbias = 0.f;
#pragma unroll
  for (int k = 0; k < kLaneSteps; ++k) {
    if (!st.valid[k]) continue;
    const float d_delta = d_dt[k] * sigmoid_f(st.raw[k]);  // softplus' = sigmoid
    du[t0 + k] = from_float<T>(d_u[k]);
    dd[t0 + k] = from_float<T>(d_delta);
    dD += dy[k] * st.u[k];
    dbias += d_delta;
  }
  dD = warp_sum(dD);
  dbias = warp_sum(dbias);
  if (lane == 0) {
    g.d_D[r.row] += dD;
    g.d_dt_bias[r.row] += dbias;
  }
}

// Block: `warps` channels of one group and batch (grid: channels / warps, batch).
template <typename T>
__global__ void scan_backward_kernel(MambaScan s, const T* __restrict__ d_y, ScanGrads g,
                                     int64_t tiles_per_chunk) {
  extern __shared__ float shared[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t N = s.N;
  BackwardShared sh{shared, shared + warps * N, shared + 2 * warps * N, shared + 3 * warps * N};
  const int64_t channel = static_cast<int64_t>(blockIdx.x) * warps + warp;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * s.channels + channel;
  const ScanRow<T> r = scan_row<T>(s, row);
  const T* dy_row = d_y + row * s.T;
  float* h = sh.h + warp * N;
  const int64_t tiles = (s.T + kTile - 1) / kTile;
  const int64_t chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  float* ckpt = g.checkpoints + row * chunks * N;
  float* scratch = g.scratch + row * tiles_per_chunk * N;
  for (int64_t n = lane; n < N; n += 32) {
    h[n] = s.state ? s.state[row * N + n] : 0.f;
    sh.c[warp * N + n] = 0.f;
    sh.dA[warp * N + n] = 0.f;
  }
  if (lane == 0) {
    g.d_D[row] = 0.f;
    g.d_dt_bias[row] = 0.f;
  }
  __syncwarp();
  // the state at every chunk start
  for (int64_t tile = 0; tile < tiles; ++tile) {
    if (tile % tiles_per_chunk == 0)
      for (int64_t n = lane; n < N; n += 32) ckpt[(tile / tiles_per_chunk) * N + n] = h[n];
    __syncwarp();
    advance_tile(r, N, tile * kTile, s.T, h, lane);
  }
  for (int64_t chunk = chunks - 1; chunk >= 0; --chunk) {
    const int64_t first = chunk * tiles_per_chunk;
    const int64_t end = first + tiles_per_chunk < tiles ? first + tiles_per_chunk : tiles;
    for (int64_t n = lane; n < N; n += 32) h[n] = ckpt[chunk * N + n];
    __syncwarp();
    for (int64_t tile = first; tile < end; ++tile) {  // the forward again, over the chunk
      for (int64_t n = lane; n < N; n += 32) scratch[(tile - first) * N + n] = h[n];
      __syncwarp();
      advance_tile(r, N, tile * kTile, s.T, h, lane);
    }
    for (int64_t tile = end - 1; tile >= first; --tile)
      backward_tile(s, r, dy_row, g, scratch + (tile - first) * N, tile * kTile, sh, warps, warp,
                    lane);
  }
  __syncwarp();
  for (int64_t n = lane; n < N; n += 32) g.d_A[row * N + n] = sh.dA[warp * N + n];
}

template <typename T>
cudaError_t conv_typed(bool backward, const void* d_y, const void* x, const float* weight,
                       const float* bias, const void* state, void* out, float* partial,
                       int64_t B, int64_t D, int64_t len, int W, bool silu, cudaStream_t stream) {
  const unsigned rows = static_cast<unsigned>(B * D);
  if (backward)
    conv_backward_kernel<T><<<rows, kConvThreads, 0, stream>>>(
        static_cast<const T*>(d_y), static_cast<const T*>(x), weight, bias,
        static_cast<const T*>(state), static_cast<T*>(out), partial, D, len, W, silu);
  else
    conv_forward_kernel<T><<<rows, kConvThreads, 0, stream>>>(
        static_cast<const T*>(x), weight, bias, static_cast<const T*>(state),
        static_cast<T*>(out), D, len, W, silu);
  return cudaGetLastError();
}

// warps per backward block: the most (up to 8) that divide the channels of a group
int backward_warps(const MambaScan& s) {
  const int64_t per_group = s.channels / s.groups;
  for (int w = 8; w > 1; w >>= 1)
    if (per_group % w == 0) return w;
  return 1;
}

int64_t tiles_per_chunk(int64_t chunk) {
  return chunk <= kTile ? 1 : (chunk + kTile - 1) / kTile;
}

}  // namespace

cudaError_t launch_mamba_conv1d_forward(DType dt, const void* x, const float* weight,
                                        const float* bias, const void* conv_state, void* y,
                                        int64_t B, int64_t D, int64_t T, int W, bool silu,
                                        cudaStream_t stream) {
  if (B * D == 0 || T == 0) return cudaSuccess;
  if (W < 1 || W > kMaxConvWidth) return cudaErrorInvalidValue;
  if (dt == DType::BF16)
    return conv_typed<__nv_bfloat16>(false, nullptr, x, weight, bias, conv_state, y, nullptr, B,
                                     D, T, W, silu, stream);
  return conv_typed<float>(false, nullptr, x, weight, bias, conv_state, y, nullptr, B, D, T, W,
                           silu, stream);
}

cudaError_t launch_mamba_conv1d_backward(DType dt, const void* d_y, const void* x,
                                         const float* weight, const float* bias,
                                         const void* conv_state, void* d_x, float* partial,
                                         int64_t B, int64_t D, int64_t T, int W, bool silu,
                                         cudaStream_t stream) {
  if (B * D == 0) return cudaSuccess;
  if (W < 1 || W > kMaxConvWidth) return cudaErrorInvalidValue;
  if (dt == DType::BF16)
    return conv_typed<__nv_bfloat16>(true, d_y, x, weight, bias, conv_state, d_x, partial, B, D,
                                     T, W, silu, stream);
  return conv_typed<float>(true, d_y, x, weight, bias, conv_state, d_x, partial, B, D, T, W,
                           silu, stream);
}

int64_t mamba_scan_backward_workspace(const MambaScan& s, int64_t chunk) {
  const int64_t tiles = (s.T + kTile - 1) / kTile, per = tiles_per_chunk(chunk);
  const int64_t chunks = (tiles + per - 1) / per;
  return s.batch * s.channels * (chunks + per) * s.N;
}

cudaError_t launch_mamba_scan_forward(DType dt, const MambaScan& s, void* y, float* state_out,
                                      cudaStream_t stream) {
  const int64_t rows = s.batch * s.channels;
  if (rows == 0) return cudaSuccess;
  if (s.groups < 1 || s.channels % s.groups || s.N < 1) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((rows + kForwardWarps - 1) / kForwardWarps);
  const size_t smem = kForwardWarps * s.N * sizeof(float);
  if (dt == DType::BF16)
    scan_forward_kernel<__nv_bfloat16><<<blocks, 32 * kForwardWarps, smem, stream>>>(
        s, static_cast<__nv_bfloat16*>(y), state_out);
  else
    scan_forward_kernel<float><<<blocks, 32 * kForwardWarps, smem, stream>>>(
        s, static_cast<float*>(y), state_out);
  return cudaGetLastError();
}

cudaError_t launch_mamba_scan_backward(DType dt, const MambaScan& s, const void* d_y,
                                       int64_t chunk, const MambaScanGrads& out,
                                       float* workspace, cudaStream_t stream) {
  if (s.batch * s.channels == 0 || s.T == 0) return cudaSuccess;
  if (s.groups < 1 || s.channels % s.groups || s.N < 1) return cudaErrorInvalidValue;
  const int warps = backward_warps(s);
  const int64_t per = tiles_per_chunk(chunk);
  const int64_t tiles = (s.T + kTile - 1) / kTile, chunks = (tiles + per - 1) / per;
  ScanGrads g{out.d_u, out.d_delta, out.d_A, out.d_B, out.d_C, out.d_D, out.d_dt_bias,
              workspace, workspace + s.batch * s.channels * chunks * s.N};
  const dim3 grid(static_cast<unsigned>(s.channels / warps), static_cast<unsigned>(s.batch));
  const size_t smem = (3 * warps * s.N + warps * 2 * kTile) * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  if (dt == DType::BF16)
    scan_backward_kernel<__nv_bfloat16><<<grid, 32 * warps, smem, stream>>>(
        s, static_cast<const __nv_bfloat16*>(d_y), g, per);
  else
    scan_backward_kernel<float><<<grid, 32 * warps, smem, stream>>>(
        s, static_cast<const float*>(d_y), g, per);
  return cudaGetLastError();
}

}  // namespace modulec
