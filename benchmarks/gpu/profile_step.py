"""Where the GPU training step's time goes: torch.profiler over eager steps of
runtime/cuda/step.py (the same kernels the CUDA graph replays), kernels grouped by name,
and the host time of one eager step against one graph replay.

    python benchmarks/gpu/profile_step.py [--layers 22 --batch 4 --seq 2048 --top 30]
    python benchmarks/gpu/profile_step.py --shape llama3-8b --batch 1 --lora   # LoRA r16, all 7
    python benchmarks/gpu/profile_step.py --clip-grad 1.0   # global clipping (gradients held)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from runtime.cuda.step import TrainStep  # noqa: E402
from train_step import tiny_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--derive-written", action="store_true")
    parser.add_argument("--attention", default="cudnn,flash", help="backends in order")
    parser.add_argument("--budget", type=float, help="memory budget in GiB (planner decides)")
    parser.add_argument("--no-arena", dest="arena", action="store_false",
                        help="activations from torch's allocator (TrainStep(arena=False)); "
                             "on the arena (the default) the copies are listed by shape")
    parser.add_argument("--shape", choices=("tinyllama", "llama3-8b"), default="tinyllama")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA rank 16, alpha 32 on q,k,v,o,gate,up,down (base frozen)")
    parser.add_argument("--clip-grad", type=float, help="global gradient-norm clipping")
    args = parser.parse_args()
    from runtime.cuda.step import AdamWConfig

    shape = tiny_llama(args.layers) if args.shape == "tinyllama" else dict(
        vocab_size=128256, d_model=4096, n_layers=args.layers if args.layers != 22 else 32,
        num_heads=32, num_kv_heads=8, d_ff=14336, max_seq=8192, eps=1e-5,
        rope_theta=500000.0)
    lora = dict(rank=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]) \
        if args.lora else None
    step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, lora=lora,
                                 adamw=AdamWConfig(clip_grad=args.clip_grad),
                                 batch=args.batch, seq=args.seq,
                                 derive_written=args.derive_written,
                                 attention=tuple(args.attention.split(",")),
                                 arena=args.arena,
                                 **({"memory_budget": int(args.budget * 2**30)}
                                    if args.budget else {})).init_random()
    tokens = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), dtype=torch.int32,
                           device="cuda")
    for _ in range(2):
        step(tokens)
    host, eager = _timed(step, tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(tokens)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top,
                                    max_name_column_width=70))
    if args.arena:
        _copies(step, tokens, args.top)
    if args.lora:
        _lora_paths(step, tokens)
    step.capture(warmup=1)
    replay_host, replay = _timed(step, tokens)
    print(f"eager step: host {host * 1e3:.1f} ms, wall {eager * 1e3:.1f} ms; "
          f"graph replay: host {replay_host * 1e3:.2f} ms, wall {replay * 1e3:.1f} ms")


def _copies(step, tokens, top: int) -> None:
    """The copies of one eager step by shape (the arena copies each result it did not get
    written into its planned bytes)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step(tokens)
        torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=True)
    copies = sorted((a for a in averages if a.key == "aten::copy_"),
                    key=lambda a: -a.device_time_total)
    total = sum(a.device_time_total for a in copies)
    print(f"copies: {sum(a.count for a in copies)} calls, {total / 1e3:.1f} ms on the GPU")
    for a in copies[:top]:
        print(f"{a.count:6d} x {a.device_time_total / 1e3:8.2f} ms  {a.input_shapes}")
    print("copied into the arena, by value (function, value, op, shape):")
    for key, count in sorted(_copied_values(step, tokens).items(), key=lambda kv: -kv[1]):
        print(f"{count:6d} x  {' '.join(map(str, key))}")


def _copied_values(step, tokens) -> Counter:
    """One eager step with the arena's placing and handing over watched: each result that
    ended in other bytes than the kernel wrote it to."""
    from runtime.arena import Arena

    seen, place, into = Counter(), Arena.place, Arena._into

    def placing(self, frame, node, value, tensor):
        placed = place(self, frame, node, value, tensor)
        if isinstance(tensor, torch.Tensor) and placed.data_ptr() != tensor.data_ptr():
            seen[(frame.function.name, value, node.target if node else "-",
                  tuple(tensor.shape))] += 1
        return placed

    def handing(self, where, tensor):
        if where.data_ptr() != tensor.data_ptr():
            seen[("into given bytes", tuple(tensor.shape))] += 1
        return into(self, where, tensor)
    Arena.place, Arena._into = placing, handing
    try:
        step(tokens)
        torch.cuda.synchronize()
    finally:
        Arena.place, Arena._into = place, into
    return seen


def _lora_paths(step, tokens) -> None:
    """One eager step's count of LoRA's fused paths (runtime/cuda/step_interpreter.py):
    4 a layer each on the arena (qkv, o, gate_up, down)."""
    runs, make = [], step.interpreter

    def recorded(*args, **kwargs):
        runs.append(make(*args, **kwargs))
        return runs[-1]
    step.interpreter = recorded
    try:
        step(tokens)
        torch.cuda.synchronize()
    finally:
        del step.interpreter
    for run in runs:
        print(f"LoRA paths: delta + add as one addmm {run.lora_fused}, of them the delta "
              f"first into y's bytes {run.lora_into_planned}; backward d_x sums as addmms "
              f"{run.lora_dx_fused}")


def _timed(step, tokens) -> tuple[float, float]:
    """(host seconds to launch one step, wall seconds until it has run)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step(tokens)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host, time.perf_counter() - start


if __name__ == "__main__":
    main()

