"""Time the fused AdamW kernels (csrc/kernels/adamw.cu) against torch.optim.AdamW
(fused=True) on one flat parameter of n elements, bf16 gradient:

- `fp32 master`: adamw_step, the fp32 master updated and the bf16 compute copy written
  (reads 2 + 4 + 8, writes 4 + 8 + 2 bytes a parameter: 28);
- `split master`: adamw_split_step, the master as bf16 top half + int16 low half, the top
  half being the compute copy (reads and writes 2 + 2 + 8, reads 2 of gradient: 26);
- `torch fused`: torch.optim.AdamW(fused=True) on an fp32 parameter with an fp32 `.grad`
  (the bf16 gradient cast in first, as optimizer="torch" does), then the compute copy cast
  (not counted in its bytes: 4 + 4 + 8 read, 4 + 8 written, 28).

Each timing is the median of `--iters` calls with CUDA events, L2 flushed before each
(bench_kernels.time_ms); before timing, the two kernels are checked to agree bit for bit
(the split master joined) over three steps.

    python benchmarks/kernels/bench_adamw.py [--n 67108864 268435456] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]

from bench_kernels import time_ms  # noqa: E402
from runtime.cuda.build import load  # noqa: E402
from runtime.cuda.state import joined_master, split_master  # noqa: E402

HYPER = (1e-4, 0.9, 0.95, 1e-8, 0.1)  # lr, beta1, beta2, eps, weight decay


def state(n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(n, device="cuda", generator=g) * 0.02
    hi, lo = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(
        n, dtype=torch.int16, device="cuda")
    split_master(master, hi, lo)
    return {"master": master, "compute": master.to(torch.bfloat16), "hi": hi, "lo": lo,
            "grad": (torch.randn(n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16),
            "moments": [torch.zeros(n, device="cuda") for _ in range(4)],
            "step": torch.ones((), device="cuda")}


def check(s: dict) -> None:
    ext = load()
    m, v, m2, v2 = s["moments"]
    for _ in range(3):
        s["step"].add_(1)
        ext.adamw_step(s["master"], s["grad"], m, v, s["compute"], s["step"], *HYPER)
        ext.adamw_split_step(s["hi"], s["lo"], s["grad"], m2, v2, s["step"], *HYPER)
    if not torch.equal(joined_master(s["hi"], s["lo"]), s["master"]):
        sys.exit("bench_adamw: the split master differs from the fp32 master")


def run_size(n: int, iters: int) -> list[dict]:
    s = state(n)
    check(s)
    ext, (m, v, m2, v2) = load(), s["moments"]
    param = torch.nn.Parameter(s["master"].clone())
    param.grad = torch.zeros_like(param)
    opt = torch.optim.AdamW([param], lr=HYPER[0], betas=HYPER[1:3], eps=HYPER[3],
                            weight_decay=HYPER[4], fused=True)

    def torch_fused():
        param.grad.copy_(s["grad"])
        opt.step()
        s["compute"].copy_(param.detach())
    cases = [("fp32 master", 28, lambda: ext.adamw_step(s["master"], s["grad"], m, v,
                                                         s["compute"], s["step"], *HYPER)),
             ("split master", 26, lambda: ext.adamw_split_step(s["hi"], s["lo"], s["grad"], m2,
                                                               v2, s["step"], *HYPER)),
             ("torch fused", 28, torch_fused)]
    rows = []
    for name, per_param, fn in cases:
        ms = time_ms(fn, iters)
        rows.append({"kernel": name, "n": n, "ms": ms, "bytes": per_param * n,
                     "GBs": per_param * n / ms / 1e6})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1 << 26, 1 << 28])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adamw: no CUDA device")
    rows = [row for n in args.n for row in run_size(n, args.iters)]
    print(f"{torch.cuda.get_device_name()}: AdamW, bf16 gradient, median of {args.iters}")
    print("| kernel | parameters | ms | GB/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['n']:,} | {r['ms']:.3f} | {r['GBs']:.0f} |")
    result = {"device": torch.cuda.get_device_name(), "iters": args.iters, "rows": rows}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
