"""Time the fused cross-entropy kernel (csrc/kernels/cross_entropy.cu) against the torch
path it replaced in runtime/cuda/lm_head.py, bf16 logits:

- per chunk: `_logits_grad` with the kernel (in place on the bf16 chunk, then the sum of
  the per-row losses) against `_chunk(logits.float(), ...).to(bf16)` (the fp32 copy, the
  logsumexp / gather / sub / exp / scatter_add / mul ops and the cast back);
- per step: `lm_head_cross_entropy` (GEMMs included) with and without the kernel.

Timings as benchmarks/kernels/bench_kernels.py takes them (median over --iters, CUDA
events, L2 flushed before each call); the chunk is restored from a copy before each call,
outside the events. GB/s counts the kernel's logits read once and written once. "extra
MiB": the peak memory a call allocates beyond its inputs.

    python benchmarks/kernels/bench_cross_entropy.py [--rows 2048] [--vocabs 32000 128256]
        [--tokens 8192] [--d-model 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import time_ms  # noqa: E402
from runtime.cuda import lm_head  # noqa: E402

BF16 = torch.bfloat16
IGNORE = -100


def extra_mib(fn, setup=lambda: None) -> float:
    setup()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def labels_for(rows, V, g):
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
    labels[::16] = IGNORE  # a few ignored rows, as padding gives
    return labels


def chunk_row(rows, V, iters) -> dict:
    g = torch.Generator(device="cuda").manual_seed(V)
    pristine = (torch.randn(rows, V, device="cuda", generator=g) * 3).to(BF16)
    labels = labels_for(rows, V, g)
    keep = labels != IGNORE
    inv_n = 1.0 / keep.sum().to(torch.float32)
    buf, loss = pristine.clone(), torch.zeros((), device="cuda")
    restore = lambda: buf.copy_(pristine)  # noqa: E731
    fused = lambda: lm_head._logits_grad(buf, labels, keep, inv_n, loss, IGNORE)  # noqa: E731
    torch_path = lambda: lm_head._chunk(buf.float(), labels, keep, inv_n, loss).to(BF16)  # noqa: E731
    restore()
    want = torch_path().float()
    restore()
    got = fused().float()
    err = float((got - want).abs().max() / want.abs().max())
    row = {"rows": rows, "vocab": V, "max_rel_diff": err,
           "kernel_ms": time_ms(fused, iters, setup=restore),
           "torch_ms": time_ms(torch_path, iters, setup=restore),
           "kernel_extra_MiB": extra_mib(fused, restore),
           "torch_extra_MiB": extra_mib(torch_path, restore)}
    row["kernel_GBs"] = 2 * pristine.numel() * pristine.element_size() / row["kernel_ms"] / 1e6
    return row


def step_row(tokens, d, V, chunk, iters) -> dict:
    g = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(tokens, d, device="cuda", generator=g).to(BF16)
    w = (torch.randn(V, d, device="cuda", generator=g) * d ** -0.5).to(BF16)
    labels = labels_for(tokens, V, g)
    run = lambda: lm_head.lm_head_cross_entropy(x, w, labels, chunk)  # noqa: E731
    row = {"tokens": tokens, "d_model": d, "vocab": V, "chunk": chunk,
           "kernel_ms": time_ms(run, iters), "kernel_extra_MiB": extra_mib(run)}
    real = lm_head._kernel_for
    lm_head._kernel_for = lambda logits: None
    try:
        row["torch_ms"], row["torch_extra_MiB"] = time_ms(run, iters), extra_mib(run)
    finally:
        lm_head._kernel_for = real
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cross_entropy: no CUDA device")
    chunks = [chunk_row(args.rows, V, args.iters) for V in args.vocabs]
    steps = [step_row(args.tokens, args.d_model, V, args.rows, args.iters) for V in args.vocabs]
    result = {"device": torch.cuda.get_device_name(), "iters": args.iters, "chunks": chunks,
              "steps": steps}
    print(f"{result['device']}: bf16, median of {args.iters}")
    print("| chunk | kernel ms | torch ms | x torch | kernel GB/s | extra MiB kernel / torch "
          "| max rel diff |\n|---|---|---|---|---|---|---|")
    for r in chunks:
        print(f"| {r['rows']}x{r['vocab']} | {r['kernel_ms']:.4f} | {r['torch_ms']:.4f} | "
              f"{r['torch_ms'] / r['kernel_ms']:.1f} | {r['kernel_GBs']:.0f} | "
              f"{r['kernel_extra_MiB']:.0f} / {r['torch_extra_MiB']:.0f} | {r['max_rel_diff']:.2g} |")
    print("\n| lm_head_cross_entropy | kernel ms | torch ms | saved ms | extra MiB kernel / torch "
          "|\n|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['tokens']}x{r['d_model']} -> {r['vocab']}, chunk {r['chunk']} | "
              f"{r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['torch_ms'] - r['kernel_ms']:.3f} | "
              f"{r['kernel_extra_MiB']:.0f} / {r['torch_extra_MiB']:.0f} |")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
