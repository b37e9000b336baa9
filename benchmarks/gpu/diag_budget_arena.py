"""Losses of the TinyLlama-shape step on the arena with a memory budget, eager then
captured (a check that nothing the backward reads lies in bytes reused since):

    python benchmarks/gpu/diag_budget_arena.py [GiB ...]
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from runtime.cuda.step import TrainStep  # noqa: E402
from train_step import tiny_llama  # noqa: E402

for gib in [float(a) for a in sys.argv[1:]] or [17.5]:
    step = TrainStep.from_module(ROOT / "std/models/llama.module", tiny_llama(22), batch=4,
                                 seq=2048, derive_written=True,
                                 memory_budget=int(gib * 2**30)).init_random()
    tokens = torch.randint(0, 32000, (4, 2048), dtype=torch.int32, device="cuda")
    print(gib, "eager", [round(float(step(tokens)), 4) for _ in range(3)], flush=True)
    step.capture(warmup=1)
    print(gib, "captured", [round(float(step(tokens)), 4) for _ in range(3)],
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    del step
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
