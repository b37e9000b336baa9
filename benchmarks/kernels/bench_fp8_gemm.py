"""Time the FP8 GEMMs of an FP8 recipe (runtime/fp8_gemm.py, torch._scaled_mm) against
cuBLAS's bf16 GEMM at the layer shapes of TinyLlama (d 2048, d_ff 5632) and Llama-3-8B
(d 4096, d_ff 14336), M = 8192 tokens, y = x W^T with W [N, K]:

- `bf16`: torch.mm(x, W^T), bf16 operands and output (fp32 accumulation);
- `fp8 GEMM`: torch._scaled_mm alone on operands already in E4M3 (the GEMM's own speed);
- `fp8 fwd`: what the GPU step runs for a covered forward matmul: amax, scale, cast of x
  and W to E4M3 (current scaling), then the GEMM (bf16 output);
- `bf16 fwd+bwd` / `fp8 fwd+bwd`: the forward and both gradients (dx = dy W, dW = dy^T x),
  the FP8 one with dy in E5M2 and the transposed fp8 copies _scaled_mm's layouts need;
- `... graph`: the same replayed from a CUDA graph, as the training step runs them (no
  launch overhead: an FP8 operand is two launches here, amax-and-scale and cast, before
  its GEMMs, which eager calls pay for on the host; these rows quantize each operand at
  each use with current scaling, not the step's once a step with the amax inside delayed
  scaling's cast: train_step.py's `_fp8` variants measure that);
- the cast of x [M, K] to E4M3 in both layouts (x and x^T, what a wgrad operand needs):
  csrc/kernels/fp8_cast.cu in one pass against the torch ops (fp32 product, clamp, cast,
  transposed copy); GB/s counts 2 bytes read and 2 written an element. Before timing the
  two are checked to give the same bits.

TFLOP/s counts 2 M N K per GEMM. Before timing, each shape's FP8 result is checked
against the bf16 GEMM (relative error norm under 6%: E4M3 rounding; the GPU GEMM against
the CPU emulation's numerics: tests/test_fp8_gemm.py, `cuda` tests). Each timing
is the median of `--iters` calls with CUDA events, L2 flushed before each
(bench_kernels.time_ms).

    python benchmarks/kernels/bench_fp8_gemm.py [--m 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]

from bench_kernels import graphed, time_ms  # noqa: E402
from runtime import fp8_gemm  # noqa: E402

# (model, layer, K, N) of y = x W^T, W [N, K]
SHAPES = [("TinyLlama", "o_proj", 2048, 2048), ("TinyLlama", "up", 2048, 5632),
          ("TinyLlama", "down", 5632, 2048), ("Llama-3-8B", "o_proj", 4096, 4096),
          ("Llama-3-8B", "up", 4096, 14336), ("Llama-3-8B", "down", 14336, 4096)]
RECIPE = {"scaling": {"kind": "current", "margin": 0}}


def operands(m: int, k: int, n: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    dy = (torch.randn(m, n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    return x, w, dy


def check(x, w, state) -> float:
    """The FP8 product's relative error against bf16 (exits above 6%)."""
    y = fp8_gemm.matmul(state, fp8_gemm.Operand(x, "fp8_e4m3", "x"),
                        fp8_gemm.Operand(w, "fp8_e4m3", "w"), transpose="NT")
    ref = torch.mm(x, w.t()).float()
    error = float((y.float() - ref).norm() / ref.norm())
    if not error < 0.06:
        sys.exit(f"bench_fp8_gemm: FP8 GEMM {tuple(x.shape)} x {tuple(w.shape)} is "
                 f"{error:.3f} away from bf16")
    return error


def cast_row(x, scale, iters: int) -> dict:
    """The kernel's and the torch ops' cast of x to E4M3, x and x^T (checked equal)."""
    def with_cast(mode):
        def run():
            fp8_gemm.CAST["cuda"] = mode
            try:
                return fp8_gemm.cast(x, "fp8_e4m3", scale, True, True)
            finally:
                fp8_gemm.CAST["cuda"] = "kernel"
        return run
    kernel, torch_ops = with_cast("kernel"), with_cast("torch")
    for a, b in zip(kernel(), torch_ops()):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            sys.exit("bench_fp8_gemm: the fp8_cast kernel differs from the torch ops")
    row = {}
    for name, fn in (("kernel", kernel), ("torch", torch_ops)):
        ms = time_ms(fn, iters)
        row[name] = {"ms": ms, "GBs": 4 * x.numel() / ms / 1e6}
    return row


def run_shape(m: int, k: int, n: int, iters: int) -> dict:
    x, w, dy = operands(m, k, n)
    state = fp8_gemm.ScaleState(RECIPE, "cuda")
    error = check(x, w, state)
    one = torch.ones((), device="cuda")
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    X, W = fp8_gemm.Operand(x, "fp8_e4m3", "x"), fp8_gemm.Operand(w, "fp8_e4m3", "w")
    DY = fp8_gemm.Operand(dy, "fp8_e5m2", "dy")

    def bf16_train():
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    def fp8_train():
        fp8_gemm.matmul(state, X, W, transpose="NT")
        fp8_gemm.matmul_backward(state, DY, X, W, transpose="NT")

    cases = [("bf16", 1, lambda: torch.mm(x, w.t())),
             ("fp8 GEMM", 1, lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16)),
             ("fp8 fwd", 1, lambda: fp8_gemm.matmul(state, X, W, transpose="NT")),
             ("bf16 fwd+bwd", 3, bf16_train), ("fp8 fwd+bwd", 3, fp8_train),
             ("fp8 fwd graph", 1, graphed(lambda: fp8_gemm.matmul(state, X, W,
                                                                  transpose="NT"))),
             ("bf16 fwd+bwd graph", 3, graphed(bf16_train)),
             ("fp8 fwd+bwd graph", 3, graphed(fp8_train))]
    row = {"M": m, "K": k, "N": n, "fp8_rel_error": error,
           "cast": cast_row(x, state.scale(x, "fp8_e4m3", "x"), iters)}
    for name, gemms, fn in cases:
        ms = time_ms(fn, iters)
        row[name] = {"ms": ms, "TFLOPs": gemms * 2 * m * n * k / ms / 1e9}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm: no CUDA device")
    names = ("bf16", "fp8 GEMM", "fp8 fwd", "bf16 fwd+bwd", "fp8 fwd+bwd", "fp8 fwd graph",
             "bf16 fwd+bwd graph", "fp8 fwd+bwd graph")
    print(f"{torch.cuda.get_device_name()}: M = {args.m}, median of {args.iters}, "
          "ms (TFLOP/s)")
    print("| model | layer | K | N | " + " | ".join(names) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(names))
    rows = []
    for model, layer, k, n in SHAPES:
        row = run_shape(args.m, k, n, args.iters) | {"model": model, "layer": layer}
        rows.append(row)
        cells = " | ".join(f"{row[c]['ms']:.3f} ({row[c]['TFLOPs']:.0f})" for c in names)
        print(f"| {model} | {layer} | {k} | {n} | {cells} |", flush=True)
    print("\ncast of x [M, K] to E4M3, x and x^T: ms (GB/s)\n| K | kernel | torch ops |\n"
          "|---:|---:|---:|")
    for row in rows:
        c = row["cast"]
        print(f"| {row['K']} | {c['kernel']['ms']:.3f} ({c['kernel']['GBs']:.0f}) | "
              f"{c['torch']['ms']:.3f} ({c['torch']['GBs']:.0f}) |")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "iters": args.iters, "rows": rows}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
