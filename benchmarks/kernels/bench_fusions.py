"""Time the LayerNorm (and fused residual + LayerNorm), GELU and softmax CUDA kernels
(csrc/kernels/layernorm.cu, gelu.cu, softmax.cu; issue 19 item 5), bf16, against

- `reference`: the path the GPU step ran before them (runtime/kernels: the inputs cast to
  fp32, torch ops, the outputs cast back),
- `eager`: torch's own bf16 ops (F.layer_norm, F.gelu, torch.softmax; the backward
  through autograd),
- `compile`: the same eager function under torch.compile (forward, or forward and
  backward through AOTAutograd; compiled once before timing).

Timings as benchmarks/kernels/bench_kernels.py takes them (median of --iters calls, CUDA
events, L2 flushed before each); GB/s counts each input read once and each output
written once. Shapes: GPT-2 small (d 768, MLP 3072) and Phi-2-like (d 2560, MLP 10240)
over 8192 tokens (B 8 x T 1024); softmax over 128 columns (an MoE router's experts) and
over 32000 (a vocabulary row).

    python benchmarks/kernels/bench_fusions.py [--tokens 8192] [--dims 768 2560]
                                               [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import PEAK_TBS, grad_fn, nbytes, rand, time_ms  # noqa: E402
from runtime.cuda.kernels import CUDA_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402


@dataclass
class Case:
    kernel: str
    phase: str
    shape: str
    ours: Callable  # () -> outputs
    reference: Callable
    eager: Callable  # (compiled: bool) -> a () -> outputs callable
    bytes: int


def primitive(name, phase, inputs, attrs):
    """(ours, reference): the primitive's CUDA_KERNELS and KERNELS entries on the inputs."""
    def call(registry):
        return lambda: getattr(registry[name], phase)(inputs, dict(attrs))
    return call(CUDA_KERNELS), call(KERNELS)


def eager(fn, inputs, phase):
    """(compiled) -> fn on the inputs (forward) or autograd's gradients through it."""
    def make(compiled: bool):
        f = torch.compile(fn) if compiled else fn
        return (lambda: f(*inputs)) if phase == "forward" else grad_fn(f, inputs)
    return make


def layernorm_cases(tokens, d):
    x, w, b, dy, res = rand(tokens, d), rand(d), rand(d), rand(tokens, d), rand(tokens, d)
    attrs, label = {"eps": 1e-5}, f"{tokens}x{d}"
    y, mean, rstd = KERNELS["layernorm"].forward([x, w, b], attrs)
    ln = lambda x, w, b: F.layer_norm(x, (d,), w, b, 1e-5)  # noqa: E731
    yield Case("layernorm", "forward", label, *primitive("layernorm", "forward", [x, w, b], attrs),
               eager(ln, [x, w, b], "forward"), nbytes(x, w, b, y, mean, rstd))
    yield Case("layernorm", "backward", label,
               *primitive("layernorm", "backward", [dy, x, w, mean, rstd], attrs),
               eager(ln, [x, w, b], "backward"), nbytes(dy, x, w, mean, rstd, x, w, b))
    fused = lambda r, x, w, b: (lambda s: (s, ln(s, w, b)))(r + x)  # noqa: E731
    s, y2, mean2, rstd2 = KERNELS["fused_residual_layernorm"].forward([res, x, w, b], attrs)
    yield Case("fused_residual_layernorm", "forward", label,
               *primitive("fused_residual_layernorm", "forward", [res, x, w, b], attrs),
               eager(fused, [res, x, w, b], "forward"), nbytes(res, x, w, b, s, y2, mean2, rstd2))
    yield Case("fused_residual_layernorm", "backward", label,
               *primitive("fused_residual_layernorm", "backward", [dy, dy, s, w, mean2, rstd2],
                          attrs),
               eager(fused, [res, x, w, b], "backward"),
               nbytes(dy, dy, s, w, mean2, rstd2, x, w, b))


def gelu_cases(tokens, d):
    x, dy = rand(tokens, 4 * d), rand(tokens, 4 * d)
    for approximate, form in ((True, "tanh"), (False, "none")):
        attrs, name = {"approximate": approximate}, f"gelu ({'tanh' if approximate else 'erf'})"
        g = functools.partial(F.gelu, approximate=form)
        yield Case(name, "forward", f"{tokens}x{4 * d}", *primitive("gelu", "forward", [x], attrs),
                   eager(g, [x], "forward"), 2 * nbytes(x))
        yield Case(name, "backward", f"{tokens}x{4 * d}",
                   *primitive("gelu", "backward", [dy, x], attrs), eager(g, [x], "backward"),
                   3 * nbytes(x))


def softmax_cases(rows, C):
    x, dy = rand(rows, C) * 4, rand(rows, C)
    (y,) = KERNELS["softmax"].forward([x], {"dim": -1})
    sm = functools.partial(torch.softmax, dim=-1)
    yield Case("softmax", "forward", f"{rows}x{C}", *primitive("softmax", "forward", [x], {}),
               eager(sm, [x], "forward"), 2 * nbytes(x))
    yield Case("softmax", "backward", f"{rows}x{C}",
               *primitive("softmax", "backward", [dy, y], {}), eager(sm, [x], "backward"),
               3 * nbytes(x))


def cases(args):
    for d in args.dims:
        yield from layernorm_cases(args.tokens, d)
        yield from gelu_cases(args.tokens, d)
    yield from softmax_cases(args.tokens, 128)
    yield from softmax_cases(1024, 32000)


def run(args) -> dict:
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TBS.items() if k in name), None)
    rows = []
    for case in cases(args):
        row = {"kernel": case.kernel, "phase": case.phase, "shape": case.shape,
               "bytes": case.bytes, "ours_ms": time_ms(case.ours, args.iters),
               "reference_ms": time_ms(case.reference, args.iters),
               "eager_ms": time_ms(case.eager(False), args.iters),
               "compile_ms": None if args.no_compile else time_ms(case.eager(True), args.iters)}
        row["ours_GBs"] = case.bytes / row["ours_ms"] / 1e6
        row["pct_peak"] = 100 * row["ours_GBs"] / (peak * 1000) if peak else None
        rows.append(row)
        torch.cuda.empty_cache()
    return {"device": name, "peak_TBs": peak, "tokens": args.tokens, "dims": args.dims,
            "iters": args.iters, "rows": rows}


def print_table(result: dict):
    print(f"{result['device']}: bf16, median of {result['iters']}, L2 flushed; "
          f"x eager / x compile: their time over ours")
    head = ("kernel", "phase", "shape", "ours ms", "ref ms", "eager ms", "compile ms",
            "GB/s", "% peak", "x ref", "x eager", "x compile")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in result["rows"]:
        ours, comp = r["ours_ms"], r["compile_ms"]
        cells = (r["kernel"], r["phase"], r["shape"], f"{ours:.4f}", f"{r['reference_ms']:.4f}",
                 f"{r['eager_ms']:.4f}", f"{comp:.4f}" if comp else "-", f"{r['ours_GBs']:.0f}",
                 f"{r['pct_peak']:.0f}" if r["pct_peak"] else "-",
                 f"{r['reference_ms'] / ours:.2f}", f"{r['eager_ms'] / ours:.2f}",
                 f"{comp / ours:.2f}" if comp else "-")
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dims", type=int, nargs="+", default=[768, 2560])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fusions: no CUDA device")
    result = run(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
