"""Time the MoE experts' grouped GEMM (runtime/cuda/grouped_gemm.py: torch._grouped_mm,
no host read) against the loop it replaces, at the Mixtral-shaped step's sizes (8 experts,
top-2, d_model 2048, d_ff 5632, 8192 tokens: 16384 routed rows), bf16:

    grouped     the GPU step's path: one _grouped_mm per product (forward; backward d_x
                and d_W), offsets read on the device
    loop        the reference kernel as the GPU step ran it before (runtime/kernels/
                linalg.py through the reference's dtype policy: fp32 casts, one matmul per
                expert, offsets.tolist())
    loop_bf16   a per-expert loop of bf16 cuBLAS matmuls (offsets read once per call),
                the fairest loop

for the gate/up projection (2048 -> 2 x 5632) and the down projection (5632 -> 2048), on
three routings: `balanced` (a random softmax router's top-2), `skewed` (half the rows on
one expert), `empty` (three experts get none). Each timing is the median of `--iters`
calls with L2 flushed before each (benchmarks/kernels/bench_kernels.py time_ms).

    python benchmarks/kernels/bench_grouped_gemm.py [--tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import time_ms  # noqa: E402
from runtime.cuda import grouped_gemm as gg  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402

BF16 = torch.bfloat16


def routing(kind: str, rows: int, experts: int, generator) -> list[int]:
    """Rows per expert summing to `rows`."""
    if kind == "balanced":
        picks = torch.randint(0, experts, (rows,), generator=generator)
    elif kind == "skewed":
        picks = torch.cat([torch.zeros(rows // 2, dtype=torch.long),
                           torch.randint(1, experts, (rows - rows // 2,), generator=generator)])
    else:  # three experts empty
        picks = torch.randint(3, experts, (rows,), generator=generator)
    return torch.bincount(picks, minlength=experts).tolist()


def loop_bf16_forward(x, w, offsets):
    ends = offsets.tolist()
    return torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(ends, ends[1:]))])


def loop_bf16_backward(d_y, x, w, offsets):
    ends, d_x, d_w = offsets.tolist(), torch.empty_like(x), torch.empty_like(w)
    for e, (a, b) in enumerate(zip(ends, ends[1:])):
        torch.mm(d_y[a:b], w[e], out=d_x[a:b])
        torch.mm(d_y[a:b].T, x[a:b], out=d_w[e])
    return d_x, d_w


def bench(sizes, K, N, iters) -> dict:
    rows = sum(sizes)
    x = torch.randn(rows, K, device="cuda").to(BF16)
    w = (torch.randn(len(sizes), N, K, device="cuda") / K ** 0.5).to(BF16)
    d_y = torch.randn(rows, N, device="cuda").to(BF16)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda")
    ref, attrs = KERNELS["grouped_gemm"], {"transpose": "NT"}
    flop = 2 * rows * K * N
    out = {}
    for name, fwd, bwd in (
            ("grouped", lambda: gg.forward(x, w, offsets),
             lambda: gg.backward(d_y, x, w, offsets)),
            ("loop", lambda: ref.forward([x, w, offsets], attrs),
             lambda: ref.backward([d_y, x, w, offsets], attrs)),
            ("loop_bf16", lambda: loop_bf16_forward(x, w, offsets),
             lambda: loop_bf16_backward(d_y, x, w, offsets))):
        f, b = time_ms(fwd, iters), time_ms(bwd, iters)
        out[name] = {"fwd_ms": f, "bwd_ms": b, "fwd_tflops": flop / f / 1e9,
                     "bwd_tflops": 2 * flop / b / 1e9}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = a.tokens * a.top_k
    print(f"{a.experts} experts, {rows} routed rows, d_model {a.d_model}, d_ff {a.d_ff}, "
          f"bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'routing':9}{'product':9}{'variant':11}{'fwd ms':>9}{'bwd ms':>9}"
          f"{'fwd TF/s':>10}{'bwd TF/s':>10}")
    results = {}
    for kind in ("balanced", "skewed", "empty"):
        sizes = routing(kind, rows, a.experts, g)
        for product, K, N in (("gate_up", a.d_model, 2 * a.d_ff), ("down", a.d_ff, a.d_model)):
            r = results[f"{kind}/{product}"] = bench(sizes, K, N, a.iters)
            for name, t in r.items():
                print(f"{kind:9}{product:9}{name:11}{t['fwd_ms']:>9.3f}{t['bwd_ms']:>9.3f}"
                      f"{t['fwd_tflops']:>10.0f}{t['bwd_tflops']:>10.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__, "results": results},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
