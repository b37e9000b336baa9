// Helpers the torch bindings share (csrc/bindings.cpp, bindings_fusions.cpp): dtype and
// tensor checks, launch errors, the current stream, and where a kernel writes its outputs.
#pragma once

#include <optional>
#include <vector>

#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernels/kernels.h"

namespace modulec {
namespace bind {

using at::Tensor;

inline DType dtype_of(const Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::BF16;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "modulec CUDA kernels take bf16 or fp32, got ",
              t.scalar_type());
  return DType::F32;
}

// The fp8 format an FP8 binding's `fmt` names: 0 E4M3, 1 E5M2.
inline at::ScalarType fp8_dtype(int64_t fmt) {
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (E4M3) or 1 (E5M2)");
  return fmt == 0 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

inline void check(const Tensor& t, const char* name, at::ScalarType dtype, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", not ", like.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Where a kernel writes its outputs: out[i] (the arena's planned bytes, typed and shaped
// by the caller) or, absent, a new tensor. A given one that does not match is a bug.
using Outputs = std::vector<std::optional<Tensor>>;

inline Tensor output(const Outputs& out, size_t i, at::IntArrayRef sizes,
              const at::TensorOptions& options) {
  if (i >= out.size() || !out[i]) return at::empty(sizes, options);
  const Tensor& t = *out[i];
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == options.dtype().toScalarType() &&
                  t.device() == options.device() && t.is_contiguous(),
              "out[", i, "] is ", t.sizes(), " ", t.scalar_type(), ", the kernel writes ", sizes,
              " ", options.dtype());
  return t;
}

// x [*, C] as rows x C; rstd has the leading dims
inline std::vector<int64_t> leading(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "expected at least one dim");
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// layernorm, gelu and softmax (bindings_fusions.cpp), added to the module bindings.cpp makes
void register_fusions(pybind11::module_& m);
// fp8_amax_scale (bindings_fp8.cpp)
void register_fp8(pybind11::module_& m);
// adamw_split_list (bindings_optim.cpp)
void register_optim(pybind11::module_& m);
// block_diag forward and backward (bindings_tensor.cpp)
void register_tensor(pybind11::module_& m);
// gemm_candidates and gemm_run: cuBLASLt with a chosen algorithm (bindings_gemm.cpp)
void register_gemm(pybind11::module_& m);

}  // namespace bind
}  // namespace modulec
