// A captured step's memset nodes as kernel nodes (runtime/cuda/graph_nodes.py).
//
// cuBLAS and cuDNN zero small workspaces and flags before many of their kernels; captured,
// each becomes a memset node, and in the replay of a LoRA 8B step (193 of them) the kernel
// after a memset starts 4-5 us after the memset ends, where a kernel after a kernel starts
// within ~1 us (benchmarks/gpu/graph_gaps.py). Here each 1-D or 2-D memset node is replaced
// by a node of `fill_kernel` writing the same bytes, with the same dependencies.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace modulec {
namespace {

// dst[row * pitch + i * elem] = value (elem bytes) for i < width, row < height
__global__ void fill_kernel(char* dst, size_t pitch, unsigned value, unsigned elem,
                            size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<size_t>(gridDim.x) * blockDim.x) {
    char* at = dst + (k / width) * pitch + (k % width) * elem;
    if (elem == 4)
      *reinterpret_cast<unsigned*>(at) = value;
    else if (elem == 2)
      *reinterpret_cast<unsigned short*>(at) = static_cast<unsigned short>(value);
    else
      *at = static_cast<char>(value);
  }
}

cudaError_t replace(cudaGraph_t graph, cudaGraphNode_t memset) {
  cudaMemsetParams p{};
  cudaError_t err = cudaGraphMemsetNodeGetParams(memset, &p);
  if (err != cudaSuccess) return err;
  size_t n_deps = 0, n_next = 0;
  if ((err = cudaGraphNodeGetDependencies(memset, nullptr, nullptr, &n_deps)) != cudaSuccess) return err;
  if ((err = cudaGraphNodeGetDependentNodes(memset, nullptr, nullptr, &n_next)) != cudaSuccess) return err;
  std::vector<cudaGraphNode_t> deps(n_deps), next(n_next);
  if (n_deps && (err = cudaGraphNodeGetDependencies(memset, deps.data(), nullptr, &n_deps)) != cudaSuccess)
    return err;
  if (n_next &&
      (err = cudaGraphNodeGetDependentNodes(memset, next.data(), nullptr, &n_next)) != cudaSuccess)
    return err;
  char* dst = static_cast<char*>(p.dst);
  size_t pitch = p.pitch, width = p.width, height = std::max<size_t>(p.height, 1);
  unsigned value = p.value, elem = p.elementSize;
  // bytes or halves over one dense run as 4-byte words of the value repeated
  const size_t bytes = width * elem;
  if (elem < 4 && (height == 1 || pitch == bytes) && bytes * height % 4 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
    value = elem == 1 ? (value & 0xffu) * 0x01010101u : (value & 0xffffu) * 0x00010001u;
    width = bytes * height / 4;
    height = 1;
    elem = 4;
    pitch = width * 4;
  }
  const size_t n = width * height;
  void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
  cudaKernelNodeParams k{};
  k.func = reinterpret_cast<void*>(fill_kernel);
  k.blockDim = dim3(256);
  k.gridDim = dim3(static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1024)));
  k.kernelParams = args;
  cudaGraphNode_t fill;
  if ((err = cudaGraphAddKernelNode(&fill, graph, deps.data(), n_deps, &k)) != cudaSuccess)
    return err;
  for (cudaGraphNode_t after : next)
    if ((err = cudaGraphAddDependencies(graph, &fill, &after, nullptr, 1)) != cudaSuccess) return err;
  return cudaGraphDestroyNode(memset);
}

}  // namespace

cudaError_t graph_memsets_to_kernels(cudaGraph_t graph, int* replaced) {
  *replaced = 0;
  size_t count = 0;
  cudaError_t err = cudaGraphGetNodes(graph, nullptr, &count);
  if (err != cudaSuccess) return err;
  std::vector<cudaGraphNode_t> nodes(count);
  if (count && (err = cudaGraphGetNodes(graph, nodes.data(), &count)) != cudaSuccess) return err;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    if ((err = cudaGraphNodeGetType(node, &type)) != cudaSuccess) return err;
    if (type != cudaGraphNodeTypeMemset) continue;
    if ((err = replace(graph, node)) != cudaSuccess) return err;
    ++*replaced;
  }
  return cudaSuccess;
}

}  // namespace modulec
