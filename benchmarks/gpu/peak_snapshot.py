"""What is allocated at the GPU step's peak (issue 6 item 1: the arena's peak against the
plan's prediction): one eager step of the TinyLlama shape under torch's memory history,
the allocation events replayed to the moment of the highest total, and the blocks alive
then, grouped by where in this repository they were allocated.

    python benchmarks/gpu/peak_snapshot.py [--budget GiB] [--no-arena] [--written] [--top 25]

(`--written`: the source's backward sections, as `modulec train` runs it; else derived.)
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from runtime.cuda.step import TrainStep  # noqa: E402
from train_step import tiny_llama  # noqa: E402

GiB, MiB = 2**30, 2**20


def live_at_peak(events: list) -> tuple[int, dict]:
    """(the highest total of allocated bytes, {address: event} alive at that moment)."""
    live, total, best, at_best = {}, 0, 0, {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif event["action"] in ("free_requested", "free") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return best, at_best


def where(event, depth: int = 1) -> str:
    """The `depth` innermost frames in this repository that allocated it."""
    found = [f"{Path(f['filename']).relative_to(ROOT)}:{f.get('line')} {f.get('name')}"
             for f in event.get("frames", []) if str(ROOT) in f.get("filename", "")
             and "peak_snapshot" not in f.get("filename", "")]
    return " < ".join(found[:depth]) or "(outside the repository)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float)
    parser.add_argument("--no-arena", dest="arena", action="store_false")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--written", action="store_true")
    parser.add_argument("--depth", type=int, default=1, help="repository frames per place")
    args = parser.parse_args()
    options = {"memory_budget": int(args.budget * GiB)} if args.budget else {}
    step = TrainStep.from_module(ROOT / "std/models/llama.module", tiny_llama(22), batch=4,
                                 seq=2048, derive_written=not args.written, arena=args.arena,
                                 **options).init_random()
    tokens = torch.randint(0, 32000, (4, 2048), dtype=torch.int32, device="cuda")
    for _ in range(2):
        step(tokens)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step(tokens)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][0]
    best, alive = live_at_peak(events)
    print(f"before the step {base / GiB:.2f} GiB; peak {torch.cuda.max_memory_allocated() / GiB:.2f}"
          f" GiB; allocated during the step and alive at its peak {best / GiB:.3f} GiB "
          f"({len(alive)} blocks)")
    if step.activations is not None:
        print("arena regions:", {k: f"{v / GiB:.3f} GiB" for k, v in
                                 step.activations.bytes_of().items()})
    groups = defaultdict(lambda: [0, 0])
    for event in alive.values():
        groups[where(event, args.depth)][0] += event["size"]
        groups[where(event, args.depth)][1] += 1
    for place, (size, count) in sorted(groups.items(), key=lambda g: -g[1][0])[:args.top]:
        print(f"{size / MiB:10.1f} MiB {count:5d}  {place}")


if __name__ == "__main__":
    main()
