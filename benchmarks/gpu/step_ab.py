"""A/B of one environment switch on the captured GPU step, both sides in one process.

Step medians move by 1-2 ms between processes and device calls on a power-capped card
(LoRA 8B on one H100: 118-132 ms between the steps of one run), as much as the changes
being measured. Here the step is built and captured twice in one process, the switch
(`--switch NAME`, an environment variable the step reads when it loads and captures)
set to each of `--values` in turn, and the captured graphs are replayed alternately,
A B A B ..., so that both sides share the card's temperature and clock drift; per side the
median, min and max of `--steps` replays (CUDA events around each), and the last value
against the first replay by replay (the median of the rounds' differences and its 95%
bootstrap interval: harness.paired_change). The two steps hold
their memory at once (LoRA 8B at B=1, T=2048: ~26 GiB each).

    python3 benchmarks/gpu/step_ab.py --switch MODULEC_LORA_KCAT [--values 0,1]
        [--shape llama3-8b|tinyllama] [--lora] [--batch 1] [--seq 2048] [--steps 40]
        [--json F]
    python3 benchmarks/gpu/step_ab.py --switch MODULEC_GEMM_TUNE --shape tinyllama --batch 4

`--switch A,B`: both variables set to each value together (changes measured as one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]

from benchmarks.train_step import tiny_llama  # noqa: E402
from lora_peers import SHAPES, TARGETS  # noqa: E402

# the LoRA peers' shapes and the full fine-tuning benchmarks' TinyLlama (22 layers)
STEP_SHAPES = {**SHAPES, "tinyllama": tiny_llama(22)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True)
    parser.add_argument("--values", default="0,1")
    parser.add_argument("--shape", choices=sorted(STEP_SHAPES), default="llama3-8b")
    parser.add_argument("--lora", action="store_true", help="rank 16 / alpha 32, 7 targets")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    import torch

    from benchmarks.harness import alternated, ms_summary, paired_change, random_tokens

    shape = STEP_SHAPES[args.shape]
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"]).to(torch.int32)
    values = args.values.split(",")
    steps = {value: captured(args, shape, tokens, value) for value in values}
    times = alternated({v: (lambda s=s: s(tokens)) for v, s in steps.items()}, args.steps,
                       gpu_ms)
    rows = ms_summary(times)
    change = paired_change(times, values[0], values[-1]) if len(values) > 1 else None
    print(f"{torch.cuda.get_device_name()}: {args.shape}{' LoRA' if args.lora else ''} "
          f"B={args.batch} T={args.seq}, {args.steps} replays a side, alternating")
    for value, row in rows.items():
        print(f"{args.switch}={value}: median {row['median_ms']:.2f} ms (min "
              f"{row['min_ms']:.2f}, max {row['max_ms']:.2f})")
    if change:
        low, high = change["ci95_ms"]
        print(f"{values[-1]} - {values[0]}, replay by replay: median "
              f"{change['median_diff_ms']:+.2f} ms (95% interval {low:+.2f} .. {high:+.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"switch": args.switch, "shape": args.shape,
                                               "lora": args.lora, "batch": args.batch,
                                               "seq": args.seq, "rows": rows,
                                               "change": change}, indent=1))


def gpu_ms(run) -> float:
    """One call of `run` between CUDA events, waited for."""
    import torch

    start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def captured(args, shape, tokens, value):
    """A TrainStep loaded and captured with the switch at `value` (random weights)."""
    import torch

    from runtime.cuda.step import TrainStep

    for name in args.switch.split(","):  # several switches: each set to the value
        os.environ[name] = value
    lora = dict(rank=16, alpha=32, targets=list(TARGETS)) if args.lora else None
    step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=args.batch,
                                 seq=args.seq, lora=lora)
    step.init_random(0)
    torch.cuda.empty_cache()
    step.set_batch(tokens)
    step(tokens)
    step.capture(warmup=2)
    return step


if __name__ == "__main__":
    main()
