"""How far cuBLASLt's first heuristic choice is from its best algorithm, per step GEMM.

For each GEMM shape the LoRA 8B and TinyLlama steps run (bf16 operands, fp32
accumulation, the step's transposes and beta), asks cuBLASLt for up to `--algos`
candidate algorithms and times each beside torch's own call of the same product (cuBLAS's
choice), in rounds (median), printing torch's time, cuBLASLt's first candidate's and the
fastest's. Every candidate's output is checked against torch's before it is timed.

    python3 benchmarks/kernels/bench_gemm_algos.py [--algos 16] [--iters 30] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_kernels import in_rounds  # the script's folder is on sys.path

CPP = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <map>
#include <string>
#include <vector>

#define LT_CHECK(x) TORCH_CHECK((x) == CUBLAS_STATUS_SUCCESS, "cublasLt: ", #x, " failed")

struct Operand { cublasOperation_t op; uint64_t rows, cols; int64_t ld; };

// torch 2-D view t (one unit stride) as the column-major operand whose op is t^T
static Operand transposed(const torch::Tensor& t) {
  if (t.stride(1) == 1) return {CUBLAS_OP_N, (uint64_t)t.size(1), (uint64_t)t.size(0), t.stride(0)};
  TORCH_CHECK(t.stride(0) == 1, "one unit stride needed");
  return {CUBLAS_OP_T, (uint64_t)t.size(0), (uint64_t)t.size(1), t.stride(1)};
}

struct Problem {
  cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t a, b, c;
  ~Problem() { cublasLtMatrixLayoutDestroy(a); cublasLtMatrixLayoutDestroy(b);
               cublasLtMatrixLayoutDestroy(c); cublasLtMatmulDescDestroy(op); }
};

// out[M,N] = alpha a[M,K] b[K,N] + beta out: column-major out^T = b^T a^T
static void describe(Problem& p, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& out) {
  Operand first = transposed(b), second = transposed(a);
  LT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &first.op, sizeof(first.op)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &second.op, sizeof(second.op)));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, first.rows, first.cols, first.ld));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, second.rows, second.cols, second.ld));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, out.size(1), out.size(0), out.stride(0)));
}

static std::vector<cublasLtMatmulHeuristicResult_t> candidates(
    cublasLtHandle_t h, Problem& p, size_t workspace, int count) {
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace, sizeof(workspace)));
  std::vector<cublasLtMatmulHeuristicResult_t> found(count);
  int n = 0;
  LT_CHECK(cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.c, p.c, pref, count, found.data(), &n));
  cublasLtMatmulPreferenceDestroy(pref);
  found.resize(n);
  return found;
}

struct Prepared { Problem* problem; std::vector<cublasLtMatmulHeuristicResult_t> found; };
static std::map<std::string, Prepared> prepared;  // by shapes, strides and count

static Prepared& prepare(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out,
                         size_t workspace, int64_t count) {
  std::string key;
  for (auto* t : {&a, &b, &out})
    key += std::to_string(t->size(0)) + "," + std::to_string(t->size(1)) + "," +
           std::to_string(t->stride(0)) + "," + std::to_string(t->stride(1)) + ";";
  key += std::to_string(count);
  auto it = prepared.find(key);
  if (it != prepared.end()) return it->second;
  Problem* p = new Problem();  // kept for the process
  describe(*p, a, b, out);
  auto found = candidates(at::cuda::getCurrentCUDABlasLtHandle(), *p, workspace, count);
  return prepared.emplace(key, Prepared{p, found}).first->second;
}

// runs candidate `index` (or reports how many there are when index < 0)
int64_t run(torch::Tensor a, torch::Tensor b, torch::Tensor out, double alpha, double beta,
            torch::Tensor workspace, int64_t count, int64_t index) {
  Prepared& prep = prepare(a, b, out, workspace.numel(), count);
  if (index < 0) return prep.found.size();
  float al = alpha, be = beta;
  Problem& p = *prep.problem;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &al, b.data_ptr(), p.a,
                          a.data_ptr(), p.b, &be, out.data_ptr(), p.c, out.data_ptr(), p.c,
                          &prep.found[index].algo, workspace.data_ptr(), workspace.numel(),
                          at::cuda::getCurrentCUDAStream()));
  return prep.found.size();
}
"""

LORA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TINY = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


def problems():
    """(name, M, N, K, mode, beta): the steps' GEMMs (mode: a and b as torch sees them)."""
    out = []
    for out_f, in_f in LORA8B:
        out.append((f"lora8b fwd {out_f}x{in_f}", 2048, out_f, in_f, "NT", 1.0))
        out.append((f"lora8b dx {out_f}x{in_f}", 2048, in_f, out_f, "NN", 1.0))
    out.append(("lora8b head fwd", 2048, 128256, 4096, "NT", 0.0))
    out.append(("lora8b head dx", 2048, 4096, 128256, "NN", 0.0))
    for out_f, in_f in TINY:
        out.append((f"tiny fwd {out_f}x{in_f}", 8192, out_f, in_f, "NT", 0.0))
        out.append((f"tiny dx {out_f}x{in_f}", 8192, in_f, out_f, "NN", 0.0))
        out.append((f"tiny dW {out_f}x{in_f}", out_f, in_f, 8192, "TN", 0.0))
    return out


def operands(M, N, K, mode):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) if mode[0] == "N" else \
        torch.randn(K, M, device="cuda", dtype=torch.bfloat16).t()
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) if mode[1] == "N" else \
        torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    return a, b


def timed(fn, iters: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def measure(ext, problem, count, iters, rounds, workspace):
    name, M, N, K, mode, beta = problem
    a, b = operands(M, N, K, mode)
    c0 = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 0.1
    expect = torch.addmm(c0, a, b, beta=beta).float()
    out = c0.clone()
    found = ext.run(a, b, out, 1.0, beta, workspace, count, -1)
    usable, errors = [], []
    for i in range(found):
        out.copy_(c0)
        ext.run(a, b, out, 1.0, beta, workspace, count, i)
        errors.append(((out.float() - expect).abs().max() / expect.abs().max()).item())
        if errors[-1] <= 2e-2:
            usable.append(i)
    fns = [lambda: torch.addmm(out, a, b, beta=beta, out=out) if beta else
           torch.mm(a, b, out=out)]
    fns += [lambda i=i: ext.run(a, b, out, 1.0, beta, workspace, count, i) for i in usable]
    for fn in fns:
        fn()
    times = list(in_rounds(dict(enumerate(fns)), lambda fn: timed(fn, iters), rounds).values())
    torch_ms, lt = times[0], dict(zip(usable, times[1:]))
    best = min(lt, key=lt.get)
    flop = 2.0 * M * N * K
    return {"name": name, "M": M, "N": N, "K": K, "mode": mode, "beta": beta,
            "torch_ms": torch_ms, "first_ms": lt.get(0, float("inf")), "best_ms": lt[best],
            "best_index": best, "candidates": found, "max_rel_err": max(errors),
            "torch_tflops": flop / torch_ms / 1e9, "best_tflops": flop / lt[best] / 1e9,
            "lt_ms": [lt.get(i) for i in range(found)]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="names containing this text")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline
    ext = load_inline("gemm_algos_bench", CPP, functions=["run"], extra_ldflags=["-lcublasLt"],
                      with_cuda=True, extra_cflags=["-O2"])
    workspace = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per GEMM")
    print(f"{'problem':28s} {'torch':>7s} {'first':>7s} {'best':>7s} {'#':>3s} {'of':>3s} "
          f"{'TF torch':>8s} {'TF best':>8s} {'gain':>6s}")
    for problem in problems():
        if args.only and args.only not in problem[0]:
            continue
        r = measure(ext, problem, args.algos, args.iters, args.rounds, workspace)
        rows.append(r)
        print(f"{r['name']:28s} {r['torch_ms']:7.3f} {r['first_ms']:7.3f} {r['best_ms']:7.3f} "
              f"{r['best_index']:3d} {r['candidates']:3d} {r['torch_tflops']:8.1f} "
              f"{r['best_tflops']:8.1f} {r['torch_ms'] / r['best_ms'] - 1:6.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
