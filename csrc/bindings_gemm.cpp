// GEMM bindings (registered by bindings.cpp's module, `register_gemm`): cuBLASLt with a
// chosen algorithm, and the skinny NT matmul's backward (kernels/skinny_grads.cu).
//
// cuBLASLt GEMMs run with an algorithm the caller picks from cuBLASLt's candidates:
// runtime/cuda/gemm.py times the
// candidates of each GEMM the step runs once, in an eager step, and keeps the fastest
// (or torch's own call); the CUDA graph then captures that choice.
//
// The workspace is torch's own for cuBLASLt (one per handle and stream, made by torch,
// valid in a captured graph as torch's own GEMMs use it).
//
// out[M, N] = alpha * a[M, K] @ b[K, N] + beta * out, operands 2-D with one unit stride
// each (a transpose is a view), out row-major; bf16 or fp16, fp32 accumulation. In
// cuBLASLt's column-major terms that is out^T = b^T a^T. gemm.py checks every operand
// before calling, so a failing check here is a caller's bug.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

using at::Tensor;

void lt_check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed (status ",
              static_cast<int>(status), ")");
}

struct Operand {
  cublasOperation_t op;
  uint64_t rows, cols;
  int64_t ld;
};

// A torch 2-D view t as the column-major matrix cuBLASLt reads for t^T.
Operand transposed(const Tensor& t) {
  if (t.stride(1) == 1 && t.size(1) > 0)
    return {CUBLAS_OP_N, static_cast<uint64_t>(t.size(1)), static_cast<uint64_t>(t.size(0)),
            std::max<int64_t>(t.stride(0), t.size(1))};
  TORCH_CHECK(t.stride(0) == 1, "gemm operand needs a unit stride");
  return {CUBLAS_OP_T, static_cast<uint64_t>(t.size(0)), static_cast<uint64_t>(t.size(1)),
          std::max<int64_t>(t.stride(1), t.size(0))};
}

// The largest power of two up to 256 dividing the address (the alignment the
// candidates may assume: cuBLASLt's default assumes 256).
uint32_t alignment(const Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  uint32_t align = 256;
  while (align > 1 && address % align) align /= 2;
  return align;
}

struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  ~Problem() {
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cudaDataType_t data_type(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "gemm takes bf16 or fp16");
  return t.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

void set_alignment(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                   uint32_t bytes) {
  lt_check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes)),
           "alignment preference");
}

std::unique_ptr<Problem> describe(const Tensor& a, const Tensor& b, const Tensor& out,
                                  int64_t workspace, int64_t count) {
  auto p = std::make_unique<Problem>();
  const Operand first = transposed(b), second = transposed(a);
  const cudaDataType_t type = data_type(out);
  lt_check(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  lt_check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &first.op,
                                          sizeof(first.op)), "transa");
  lt_check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &second.op,
                                          sizeof(second.op)), "transb");
  lt_check(cublasLtMatrixLayoutCreate(&p->first, type, first.rows, first.cols, first.ld), "A");
  lt_check(cublasLtMatrixLayoutCreate(&p->second, type, second.rows, second.cols, second.ld),
           "B");
  lt_check(cublasLtMatrixLayoutCreate(&p->out, type, out.size(1), out.size(0),
                                      std::max<int64_t>(out.stride(0), out.size(1))), "C");
  cublasLtMatmulPreference_t pref;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  uint64_t bytes = static_cast<uint64_t>(workspace);
  lt_check(cublasLtMatmulPreferenceSetAttribute(
               pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)),
           "workspace preference");
  set_alignment(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(b));
  set_alignment(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(a));
  set_alignment(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(out));
  set_alignment(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(out));
  p->candidates.resize(static_cast<size_t>(count));
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      at::cuda::getCurrentCUDABlasLtHandle(), p->op, p->first, p->second, p->out, p->out, pref,
      static_cast<int>(count), p->candidates.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  p->candidates.resize(status == CUBLAS_STATUS_SUCCESS ? found : 0);
  return p;
}

// Problems by everything a candidate depends on: sizes, strides, dtype, alignments, the
// workspace and the count asked for; beta's value is a call argument, but a GEMM that
// reads out (beta != 0) is timed apart from one that does not.
std::string key_of(const Tensor& a, const Tensor& b, const Tensor& out, bool reads_out,
                   int64_t workspace, int64_t count) {
  std::string key = std::to_string(static_cast<int>(out.scalar_type()));
  for (const Tensor* t : {&a, &b, &out})
    key += ";" + std::to_string(t->size(0)) + "," + std::to_string(t->size(1)) + "," +
           std::to_string(t->stride(0)) + "," + std::to_string(t->stride(1)) + "," +
           std::to_string(alignment(*t));
  return key + ";" + std::to_string(reads_out) + ";" + std::to_string(workspace) + ";" +
         std::to_string(count);
}

std::map<std::string, std::unique_ptr<Problem>>& problems() {
  static std::map<std::string, std::unique_ptr<Problem>> known;  // kept for the process
  return known;
}

Problem& problem_for(const Tensor& a, const Tensor& b, const Tensor& out, bool reads_out,
                     int64_t workspace, int64_t count) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2, "gemm takes 2-D tensors");
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "gemm shapes do not chain");
  TORCH_CHECK(a.scalar_type() == out.scalar_type() && b.scalar_type() == out.scalar_type(),
              "gemm operands differ in dtype");
  TORCH_CHECK(out.stride(1) == 1, "gemm writes row-major out");
  auto& known = problems();
  const std::string key = key_of(a, b, out, reads_out, workspace, count);
  auto it = known.find(key);
  if (it == known.end())
    it = known.emplace(key, describe(a, b, out, workspace, count)).first;
  return *it->second;
}

int64_t workspace_bytes() {
  return static_cast<int64_t>(at::cuda::getCUDABlasLtWorkspaceSize());
}

// How many candidates cuBLASLt offers for this GEMM (up to `count`).
int64_t gemm_candidates(const Tensor& a, const Tensor& b, const Tensor& out, bool reads_out,
                        int64_t count) {
  const c10::cuda::CUDAGuard guard(out.device());
  return static_cast<int64_t>(
      problem_for(a, b, out, reads_out, workspace_bytes(), count).candidates.size());
}

// out = alpha a b + beta out with candidate `index` of gemm_candidates' list.
void gemm_run(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta,
              int64_t count, int64_t index) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t workspace = workspace_bytes();
  Problem& p = problem_for(a, b, out, beta != 0.0, workspace, count);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(p.candidates.size()),
              "gemm candidate ", index, " of ", p.candidates.size());
  const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
  lt_check(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &al, b.data_ptr(),
                          p.first, a.data_ptr(), p.second, &be, out.data_ptr(), p.out,
                          out.data_ptr(), p.out, &p.candidates[index].algo,
                          at::cuda::getCUDABlasLtWorkspace(), static_cast<size_t>(workspace),
                          at::cuda::getCurrentCUDAStream()),
           "matmul");
}

// blocks: the row ends of a block-diagonal b's 16-wide blocks (skinny_grads.py), or none;
// compact (blocks only): d_b comes back [cols, 16]
SkinnyBlocks skinny_blocks(const std::vector<int64_t>& blocks, int64_t rank, int64_t cols,
                           bool compact) {
  TORCH_CHECK(!compact || !blocks.empty(), "skinny_nt_backward: compact_b needs blocks");
  TORCH_CHECK(blocks.empty() || (static_cast<int64_t>(blocks.size()) * 16 == rank &&
                                 blocks.size() <= kSkinnyMaxBlocks && blocks.back() == cols),
              "skinny_nt_backward: ", blocks.size(), " blocks of 16 for rank ", rank,
              " ending at ", blocks.empty() ? 0 : blocks.back(), " of ", cols, " rows");
  SkinnyBlocks parts{};
  parts.n = static_cast<int>(blocks.size());
  parts.compact = compact;
  for (size_t i = 0; i < blocks.size(); ++i) {
    TORCH_CHECK(blocks[i] % skinny_cols_multiple() == 0 && (i == 0 || blocks[i] > blocks[i - 1]),
                "skinny_nt_backward: block ends must rise in multiples of ",
                skinny_cols_multiple());
    parts.end[i] = blocks[i];
  }
  return parts;
}

// d_A = alpha d_C B and d_B = alpha d_C^T A of C = alpha A B^T, A [T, R] (R <= 64), in
// one pass over d_C (kernels/skinny_grads.cu); work: fp32, where the CTAs' parts meet:
// `partials` true, skinny_partial_floats of them, else d_A's and d_B's sums one after the
// other ((T + N) x R), zero on entry and left zero; out: planned bytes for (d_A, d_B) or
// none.
std::vector<Tensor> skinny_nt_backward(const Tensor& d_c, const Tensor& a, const Tensor& b,
                                       double alpha, const Tensor& work, bool partials,
                                       const Outputs& out, const std::vector<int64_t>& blocks,
                                       bool compact_b) {
  // A's rows may lie apart (t in x's spare columns: runtime/cuda/lora_kcat.py), 16-byte
  // aligned
  TORCH_CHECK(a.is_cuda() && a.device() == d_c.device() && a.scalar_type() == at::kBFloat16 &&
                  a.dim() == 2 && a.stride(1) == 1 && a.stride(0) >= a.size(1) &&
                  a.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              "skinny_nt_backward: A must be bf16 on d_C's device, rows 16-byte aligned");
  check(b, "B", at::kBFloat16, d_c);
  TORCH_CHECK(d_c.is_cuda() && d_c.scalar_type() == at::kBFloat16 && d_c.dim() == 2 &&
                  a.dim() == 2 && b.dim() == 2,
              "skinny_nt_backward takes 2-D bf16 CUDA tensors");
  const int64_t rows = d_c.size(0), cols = d_c.size(1), rank = a.size(1);
  TORCH_CHECK(a.size(0) == rows && b.size(0) == cols && b.size(1) == rank,
              "skinny_nt_backward: d_C ", d_c.sizes(), ", A ", a.sizes(), ", B ", b.sizes());
  TORCH_CHECK(d_c.stride(1) == 1 && d_c.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(d_c.data_ptr()) % 16 == 0,
              "d_C rows must be 16-byte aligned");
  TORCH_CHECK(rows % skinny_rows_multiple() == 0 && cols % skinny_cols_multiple() == 0 &&
                  (rank == 16 || rank == 32 || rank == 48 || rank == 64),
              "skinny_nt_backward: shape not covered");
  const c10::cuda::CUDAGuard guard(d_c.device());
  const SkinnyBlocks parts = skinny_blocks(blocks, rank, cols, compact_b);
  check(work, "work", at::kFloat, d_c);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t floats = partials ? skinny_partial_floats(rows, cols, rank, parts, sms)
                                  : (rows + cols) * rank;
  TORCH_CHECK(work.is_contiguous() && work.numel() == floats, "skinny_nt_backward: work must ",
              "hold ", floats, partials ? " partials" : " sums", ", not ", work.numel());
  // d_a may be a view with rows apart (d_t written beside d_y: runtime/cuda/lora_kcat.py)
  const bool strided_a = out.size() > 0 && out[0] && !out[0]->is_contiguous();
  Tensor d_a = strided_a ? *out[0] : output(out, 0, {rows, rank}, a.options());
  TORCH_CHECK(!strided_a || (d_a.dim() == 2 && d_a.size(0) == rows && d_a.size(1) == rank &&
                             d_a.stride(1) == 1 && d_a.stride(0) >= rank &&
                             d_a.scalar_type() == at::kBFloat16 && d_a.device() == d_c.device()),
              "skinny_nt_backward: out[0] must be [", rows, ", ", rank, "] bf16, rows apart");
  // compact_b (blocks only): d_b [cols, 16], each row its own block's columns (the
  // blocks' gradients stacked, skinny_grads.py); out[1] is then not used
  Tensor d_b = compact_b ? at::empty({cols, 16}, b.options())
                         : output(out, 1, {cols, rank}, b.options());
  float* base = work.data_ptr<float>();
  const SkinnySums sums = partials ? SkinnySums{base, nullptr, nullptr}
                                   : SkinnySums{nullptr, base, base + rows * rank};
  check_launch(launch_skinny_nt_backward(d_c.data_ptr(), d_c.stride(0), a.data_ptr(),
                                         a.stride(0), b.data_ptr(), sums, d_a.data_ptr(),
                                         d_a.stride(0), d_b.data_ptr(), rows, cols,
                                         static_cast<int>(rank),
                                         static_cast<float>(alpha), parts, sms, stream()),
               "skinny_nt_backward");
  return {d_a, d_b};
}

int64_t partial_floats(int64_t rows, int64_t cols, int64_t rank,
                       const std::vector<int64_t>& blocks) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return skinny_partial_floats(rows, cols, static_cast<int>(rank),
                               skinny_blocks(blocks, rank, cols, false), sms);
}

}  // namespace

void register_gemm(pybind11::module_& m) {
  m.def("skinny_nt_backward", &skinny_nt_backward,
        "d_A, d_B of C = alpha A B^T (A [T, R], R <= 64) in one pass over d_C",
        pybind11::arg("d_c"), pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("alpha"),
        pybind11::arg("work"), pybind11::arg("partials"), pybind11::arg("out") = Outputs{},
        pybind11::arg("blocks") = std::vector<int64_t>{}, pybind11::arg("compact_b") = false);
  m.def("skinny_partial_floats", &partial_floats,
        "the fp32 workspace skinny_nt_backward's partials take on the current device",
        pybind11::arg("rows"), pybind11::arg("cols"), pybind11::arg("rank"),
        pybind11::arg("blocks"));
  m.def("gemm_candidates", &gemm_candidates, "cuBLASLt's candidate count for a GEMM",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("out"),
        pybind11::arg("reads_out"), pybind11::arg("count"));
  m.def("gemm_run", &gemm_run, "out = alpha a b + beta out with one cuBLASLt candidate",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("out"), pybind11::arg("alpha"),
        pybind11::arg("beta"), pybind11::arg("count"), pybind11::arg("index"));
}

}  // namespace bind
}  // namespace modulec
