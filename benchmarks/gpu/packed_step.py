"""Tokens/s of the GPU training step packed against unpacked, one after the other in one
run on one GPU (issue 18 item 3: packed within 5% of unpacked).

Both variants are runtime/cuda/step.py's TrainStep at the TinyLlama-1.1B shape (fused
AdamW, the whole step one CUDA graph) on the same windows of documents of random lengths
(uniform 1 .. 2 x --mean-doc tokens, each ended by SEP): `unpacked` reads them as plain
token windows (cuDNN attention over the whole row), `packed` with their documents
(TrainStep(packed=True): FlashAttention-2 varlen per document, positions restarting,
the targets after a separator ignored; runtime/cuda/packed.py). Each timed step goes
through `step(tokens, labels[, documents])`: the batch's copy into the static buffers
(for `packed` its cu_seqlens made on the host) and one graph replay, cycling through
--batches different windows. Prints one JSON line per variant and a summary:

    python benchmarks/gpu/packed_step.py [--batch 4 --seq 2048 --layers 22 --mean-doc 512
                                          --steps 20 --batches 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.train_step import tiny_llama  # noqa: E402
from runtime.train.packing import Packing, split_batch  # noqa: E402

LLAMA = str(ROOT / "std/models/llama.module")
SEP = 2  # TinyLlama's eos


def windows(n: int, batch: int, seq: int, mean: int, vocab: int, generator) -> list:
    """`n` windows [batch, seq + 1] of documents whose lengths (SEP included) are uniform in
    1 .. 2 x mean; a row's last document runs past its end."""
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (batch, seq + 1), generator=generator)
        for row in range(batch):
            at = -1
            while True:
                at += int(torch.randint(1, 2 * mean + 1, (1,), generator=generator))
                if at > seq:
                    break
                ids[row, at] = SEP
        out.append(ids)
    return out


def measure(packed: bool, args, batches: list) -> dict:
    from runtime.cuda.step import TrainStep

    step = TrainStep.from_module(LLAMA, tiny_llama(args.layers), batch=args.batch,
                                 seq=args.seq, packed=packed)
    step.init_random(0)
    inputs = []
    for window in batches:
        tokens, labels, documents = split_batch(window, Packing(SEP) if packed else None)
        inputs.append((tokens.cuda(), labels.cuda(), documents))
    torch.cuda.reset_peak_memory_stats()
    step(*inputs[0])  # eager
    step.set_batch(*inputs[1 % len(inputs)])
    step.capture(warmup=1)
    for i in range(args.warmup):
        step(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {"variant": "packed" if packed else "unpacked",
              "tokens_per_s": round(args.steps * args.batch * args.seq / seconds),
              "step_ms": round(1000 * seconds / args.steps, 2), "loss": float(loss),
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "recaptured": step.cuda_graph is None}
    if packed:
        counts = [int((d.positions == 0).sum()) for _, _, d in inputs]
        result.update(documents=counts, capacity=step.packing.capacity,
                      kept_targets=[int((labels != -100).sum()) for _, labels, _ in inputs])
    del step, inputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--mean-doc", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    batches = windows(args.batches, args.batch, args.seq, args.mean_doc,
                      tiny_llama(args.layers)["vocab_size"], generator)
    rows = [measure(False, args, batches), measure(True, args, batches)]
    for row in rows:
        print(json.dumps(row))
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "args": vars(args), "packed_over_unpacked": round(ratio, 4),
               "within_5_percent": ratio >= 0.95}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
