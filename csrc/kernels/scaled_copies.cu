// Many small 2-D copies, each scaled, in one launch: dst = alpha * src, bf16 rows of
// `cols` elements (a multiple of 8), each side with its own row stride. The LoRA step's
// side slots (runtime/cuda/lora_kcat.py `refresh_slots`): at the step's start every
// adapted weight's s B goes into the k r columns laid beside its rows and down_proj's A
// into the rows after it: ~200 copies of 16-256 KB that ran as one torch launch each
// (2.6-3.5 us a call in the LoRA 8B replay, most of it launch and tail). The table lives
// in device memory (`ScaledCopy` rows, made once by the caller): a captured graph replays
// this launch with the same table. blockIdx.y picks the copy, blockIdx.x strides over its
// 16-byte pieces; the product is taken in fp32 and rounded once (as torch.mul(src, alpha)).
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels.h"

namespace modulec {
namespace {

constexpr int kThreads = 256;
constexpr int kPiece = 8;  // bf16 a 16-byte piece

__global__ void scaled_copies_kernel(const ScaledCopy* __restrict__ table) {
  const ScaledCopy c = table[blockIdx.y];
  const int64_t per_row = c.cols / kPiece, pieces = c.rows * per_row;
  const auto* src = static_cast<const __nv_bfloat16*>(c.src);
  auto* dst = static_cast<__nv_bfloat16*>(c.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / per_row, col = (i - r * per_row) * kPiece;
    uint4 bits = *reinterpret_cast<const uint4*>(src + r * c.src_ld + col);
    if (c.alpha != 1.0f) {
      auto* v = reinterpret_cast<__nv_bfloat16*>(&bits);
#pragma unroll
      for (int j = 0; j < kPiece; ++j) v[j] = __float2bfloat16(c.alpha * __bfloat162float(v[j]));
    }
    *reinterpret_cast<uint4*>(dst + r * c.dst_ld + col) = bits;
  }
}

}  // namespace

cudaError_t launch_scaled_copies(const ScaledCopy* table, int count, int64_t most_pieces,
                                 cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > 65535) return cudaErrorInvalidValue;
  const int64_t blocks = (most_pieces + kThreads - 1) / kThreads;
  const unsigned grid_x = static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 64 ? 64 : blocks));
  scaled_copies_kernel<<<dim3(grid_x, static_cast<unsigned>(count)), kThreads, 0, stream>>>(
      table);
  return cudaGetLastError();
}

}  // namespace modulec
