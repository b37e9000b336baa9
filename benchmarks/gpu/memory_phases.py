"""Where the GPU step's peak memory is (issue 6): one eager step of the TinyLlama shape,
with memory allocated and the peak after each phase (forward, LM head + loss, backward),
and the storages the forward keeps for the backward grouped by function (unique storages:
a view keeps its whole buffer alive).

    python benchmarks/gpu/memory_phases.py [--budget GiB] [--attention cudnn,flash]
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu.budget_memory import frames  # noqa: E402
from benchmarks.train_step import tiny_llama  # noqa: E402
from runtime.cuda.lm_head import lm_head_cross_entropy  # noqa: E402
from runtime.cuda.step import TrainStep  # noqa: E402

GiB, MiB = 2**30, 2**20


def kept_storages(root) -> dict:
    """function name -> {storage pointer: bytes} of the tensors the forward frames hold."""
    by_function, seen = defaultdict(dict), set()
    for f in frames(root):
        for t in f.env.values():
            if isinstance(t, torch.Tensor) and t.is_cuda and any(t.stride()):
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    by_function[f.function.name][s.data_ptr()] = s.nbytes()
    return by_function


def phase(name, base):
    torch.cuda.synchronize()
    now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    print(f"{name:>10}: allocated {(now - base) / GiB:6.2f} GiB above fixed, "
          f"peak {peak / GiB:6.2f} GiB")
    torch.cuda.reset_peak_memory_stats()


def pcie():
    """GB/s of one 1 GiB pinned copy each way (the swaps' link)."""
    device = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    for name, dst, src in (("device -> host", host, device), ("host -> device", device, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        print(f"pinned copy {name}: {GiB / start.elapsed_time(end) / 1e6:.1f} GB/s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float)
    p.add_argument("--attention", default="cudnn,flash")
    p.add_argument("--plan-device", default="h200-noswap")
    p.add_argument("--pcie", action="store_true", help="time pinned host copies first")
    args = p.parse_args()
    if args.pcie:
        pcie()
    options = {} if args.budget is None else {"memory_budget": int(args.budget * GiB),
                                              "plan_device": args.plan_device}
    step = TrainStep.from_module(ROOT / "std/models/llama.module", tiny_llama(22), batch=4,
                                 seq=2048, derive_written=True,
                                 attention=tuple(args.attention.split(",")), **options)
    step.init_random()
    step.set_batch(torch.randint(0, 32000, (4, 2048), dtype=torch.int32, device="cuda"))
    step.step_count.add_(1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    print(f"fixed state {base / GiB:.2f} GiB")
    torch.cuda.reset_peak_memory_stats()
    run = step.interpreter(step._update)
    (out,), frame = run.forward([step.tokens])
    phase("forward", base)
    shown = set()
    for f in frames(frame):  # one instance of each function: its values' storages
        if f.function.name in shown or not f.env:
            continue
        shown.add(f.function.name)
        print(f"    one {f.function.name}:")
        for value, t in f.env.items():
            if isinstance(t, torch.Tensor) and t.is_cuda:
                print(f"      {value}: {tuple(t.shape)} strides {t.stride()} storage "
                      f"{t.untyped_storage().data_ptr() % 10**6} "
                      f"{t.untyped_storage().nbytes() / MiB:.1f} MiB")
    head = step.split.head_param
    loss, seed, d_head = lm_head_cross_entropy(out, step.compute[head], step.labels,
                                               step.chunk_rows)
    del out
    phase("LM head", base)
    _, grads = run.backward(frame, [seed])
    phase("backward", base)


if __name__ == "__main__":
    main()
