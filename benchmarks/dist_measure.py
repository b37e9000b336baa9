"""Ranks, timing, peak memory and communication of one variant's processes
(benchmarks/train_step_dist.py's children): shared by its modulec and HF variants. What
is not one process's (benchmarks/harness.py has those): every step started together on
all ranks (a barrier), figures reduced over the ranks, rank 0 writing the row, and the
profiler's communication figures."""

from __future__ import annotations

import os
import time

from benchmarks import harness


class Ranks:
    """This process's place in the run: rank, world, device; collectives for reporting."""

    def __init__(self, device: str):
        import torch
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.kind = device
        self.device = torch.device(f"cuda:{self.local}" if device == "cuda" else "cpu")
        if device == "cuda":
            torch.cuda.set_device(self.local)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")

    def sync(self) -> None:
        import torch
        import torch.distributed as dist

        if self.kind == "cuda":
            torch.cuda.synchronize()
        if self.world > 1:
            dist.barrier()

    def reduce(self, values: list[float], op: str) -> list[float]:
        """Elementwise max or mean of `values` over ranks."""
        import torch
        import torch.distributed as dist

        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [v / self.world if op == "mean" else v for v in t.tolist()]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def batch_for(args, vocab: int, ranks: Ranks, dp_rank: int | None = None):
    """Data-parallel rank r's [B, T] int32 tokens (seed 1 + r; rank 0's is train_step.py's
    batch). `dp_rank`: under tensor parallel, the ranks of one TP group share a batch
    (None: every process is its own data-parallel rank)."""
    return harness.random_tokens(args.batch, args.seq, vocab, ranks.device,
                                 seed=1 + (ranks.rank if dp_rank is None else dp_rank))


def timed(step, ranks: Ranks, warmup: int, steps: int) -> dict:
    """Median step time, every step started together on all ranks (see the docstring)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        ranks.sync()
        began = time.perf_counter()
        step()
        if ranks.kind == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    times = sorted(ranks.reduce(times, "max"))
    return {"step_s": times[len(times) // 2], "step_s_min": times[0], "step_s_max": times[-1]}


def timed_b2b(step, ranks: Ranks, steps: int) -> float | None:
    """The harness's timer (CUDA events, back-to-back steps), max over ranks."""
    if ranks.kind != "cuda":
        return None
    ranks.sync()
    return ranks.reduce([harness.timed(step, 0, steps)["step_s"]], "max")[0]


def peak_bytes(ranks: Ranks) -> float | None:
    import torch

    if ranks.kind != "cuda":
        return None
    from runtime.dist.ce_gather import peak_allocated

    return ranks.reduce([float(peak_allocated())], "max")[0]


def device_name(ranks: Ranks) -> str:
    import torch

    return torch.cuda.get_device_name() if ranks.kind == "cuda" else "cpu"


def reset_peak(ranks: Ranks) -> None:
    """The peak counted from here, the cache emptied first (what the build freed)."""
    if ranks.kind == "cuda":
        import torch

        torch.cuda.empty_cache()
    harness.reset_peak(ranks.kind)


# ------------------------------------------------------------------ communication exposed
def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_times(trace_events: list[dict]) -> tuple[float, float, int]:
    """(NCCL kernel time, the part of it no other GPU work overlaps, kernels seen) in us,
    from a chrome trace's device events."""
    comm, busy, seen = [], [], 0
    for e in trace_events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        seen += 1
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if "nccl" in e.get("name", "").lower() else busy).append(span)
    comm, busy = union(comm), union(busy)
    total = sum(b - a for a, b in comm)
    return total, total - covered(comm, busy), seen


def exposed_comm(step, ranks: Ranks, steps: int) -> dict:
    """Profile `steps` steps on every rank; NCCL time and its exposed part per step."""
    if ranks.kind != "cuda" or steps <= 0:
        return {}
    ranks.sync()
    events = harness.profiled_events(lambda: [step() for _ in range(steps)])
    total, exposed, seen = comm_times(events)
    table = kernel_table(events, steps)
    total, exposed, seen = ranks.reduce([total / steps, exposed / steps, seen], "max")
    if not seen:
        return {"comm_note": "the profiler saw no device kernels"}
    return {"comm_s": total / 1e6, "exposed_comm_s": exposed / 1e6, "kernels_rank0": table}


def kernel_table(trace_events: list[dict], steps: int, top: int = 12) -> dict:
    """Where one rank's GPU time goes, per step in ms: each stream's busy time (the union
    of its kernels', copies' and memsets' intervals), the span from the first to the last
    device event, and the `top` kernels by total time with their streams and counts. Run
    beside modulec_1gpu's table it splits a data-parallel step's extra time into kernels
    that ran longer (contention) and time no stream was busy (waiting)."""
    streams: dict[str, list] = {}
    names: dict[str, list] = {}
    for e in trace_events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        stream = str(e.get("args", {}).get("stream", "?"))
        streams.setdefault(stream, []).append((start, start + dur))
        entry = names.setdefault(e.get("name", "?")[:90], [0.0, 0, set()])
        entry[0] += dur
        entry[1] += 1
        entry[2].add(stream)
    if not streams:
        return {}
    spans = [s for spans in streams.values() for s in spans]
    all_busy = union(spans)
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    return {"span_ms": ms(max(b for _, b in spans) - min(a for a, _ in spans)),
            "any_stream_busy_ms": ms(sum(b - a for a, b in all_busy)),
            "stream_busy_ms": {k: ms(sum(b - a for a, b in union(v)))
                               for k, v in sorted(streams.items())},
            "top": [{"name": n, "ms": ms(t), "calls": c // steps, "streams": sorted(st)}
                    for n, (t, c, st) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]}


def measure(step, loss_of, ranks: Ranks, args) -> dict:
    """Timing, peak, loss and communication of a prepared step (peak counters reset)."""
    result = timed(step, ranks, args.warmup, args.steps)
    result["peak_bytes"] = peak_bytes(ranks)
    result["loss"] = ranks.reduce([loss_of()], "mean")[0]
    result["step_s_b2b"] = timed_b2b(step, ranks, args.steps)
    save(args, ranks, result)  # kept if the profiler fails or crashes the process
    try:
        result.update(exposed_comm(step, ranks, args.profile_steps))
    except Exception as exc:  # the timings stand without it
        result["comm_note"] = f"profiler failed: {type(exc).__name__}: {exc}"[:200]
    return result


def save(args, ranks: Ranks, result: dict) -> None:
    if ranks.rank == 0:
        harness.write_json(args.result, dict(result, gpus=ranks.world))

