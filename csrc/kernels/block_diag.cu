// block_diag forward and backward (std/primitives/block_diag.module): matrices laid along
// the diagonal of y, zeros elsewhere, with bands of zero rows between them (LoRA's
// block-diagonal B of a fused projection, modulec/lower/lora.py). One launch each way:
// the forward writes every element of y once (its block's element, or zero), the backward
// copies each block out of d_y into its own contiguous gradient. Every tensor is row-major
// and contiguous; the kernels copy bits, so one kernel serves every 2- and 4-byte dtype
// (a zero's bits are zero in bf16, fp16 and fp32). Where every row (y's and each block's)
// is whole 16-byte pieces and every pointer 16-byte aligned (LoRA's B: 16-wide blocks of
// bf16) the same kernels move a piece (uint4) a thread over the blocks' description in
// pieces (`in_pieces`): an element a thread took 3.6 us for q/k/v's B and 6.6 for
// gate/up's in the LoRA 8B replay, mostly for the loads' count.
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
    Bits value{};  // zero bits
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

// The blocks' description in 16-byte pieces of `per` elements, where it can be: every
// row whole pieces (y's `cols` too), every pointer (`y` and the blocks') aligned.
bool in_pieces(const Blocks& blocks, int itemsize, const void* y, int64_t cols, Blocks* out) {
  const int per = 16 / itemsize;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (cols % per != 0 || !aligned(y)) return false;
  *out = blocks;
  for (int b = 0; b < blocks.n; ++b) {
    if (blocks.cols[b] % per != 0 || !aligned(blocks.ptr[b])) return false;
    out->col[b] = blocks.col[b] / per;
    out->cols[b] = blocks.cols[b] / per;
  }
  for (int b = 0; b <= blocks.n; ++b) out->start[b] = blocks.start[b] / per;
  return true;
}

}  // namespace

cudaError_t launch_block_diag_forward(int itemsize, const Blocks& blocks, void* y,
                                      int64_t rows, int64_t cols, cudaStream_t stream) {
  if (blocks.n < 1 || blocks.n > kMaxBlocks) return cudaErrorInvalidValue;
  if (rows * cols == 0) return cudaSuccess;
  Blocks pieces;
  if (in_pieces(blocks, itemsize, y, cols, &pieces)) {
    const int64_t wide = cols / (16 / itemsize);
    block_diag_forward_kernel<uint4><<<grid_for(rows * wide), kThreads, 0, stream>>>(
        pieces, static_cast<uint4*>(y), rows, wide);
    return cudaGetLastError();
  }
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
  Blocks pieces;
  if (in_pieces(blocks, itemsize, d_y, cols, &pieces)) {
    block_diag_backward_kernel<uint4><<<grid_for(pieces.start[blocks.n]), kThreads, 0, stream>>>(
        pieces, static_cast<const uint4*>(d_y), cols / (16 / itemsize));
    return cudaGetLastError();
  }
  return by_itemsize(itemsize, [&](auto zero) {
    using Bits = decltype(zero);
    block_diag_backward_kernel<Bits><<<grid_for(total), kThreads, 0, stream>>>(
        blocks, static_cast<const Bits*>(d_y), cols);
  });
}

}  // namespace modulec
