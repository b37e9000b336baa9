// swiglu and geglu forward and backward (std/primitives/swiglu.module, geglu.module):
// y = act(gate) * up with act silu (swiglu), or GELU in the tanh form or the exact erf
// form (geglu; Gemma's `gelu_pytorch_tanh` is the tanh form); `activation` picks one, the
// formulas are the reference's. Elementwise over tensors of one shape seen as rows x C,
// each with its own row stride (ld, in elements; the last dim is contiguous). So gate and up may be the two halves of
// the fused up projection [.., 2 * d_ff] (row stride 2 * d_ff) and the backward may write
// d_gate / d_up into the two halves of one [.., 2 * d_ff] buffer: no copy, no concat.
// A contiguous call passes rows = 1, C = n. One thread per VEC elements of a row; the
// 16-byte path needs aligned bases and row strides that are multiples of VEC; the last
// C % VEC elements of a row are done one by one by the thread that owns them. The backward
// may also write y (a non-null y: the recompute of y a backward that did not save it needs,
// fused into the pass that reads gate and up anyway; the same arithmetic as the forward's,
// so the same bits). The forward's
// FP8 kernel (bf16) also writes y's fp8 copy, y and y^T, under delayed scaling and takes
// y's amax (fp8.cuh DelayedSink; runtime/cuda/fp8_producers.py): 64 x 64 tiles of y.
#include "activations.cuh"
#include "fp8.cuh"

namespace modulec {
namespace {

constexpr int kThreads = 256;

template <int ACT>
__device__ __forceinline__ float swiglu_y(float g, float u) { return act<ACT>(g) * u; }

// d_gate = d_y * up * act'(g); d_up = d_y * act(g)
template <int ACT>
__device__ __forceinline__ void swiglu_grad(float dy, float g, float u, float& d_gate,
                                            float& d_up) {
  d_gate = dy * u * act_grad<ACT>(g);
  d_up = dy * act<ACT>(g);
}

struct Rows {
  int64_t rows, C, cv;  // cv: vectors per row (the last one maybe partial)
};

template <typename T, int VEC, int ACT>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, int64_t ld_g,
                                      const T* __restrict__ up, int64_t ld_u,
                                      T* __restrict__ y, int64_t ld_y, Rows s) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.rows * s.cv) return;
  const int64_t r = idx / s.cv, c = (idx - r * s.cv) * VEC;
  const T* g = gate + r * ld_g + c;
  const T* u = up + r * ld_u + c;
  T* o = y + r * ld_y + c;
  if (c + VEC <= s.C) {
    float gv[VEC], uv[VEC], ov[VEC];
    load_vec<T, VEC>(g, 0, gv);
    load_vec<T, VEC>(u, 0, uv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) ov[j] = swiglu_y<ACT>(gv[j], uv[j]);
    store_vec<T, VEC>(o, 0, ov);
  } else {
    for (int64_t j = 0; c + j < s.C; ++j)
      o[j] = from_float<T>(swiglu_y<ACT>(to_float(g[j]), to_float(u[j])));
  }
}

// y = act(gate) * up (bf16) and its fp8 copy: fp8_tile.cuh's 64 x 64 tiles of y [rows, C]
// (fp8_cast.cu's 8-wide structure, each thread 8 elements at a time), the fp8 tile kept in
// shared memory for y^T. The same fp32 arithmetic as swiglu_forward_kernel.
template <int ACT>
__global__ void swiglu_forward_fp8_kernel(const __nv_bfloat16* __restrict__ gate, int64_t ld_g,
                                          const __nv_bfloat16* __restrict__ up, int64_t ld_u,
                                          __nv_bfloat16* __restrict__ y, int64_t rows,
                                          int64_t C, Fp8Delayed d) {
  using T = __nv_bfloat16;
  __shared__ __align__(16) Fp8Tile tile;
  DelayedSink sink = delayed_sink(d);
  auto* q = static_cast<__nv_fp8_storage_t*>(d.out);
  const TileAt t = block_tile();
  for_each_chunk(t, rows, C, [&](const Chunk& k) {
    float gv[8], uv[8], ov[8];
    load_vec<T, 8>(gate + k.gr * ld_g + k.gc, 0, gv);
    load_vec<T, 8>(up + k.gr * ld_u + k.gc, 0, uv);
#pragma unroll
    for (int j = 0; j < 8; ++j) ov[j] = swiglu_y<ACT>(gv[j], uv[j]);
    store_vec<T, 8>(y + k.gr * C + k.gc, 0, ov);
#pragma unroll
    for (int j = 0; j < 8; ++j) ov[j] = to_float(from_float<T>(ov[j]));  // y as stored
    const Fp8x8 u = sink8(sink, ov);
    if (sink.write) put8<false>(tile, q, C, k, u);  // q: never null (the launch checks)
  });
  sink_finish<kVecThreads>(sink, d);  // every thread: no return above
  if (!sink.write || !d.out_t) return;
  __syncthreads();
  store_transposed(tile, static_cast<__nv_fp8_storage_t*>(d.out_t), t, rows, C);
}

// WITH_Y: also y = act(gate) * up into y (a template flag: the plain backward keeps its
// registers and its one branch). TAIL: rows may end in a partial vector, done one element
// at a time; without it (C a multiple of VEC) that loop's registers are not reserved: 40
// a thread instead of 48 for bf16 silu, 6 blocks a multiprocessor instead of 5 (LoRA 8B,
// alone on one H200: 82.8 -> 78 us)
template <typename T, int VEC, int ACT, bool WITH_Y, bool TAIL>
__global__ void swiglu_backward_kernel(const T* __restrict__ d_y, int64_t ld_dy,
                                       const T* __restrict__ gate, int64_t ld_g,
                                       const T* __restrict__ up, int64_t ld_u,
                                       T* __restrict__ d_gate, int64_t ld_dg,
                                       T* __restrict__ d_up, int64_t ld_du,
                                       T* __restrict__ y, int64_t ld_y, Rows s) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.rows * s.cv) return;
  const int64_t r = idx / s.cv, c = (idx - r * s.cv) * VEC;
  if (!TAIL || c + VEC <= s.C) {
    // every load issued before any arithmetic, each address formed where it is used
    float dy[VEC], gv[VEC], uv[VEC], dg[VEC], du[VEC];
    load_vec<T, VEC>(d_y + r * ld_dy + c, 0, dy);
    load_vec<T, VEC>(gate + r * ld_g + c, 0, gv);
    load_vec<T, VEC>(up + r * ld_u + c, 0, uv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) swiglu_grad<ACT>(dy[j], gv[j], uv[j], dg[j], du[j]);
    store_vec<T, VEC>(d_gate + r * ld_dg + c, 0, dg);
    store_vec<T, VEC>(d_up + r * ld_du + c, 0, du);
    if constexpr (WITH_Y) {
      float yv[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) yv[j] = swiglu_y<ACT>(gv[j], uv[j]);
      store_vec<T, VEC>(y + r * ld_y + c, 0, yv);
    }
  } else if constexpr (TAIL) {
    const T* dyp = d_y + r * ld_dy + c;
    const T* g = gate + r * ld_g + c;
    const T* u = up + r * ld_u + c;
    T* dgp = d_gate + r * ld_dg + c;
    T* dup = d_up + r * ld_du + c;
    T* yp = WITH_Y ? y + r * ld_y + c : nullptr;
    for (int64_t j = 0; c + j < s.C; ++j) {
      float dg, du;
      const float gj = to_float(g[j]), uj = to_float(u[j]);
      swiglu_grad<ACT>(to_float(dyp[j]), gj, uj, dg, du);
      dgp[j] = from_float<T>(dg);
      dup[j] = from_float<T>(du);
      if constexpr (WITH_Y) yp[j] = from_float<T>(swiglu_y<ACT>(gj, uj));
    }
  }
}

template <typename T>
bool wide_ok(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> lds,
             int64_t rows) {
  constexpr int wide = 16 / sizeof(T);
  if (pick_vec<T>(0, ptrs) != wide) return false;
  if (rows > 1)
    for (int64_t ld : lds)
      if (ld % wide) return false;
  return true;
}

Rows rows_of(int64_t rows, int64_t C, int vec) { return Rows{rows, C, (C + vec - 1) / vec}; }

unsigned blocks_for(const Rows& s) {
  return static_cast<unsigned>((s.rows * s.cv + kThreads - 1) / kThreads);
}

template <typename T, int ACT>
cudaError_t forward_typed(const void* gate, int64_t ld_g, const void* up, int64_t ld_u, void* y,
                          int64_t ld_y, int64_t rows, int64_t C, cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up);
  T* o = static_cast<T*>(y);
  if (wide_ok<T>({gate, up, y}, {ld_g, ld_u, ld_y}, rows)) {
    const Rows s = rows_of(rows, C, wide);
    swiglu_forward_kernel<T, wide, ACT>
        <<<blocks_for(s), kThreads, 0, st>>>(g, ld_g, u, ld_u, o, ld_y, s);
  } else {
    const Rows s = rows_of(rows, C, 1);
    swiglu_forward_kernel<T, 1, ACT>
        <<<blocks_for(s), kThreads, 0, st>>>(g, ld_g, u, ld_u, o, ld_y, s);
  }
  return cudaGetLastError();
}

// y (ld_y) may be null: the plain backward
template <typename T, int ACT>
cudaError_t backward_typed(const void* d_y, int64_t ld_dy, const void* gate, int64_t ld_g,
                           const void* up, int64_t ld_u, void* d_gate, int64_t ld_dg,
                           void* d_up, int64_t ld_du, void* y, int64_t ld_y, int64_t rows,
                           int64_t C, cudaStream_t st) {
  constexpr int wide = 16 / sizeof(T);
  auto args = [&](auto kernel, int vec) {
    const Rows s = rows_of(rows, C, vec);
    kernel<<<blocks_for(s), kThreads, 0, st>>>(
        static_cast<const T*>(d_y), ld_dy, static_cast<const T*>(gate), ld_g,
        static_cast<const T*>(up), ld_u, static_cast<T*>(d_gate), ld_dg, static_cast<T*>(d_up),
        ld_du, static_cast<T*>(y), ld_y, s);
  };
  // a null y is aligned (pick_vec's test); its ld is then only checked, never used
  const bool wide_path = wide_ok<T>({d_y, gate, up, d_gate, d_up, y},
                                    {ld_dy, ld_g, ld_u, ld_dg, ld_du, y ? ld_y : 0}, rows);
  const bool tail = C % wide != 0;
  if (y && wide_path)
    tail ? args(swiglu_backward_kernel<T, wide, ACT, true, true>, wide)
         : args(swiglu_backward_kernel<T, wide, ACT, true, false>, wide);
  else if (y)
    args(swiglu_backward_kernel<T, 1, ACT, true, false>, 1);
  else if (wide_path)
    tail ? args(swiglu_backward_kernel<T, wide, ACT, false, true>, wide)
         : args(swiglu_backward_kernel<T, wide, ACT, false, false>, wide);
  else
    args(swiglu_backward_kernel<T, 1, ACT, false, false>, 1);
  return cudaGetLastError();
}

template <int ACT>
cudaError_t forward_act(DType dt, const void* gate, int64_t ld_gate, const void* up,
                        int64_t ld_up, void* y, int64_t ld_y, int64_t rows, int64_t C,
                        cudaStream_t stream) {
  if (dt == DType::BF16)
    return forward_typed<__nv_bfloat16, ACT>(gate, ld_gate, up, ld_up, y, ld_y, rows, C, stream);
  return forward_typed<float, ACT>(gate, ld_gate, up, ld_up, y, ld_y, rows, C, stream);
}

template <int ACT>
cudaError_t backward_act(DType dt, const void* d_y, int64_t ld_dy, const void* gate,
                         int64_t ld_gate, const void* up, int64_t ld_up, void* d_gate,
                         int64_t ld_dgate, void* d_up, int64_t ld_dup, void* y, int64_t ld_y,
                         int64_t rows, int64_t C, cudaStream_t stream) {
  if (dt == DType::BF16)
    return backward_typed<__nv_bfloat16, ACT>(d_y, ld_dy, gate, ld_gate, up, ld_up, d_gate,
                                              ld_dgate, d_up, ld_dup, y, ld_y, rows, C, stream);
  return backward_typed<float, ACT>(d_y, ld_dy, gate, ld_gate, up, ld_up, d_gate, ld_dgate, d_up,
                                    ld_dup, y, ld_y, rows, C, stream);
}

}  // namespace

cudaError_t launch_swiglu_forward(DType dt, const void* gate, int64_t ld_gate, const void* up,
                                  int64_t ld_up, void* y, int64_t ld_y, int64_t rows, int64_t C,
                                  int activation, cudaStream_t stream) {
  if (rows * C == 0) return cudaSuccess;
  switch (activation) {
    case kSilu:
      return forward_act<kSilu>(dt, gate, ld_gate, up, ld_up, y, ld_y, rows, C, stream);
    case kGeluTanh:
      return forward_act<kGeluTanh>(dt, gate, ld_gate, up, ld_up, y, ld_y, rows, C, stream);
    case kGeluErf:
      return forward_act<kGeluErf>(dt, gate, ld_gate, up, ld_up, y, ld_y, rows, C, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_swiglu_backward(DType dt, const void* d_y, int64_t ld_dy, const void* gate,
                                   int64_t ld_gate, const void* up, int64_t ld_up,
                                   void* d_gate, int64_t ld_dgate, void* d_up, int64_t ld_dup,
                                   void* y, int64_t ld_y, int64_t rows, int64_t C,
                                   int activation, cudaStream_t stream) {
  if (rows * C == 0) return cudaSuccess;
  switch (activation) {
    case kSilu:
      return backward_act<kSilu>(dt, d_y, ld_dy, gate, ld_gate, up, ld_up, d_gate, ld_dgate, d_up,
                                 ld_dup, y, ld_y, rows, C, stream);
    case kGeluTanh:
      return backward_act<kGeluTanh>(dt, d_y, ld_dy, gate, ld_gate, up, ld_up, d_gate, ld_dgate,
                                     d_up, ld_dup, y, ld_y, rows, C, stream);
    case kGeluErf:
      return backward_act<kGeluErf>(dt, d_y, ld_dy, gate, ld_gate, up, ld_up, d_gate, ld_dgate,
                                    d_up, ld_dup, y, ld_y, rows, C, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_swiglu_forward_fp8(const void* gate, int64_t ld_gate, const void* up,
                                      int64_t ld_up, void* y, int64_t rows, int64_t C,
                                      int activation, const Fp8Delayed& d, cudaStream_t stream) {
  const auto aligned = [](const void* p, uintptr_t n) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  if (rows <= 0 || C <= 0 || rows % 8 || C % 8 || ld_gate % 8 || ld_up % 8 || !gate || !up ||
      !y || !aligned(gate, 16) || !aligned(up, 16) || !aligned(y, 16) || !d.out || !d.past ||
      !d.work || !aligned(d.out, 8) || !aligned(d.out_t, 8) || (d.fmt != 0 && d.fmt != 1) ||
      !tile_grid_fits(C))
    return cudaErrorInvalidValue;
  const dim3 grid = tile_grid(rows, C);
  const auto* g = static_cast<const __nv_bfloat16*>(gate);
  const auto* u = static_cast<const __nv_bfloat16*>(up);
  auto* o = static_cast<__nv_bfloat16*>(y);
  switch (activation) {
    case kSilu:
      swiglu_forward_fp8_kernel<kSilu>
          <<<grid, kVecThreads, 0, stream>>>(g, ld_gate, u, ld_up, o, rows, C, d);
      break;
    case kGeluTanh:
      swiglu_forward_fp8_kernel<kGeluTanh>
          <<<grid, kVecThreads, 0, stream>>>(g, ld_gate, u, ld_up, o, rows, C, d);
      break;
    case kGeluErf:
      swiglu_forward_fp8_kernel<kGeluErf>
          <<<grid, kVecThreads, 0, stream>>>(g, ld_gate, u, ld_up, o, rows, C, d);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_fp8_delayed_finish(y, d, false, rows, C, stream);  // no history: the cast
}

}  // namespace modulec
