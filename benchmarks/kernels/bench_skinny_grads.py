"""Both gradients of LoRA's delta: cuBLAS's two GEMMs against one pass over d_C.

For each adapted projection of a LoRA 8B layer (r=16 on q, k, v, o, gate, up, down; the
fused projections' block-diagonal B is rank-wide: qkv 48, gate/up 32), times
d_A = s d_C B plus d_B = s d_C^T A as the step's two GEMMs (runtime/cuda/gemm.py: alpha in
the GEMM, the timed algorithm) and as
runtime/cuda/skinny_grads.py's kernel, each after a write that evicts the L2 (d_C comes
from HBM; bench_kernels.time_ms), in rounds (median), and checks the kernel against an
fp32 reference. For the fused projections (q/k/v, gate/up: B block-diagonal) it also
times the kernel told B's blocks (each chunk of d_C summed against its own block).

    python3 benchmarks/kernels/bench_skinny_grads.py [--tokens 2048] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]

from bench_kernels import in_rounds, time_ms  # noqa: E402

SHAPES = {"qkv": (6144, 48), "o": (4096, 16), "gate_up": (28672, 32), "down": (4096, 16)}
# the fused projections' block-diagonal B: each block's rows (16 columns each)
BLOCKS = {"qkv": [4096, 1024, 1024], "gate_up": [14336, 14336]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from runtime.cuda.gemm import mm_into
    from runtime.cuda.skinny_grads import skinny_nt_backward

    T, alpha = args.tokens, 2.0
    rows = []
    print(f"{torch.cuda.get_device_name()}, T={T}; us per call, d_C read from HBM")
    print(f"{'projection':10s} {'d_C MB':>7s} {'two GEMMs':>10s} {'one pass':>9s} {'speedup':>8s} "
          f"{'GB/s':>6s} {'err d_A':>8s} {'err d_B':>8s}")
    for name, (N, R) in SHAPES.items():
        torch.manual_seed(0)
        d_C = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        A = torch.randn(T, R, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(N, R, device="cuda", dtype=torch.bfloat16) * 0.1
        d_A, d_B = torch.empty(T, R, **_like(A)), torch.empty(N, R, **_like(A))

        def two_gemms():  # as the step runs them: alpha in the GEMM, tuned algorithms
            mm_into(d_C, B, d_A, alpha)
            mm_into(d_C.t(), A, d_B, alpha)

        blocks = BLOCKS.get(name)
        if blocks:  # B as the step has it: block-diagonal
            B = torch.block_diag(*[b[:, 16 * i:16 * i + 16] for i, b in enumerate(
                B.split(blocks))])

        def one_pass():
            skinny_nt_backward(d_C, A, B, alpha, [d_A, d_B])

        def blocked():
            skinny_nt_backward(d_C, A, B, alpha, [d_A, d_B], blocks)

        fns = {"two": two_gemms, "one": one_pass, **({"blocked": blocked} if blocks else {})}
        times = in_rounds(fns, lambda fn: 1000 * time_ms(fn, iters=5), rounds=7)
        one_pass()  # the gradients checked below are the kernel's
        err_a = _err(d_A, alpha * d_C.float() @ B.float())
        err_b = _err(d_B, alpha * d_C.float().t() @ A.float())
        two, one = times["two"], times["one"]
        mb = T * N * 2 / 1e6
        rows.append({"projection": name, "N": N, "R": R, "d_C_MB": mb, "two_gemms_us": two,
                     "one_pass_us": one, "err_d_A": err_a, "err_d_B": err_b,
                     **({"blocked_us": times["blocked"]} if blocks else {})})
        print(f"{name:10s} {mb:7.1f} {two:10.1f} {one:9.1f} {two / one:7.2f}x "
              f"{mb / one * 1e3:6.0f} {err_a:8.1e} {err_b:8.1e}"
              + (f"  blocked {times['blocked']:.1f}" if blocks else ""), flush=True)
    total_two = sum(r["two_gemms_us"] for r in rows)
    total_one = sum(r["one_pass_us"] for r in rows)
    print(f"a layer: {total_two:.1f} -> {total_one:.1f} us "
          f"({(total_two - total_one) * 32 / 1000:.2f} ms a 32-layer step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tokens": T, "rows": rows}, f,
                      indent=1)


def _like(t):
    return {"device": t.device, "dtype": t.dtype}


def _err(got, expect) -> float:
    return ((got.float() - expect).abs().max() / expect.abs().max()).item()


if __name__ == "__main__":
    main()
