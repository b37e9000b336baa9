"""The GPT-2 training step before and after the LayerNorm / GELU / softmax kernels (issue 19
item 5), in one run on one GPU: std GPT-2 small (124M: 12 layers, d_model 768, 12 heads,
MLP 3072; the vocabulary padded to 50304 by default, as nanoGPT trains it), B x T = 8 x
1024, bf16 compute, fp32 masters, the whole step captured in one CUDA graph.

    before   runtime/cuda/step.py with layernorm, gelu and softmax run as they were: the
             reference kernels (inputs cast to fp32, torch ops, outputs cast back)
    after    the same step with the custom kernels (csrc/kernels/layernorm.cu, gelu.cu,
             softmax.cu), the registry as train_kernels() makes it now

Both start from the same random weights and train on the same random batch (one step
each, then timed); each runs in its own process (clean memory). Prints a table and
writes JSON:

    python benchmarks/gpu/fusions_step.py [--batch 8 --seq 1024 --steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import forward_args, launch, random_tokens, timed  # noqa: E402

VARIANTS = ("before", "after")
REPLACED = ("layernorm", "gelu", "softmax")  # the primitives the new kernels took over


def gpt2_small(vocab: int, seq: int) -> dict:
    return dict(vocab_size=vocab, d_model=768, n_layers=12, num_heads=12, max_seq=seq)


def measure(args, variant: str) -> dict:
    import torch

    from runtime.cuda.step import TrainStep
    from runtime.kernels import KERNELS

    step = TrainStep.from_module(ROOT / "std/models/gpt2.module", gpt2_small(args.vocab, args.seq),
                                 batch=args.batch, seq=args.seq)
    if variant == "before":  # the registry as it was: the reference kernels
        for name in REPLACED:
            step.kernels[name] = KERNELS[name]
    step.init_random(0)
    tokens = random_tokens(args.batch, args.seq, args.vocab)
    torch.cuda.reset_peak_memory_stats()
    first = float(step(tokens))  # eager, the first step's loss
    step.set_batch(tokens)
    step.capture(warmup=2)
    result = timed(lambda: step(tokens), args.warmup, args.steps)
    result.update(variant=variant, first_loss=first, loss=float(step.loss),
                  tokens_per_s=round(args.batch * args.seq / result["step_s"]),
                  peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  captured=step.cuda_graph is not None,
                  kernels={n: type(step.kernels[n]).__name__ for n in REPLACED})
    return result


def child(args, variant: str, tmp: Path) -> dict:
    """The variant in its own process; a failure is its output's last five lines."""
    out = tmp / f"{variant}.json"
    cmd = [sys.executable, __file__, "--only", variant, "--result", str(out),
           *forward_args(args, "batch", "seq", "steps", "warmup", "vocab")]
    log = Path(f"{args.json}.{variant}.log") if args.json else None
    row = launch(cmd, out, args.timeout, log)
    if "error" in row:
        return {"variant": variant, "error": row["error"].strip().splitlines()[-5:]}
    return row


def print_table(results: list):
    print("| variant | tokens/s | step ms | first loss | loss | peak GiB | kernels |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | error: {' / '.join(r['error'])} |")
            continue
        print(f"| {r['variant']} | {r['tokens_per_s']} | {1000 * r['step_s']:.2f} | "
              f"{r['first_loss']:.4f} | {r['loss']:.4f} | {r['peak_gib']} | "
              f"{', '.join(f'{k}: {v}' for k, v in r['kernels'].items())} |")
    ok = [r for r in results if "error" not in r]
    if len(ok) == 2:
        print(f"after / before tokens/s: {ok[1]['tokens_per_s'] / ok[0]['tokens_per_s']:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--json")
    p.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.only:
        text = json.dumps(measure(args, args.only))
        print(text)
        if args.result:
            Path(args.result).write_text(text)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results = [child(args, v, Path(tmp)) for v in VARIANTS]
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
