"""The GPU pipeline's step captured in one CUDA graph against the same step run eagerly, in
one run on the same GPUs (runtime/train/pipeline_graph.py):

    torchrun --nproc-per-node 2 benchmarks/gpu/pipeline_graph.py --batch 1 --microbatches 8
        [--steps 8] [--json FILE]

TinyLlama shape (22 layers, d 2048, 32/4 heads, d_ff 5632, vocab 32000), T=2048, random
init and tokens, AdamW; each mode a fresh trainer; tokens/s from the median step time of
steps 4+ (step 3 captures), per-GPU peak from torch's allocator. Rank 0 prints a table and
writes the JSON."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.dist import DistContext  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime.train.optim import AdamW  # noqa: E402
from runtime.train.pipeline import PipelineTrainer  # noqa: E402

TINY = dict(vocab_size=32000, d_model=2048, n_layers=22, num_heads=32, num_kv_heads=4,
            d_ff=5632, max_seq=2048)


def run(context, args, graph: bool) -> dict:
    model = Model.from_module("std/models/llama.module", dtype=torch.float32,
                              settings={k: str(v) for k, v in TINY.items()})
    model.check_finite = False
    model.init_random(seed=0)
    torch.cuda.reset_peak_memory_stats()
    trainer = PipelineTrainer(model, args.batch, args.seq, AdamW(lr=3e-4), context,
                              context.world, args.microbatches, device="cuda", graph=graph)
    rows = args.batch * args.microbatches
    generator = torch.Generator().manual_seed(0)
    seconds, losses = [], []
    for _ in range(args.steps):
        window = torch.randint(0, TINY["vocab_size"], (rows, args.seq + 1),
                               generator=generator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(trainer.train_step(window))  # reads the loss: the step is done
        seconds.append(time.perf_counter() - start)
    step = statistics.median(seconds[3:])
    result = {"graph": graph, "eager_because": trainer.eager_because,
              "tokens_per_s": rows * args.seq / step, "step_ms": step * 1e3,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses,
              "step_seconds": seconds}
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    context = DistContext.from_env(device="cuda")
    if context.is_main:
        print(f"--pp {context.world} --batch {args.batch} --microbatches {args.microbatches}"
              f", T={args.seq}, {torch.cuda.get_device_name()}")
        print("| step | tokens/s | step ms | peak GiB (rank 0) |\n| --- | ---: | ---: | ---: |")
    results = []
    for graph in (False, True):  # each row printed as it is measured
        results.append(r := run(context, args, graph))
        if context.is_main:
            name = "one CUDA graph" if r["graph"] else "eager"
            print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                  f"{r['peak_gib']:.2f} |", flush=True)
    if context.is_main:
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                             "device": torch.cuda.get_device_name(),
                                             "results": results}, indent=1) + "\n")
    context.close()


if __name__ == "__main__":
    main()
