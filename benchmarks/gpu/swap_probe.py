"""Where a swapping step's time and memory go (issue 6): the TinyLlama step at a budget
planned with swaps (h200) and without (h200-noswap), eager steps and CUDA-graph replays,
each with its own peak (torch.cuda.max_memory_allocated, reset before each phase).

    python benchmarks/gpu/swap_probe.py [--budget 21.2]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.train_step import tiny_llama  # noqa: E402
from runtime.cuda.step import TrainStep  # noqa: E402

GiB = 2**30


def timed(fn, n=1):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3, torch.cuda.max_memory_allocated() / GiB


def probe(budget: float, device: str) -> None:
    step = TrainStep.from_module(ROOT / "std/models/llama.module", tiny_llama(22), batch=4,
                                 seq=2048, derive_written=True,
                                 memory_budget=int(budget * GiB), plan_device=device)
    step.init_random()
    tokens = torch.randint(0, 32000, (4, 2048), dtype=torch.int32, device="cuda")
    step.set_batch(tokens)
    for phase in ("eager 1", "eager 2", "eager 3"):
        ms, peak = timed(lambda: step(tokens))
        print(f"{device:12} {phase:10} {ms:7.1f} ms  peak {peak:6.2f} GiB")
    ms, peak = timed(lambda: step.capture(warmup=0))
    print(f"{device:12} {'capture':10} {ms:7.1f} ms  peak {peak:6.2f} GiB")
    ms, peak = timed(lambda: step(tokens), 5)
    print(f"{device:12} {'replay':10} {ms:7.1f} ms  peak {peak:6.2f} GiB"
          f"  (reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB)")
    swaps = getattr(step, "swaps", None)
    if swaps is not None:
        print(f"{'':12} host buffers {sum(b.numel() for b in swaps.buffers.values()) / GiB:.2f} GiB")
    step = None  # noqa: F841  (frees the step before the next probe)
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=21.2)
    args = p.parse_args()
    for device in ("h200-noswap", "h200"):
        probe(args.budget, device)


if __name__ == "__main__":
    main()
