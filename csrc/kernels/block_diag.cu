// block_diag forward and backward (std/primitives/block_diag.module): matrices laid along
// the diagonal of y, zeros elsewhere, with bands of zero rows between them (LoRA's
// block-diagonal B of a fused projection, modulec/lower/lora.py). One launch each way:
// the forward writes every element of y once (its block's element, or zero), the backward
// copies each block out of d_y into its own contiguous gradient. Every tensor is row-major
// and contiguous; the kernels copy bits, so one kernel serves every 2- and 4-byte dtype
// (a zero's bits are zero in bf16, fp16 and fp32). The matrices are small (a LoRA B is
// rows x rank): one thread per element, no vector loads.
#include <cstdint>

#include "kernels.h"

namespace modulec {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 4096;

template <typename Bits>
__global__ void block_diag_forward_kernel(Blocks blocks, Bits* __restrict__ y, int64_t rows,
                                          int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    Bits value = 0;
    for (int b = 0; b < blocks.n; ++b) {
      const int64_t dr = r - blocks.row[b], dc = c - blocks.col[b];
      if (dr >= 0 && dr < blocks.rows[b] && dc >= 0 && dc < blocks.cols[b]) {
        value = static_cast<const Bits*>(blocks.ptr[b])[dr * blocks.cols[b] + dc];
        break;
      }
    }
    y[i] = value;
  }
}

// block b's elements are [start[b], start[b + 1]) of one index space over all blocks
template <typename Bits>
__global__ void block_diag_backward_kernel(Blocks blocks, const Bits* __restrict__ d_y,
                                           int64_t cols) {
  const int64_t total = blocks.start[blocks.n];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int b = 0;
    while (b + 1 < blocks.n && i >= blocks.start[b + 1]) ++b;
    const int64_t j = i - blocks.start[b];
    const int64_t r = j / blocks.cols[b], c = j % blocks.cols[b];
    static_cast<Bits*>(blocks.ptr[b])[j] = d_y[(blocks.row[b] + r) * cols + blocks.col[b] + c];
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

// launch(Bits{}) with the unsigned type of `itemsize` bytes (2 or 4); else invalid
template <typename Launch>
cudaError_t by_itemsize(int itemsize, Launch launch) {
  if (itemsize == 2) {
    launch(uint16_t{});
  } else if (itemsize == 4) {
    launch(uint32_t{});
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_block_diag_forward(int itemsize, const Blocks& blocks, void* y,
                                      int64_t rows, int64_t cols, cudaStream_t stream) {
  if (blocks.n < 1 || blocks.n > kMaxBlocks) return cudaErrorInvalidValue;
  if (rows * cols == 0) return cudaSuccess;
  return by_itemsize(itemsize, [&](auto zero) {
    using Bits = decltype(zero);
    block_diag_forward_kernel<Bits><<<grid_for(rows * cols), kThreads, 0, stream>>>(
        blocks, static_cast<Bits*>(y), rows, cols);
  });
}

cudaError_t launch_block_diag_backward(int itemsize, const Blocks& blocks, const void* d_y,
                                       int64_t cols, cudaStream_t stream) {
  if (blocks.n < 1 || blocks.n > kMaxBlocks) return cudaErrorInvalidValue;
  const int64_t total = blocks.start[blocks.n];
  if (total == 0) return cudaSuccess;
  return by_itemsize(itemsize, [&](auto zero) {
    using Bits = decltype(zero);
    block_diag_backward_kernel<Bits><<<grid_for(total), kThreads, 0, stream>>>(
        blocks, static_cast<const Bits*>(d_y), cols);
  });
}

}  // namespace modulec
