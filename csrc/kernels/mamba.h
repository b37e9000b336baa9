// The host-side entry points of csrc/kernels/mamba.cu (mamba_conv1d, mamba_selective_scan),
// as kernels.h's: raw device pointers, sizes and a stream; each launcher returns the
// launch's cudaError_t. csrc/bindings_mamba.cpp wraps them on torch tensors.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "kernels.h"

namespace modulec {

// ---- mamba.cu: mamba_conv1d and mamba_selective_scan (std/primitives/mamba_*.module).
// Activations (x, u, delta, B, C, y and their gradients) in dt (bf16 or fp32), contiguous;
// the conv weight [D, W] and bias [D] (or null), A [channels, N], D and dt_bias
// [channels], states and every reduced gradient in fp32.
// conv1d over x [B, D, T]: y = act(bias + sum_j w[j] xp[t + j]), xp = [conv_state (or
// zeros) [B, D, W - 1] | x]; act SiLU when `silu`. W (kernel_size) at most 8.
cudaError_t launch_mamba_conv1d_forward(DType dt, const void* x, const float* weight,
                                        const float* bias, const void* conv_state, void* y,
                                        int64_t B, int64_t D, int64_t T, int W, bool silu,
                                        cudaStream_t stream);
// d_x, and partial fp32 [B, D, W + 1]: per row, sum_t dz[t] xp[t + j] for each j, then
// sum_t dz[t] (d_weight and d_bias once summed over the batch).
cudaError_t launch_mamba_conv1d_backward(DType dt, const void* d_y, const void* x,
                                         const float* weight, const float* bias,
                                         const void* conv_state, void* d_x, float* partial,
                                         int64_t B, int64_t D, int64_t T, int W, bool silu,
                                         cudaStream_t stream);

// The selective scan's inputs: u, delta [batch, channels, T]; B, C [batch, groups, N, T]
// (dt); A [channels, N], D, dt_bias [channels], state [batch, channels, N] or null (fp32).
struct MambaScan {
  const void* u = nullptr;
  const void* delta = nullptr;
  const float* A = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  const float* D = nullptr;
  const float* dt_bias = nullptr;
  const float* state = nullptr;
  int64_t batch = 0, channels = 0, groups = 1, N = 0, T = 0;
};

// The backward's outputs: d_u, d_delta (dt); fp32 partials d_A [batch, channels, N],
// d_D and d_dt_bias [batch, channels] (summed over the batch by the caller); d_B, d_C
// fp32 [batch, groups, N, T], zeroed by the caller (the kernel adds into them).
struct MambaScanGrads {
  void* d_u = nullptr;
  void* d_delta = nullptr;
  float* d_A = nullptr;
  float* d_B = nullptr;
  float* d_C = nullptr;
  float* d_D = nullptr;
  float* d_dt_bias = nullptr;
};

// y (dt) and, when state_out is non-null, the last state fp32 [batch, channels, N].
cudaError_t launch_mamba_scan_forward(DType dt, const MambaScan& s, void* y, float* state_out,
                                      cudaStream_t stream);
// fp32 workspace (in floats) of launch_mamba_scan_backward: the states at the chunk starts
// and the tile starts of one chunk, per row.
int64_t mamba_scan_backward_workspace(const MambaScan& s, int64_t chunk);
// chunk: the chunk_size (time steps between the states the backward keeps; rounded up to
// the kernel's 128-step tiles). N at most 256 (cudaErrorInvalidValue otherwise).
cudaError_t launch_mamba_scan_backward(DType dt, const MambaScan& s, const void* d_y,
                                       int64_t chunk, const MambaScanGrads& out,
                                       float* workspace, cudaStream_t stream);

}  // namespace modulec
