"""What the step benchmarks share (benchmarks/train_step.py, train_step_dist.py,
benchmarks/gpu/moe_step.py, mamba_step.py, fusions_step.py, lora_peers.py, lora_step.py):

    in the parent   launch: one variant in a process of its own (a session of its own: past
                    the timeout it is killed with every process under it, so no compile
                    worker or torchrun worker keeps the GPU's memory), its row the JSON the
                    child wrote to its result file; command (python, or torchrun over N
                    processes), Deadline (a whole run's seconds), forward_args, progress,
                    add_rates, finish
    in the child    timed: warmup steps, then the timed ones (CUDA events between
                    back-to-back steps on the GPU: median, min, max); variant_row (the
                    peak memory added, out of memory made an error row); random_tokens,
                    hf_step, gemm_ceiling; alternated / ms_summary: an A/B's sides timed
                    in turn within one process (gpu/step_ab.py, gpu/dist_probe.py --ab)
    the table       Column, header, table_rows, versus_best: fixed-width rows, a failed
                    variant's last error line in its row, a variant not run its reason

Nothing here imports torch at import time: a parent that only launches variants creates
no CUDA context beside theirs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PEAK = 989e12  # H100 / H200 dense bf16 FLOP/s


# ------------------------------------------------------------------ the variant's process
def sync(device: str = "cuda") -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def reset_peak(device: str = "cuda") -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def timed(step: Callable[[], object], warmup: int, steps: int, device: str = "cuda") -> dict:
    """`warmup` calls of `step`, a sync, then `steps` timed calls: on the GPU CUDA events
    between back-to-back steps, elsewhere perf_counter around each. Seconds per step:
    the median (step_s), min and max."""
    for _ in range(warmup):
        step()
    sync(device)
    times = sorted(_event_times(step, steps) if device == "cuda" else _wall_times(step, steps))
    return {"step_s": times[len(times) // 2], "step_s_min": times[0], "step_s_max": times[-1]}


def alternated(runs: dict, rounds: int, time_one) -> dict[str, list[float]]:
    """`rounds` rounds, each timing every run once in turn (A B A B ...), so that all
    sides meet the same clock and temperature drift: {name: [ms, ...]}; `time_one(run)`
    times one call."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(time_one(run))
    return times


def ms_summary(times: dict) -> dict:
    """{name: {median_ms, min_ms, max_ms}} of `alternated`'s times."""
    import statistics

    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
            for name, t in times.items()}


def paired_change(times: dict, before: str, after: str, resamples: int = 2000,
                  seed: int = 0) -> dict:
    """`after` against `before` from `alternated`'s times, round by round: each round's
    difference (after - before, ms) is taken between replays run back to back, so the
    card's slow drift (heat, clocks at the power cap) cancels; the median difference and
    a 95% bootstrap interval of it (`resamples` draws of the rounds, with replacement;
    a fixed seed: the same report for the same times)."""
    import random
    import statistics

    diffs = [b - a for a, b in zip(times[before], times[after])]
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(diffs, k=len(diffs)))
                     for _ in range(resamples))
    return {"median_diff_ms": statistics.median(diffs),
            "ci95_ms": (medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1])}


def _event_times(step, steps: int) -> list[float]:
    import torch

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        step()
        marks[i + 1].record()
    torch.cuda.synchronize()
    return [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)]


def _wall_times(step, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        out.append(time.perf_counter() - began)
    return out


@contextmanager
def card_power(device: str = "cuda"):
    """The energy the card used while the block ran, from NVML's energy counter (mJ since
    the driver loaded; read before and after): yields a dict that gets `joules` and
    `power_w` (joules over the block's wall time) on exit; nothing where the device is not
    a GPU or NVML is missing. A step at the card's power cap takes the time its energy
    allows, so the energy of a step is what its time follows."""
    found: dict = {}
    read = _energy_counter() if device == "cuda" else None
    if read is None:
        yield found
        return
    before, started = read(), time.perf_counter()
    try:
        yield found
    finally:
        joules, seconds = (read() - before) / 1e3, time.perf_counter() - started
        if joules > 0 and seconds > 0:
            found.update(joules=joules, power_w=joules / seconds)


def _energy_counter():
    """A function reading the current GPU's NVML energy counter (mJ), or None (no NVML, an
    older card, or the GPU not found). The GPU is found by its PCI address, which NVML and
    CUDA agree on (their indices may not)."""
    import ctypes

    import torch

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    millijoules = ctypes.c_ulonglong()

    def read() -> int:
        if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) != 0:
            return 0
        return millijoules.value
    return read if read() > 0 else None


def with_energy(result: dict, power: dict, steps: int) -> dict:
    """`result` (a timed run of `steps` steps) with the card's mean power through it and
    the energy of a step (joules_per_step: the run's joules over its steps), where
    measured (card_power)."""
    if power.get("joules") and steps:
        result.update(power_w=power["power_w"], joules_per_step=power["joules"] / steps)
    return result


def profiled_events(run: Callable[[], object]) -> list[dict]:
    """The chrome-trace events of torch's profiler (CUDA activity) around `run()` and a
    sync: each kernel, memset and copy, a CUDA graph's nodes included."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def random_tokens(batch: int, seq: int, vocab: int, device: str = "cuda", dtype=None,
                  seed: int = 1):
    """The benchmarks' batch: [batch, seq] ids (int32 unless `dtype`) drawn from a
    generator seeded `seed` (1: the same batch in every variant's process)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g,
                         dtype=dtype or torch.int32).to(device)


def hf_step(forward, optimizer, tokens, device: str = "cuda", autocast: bool = True, **kw):
    """transformers' training step as the peers run it: the loss of `forward(input_ids=tokens,
    labels=tokens, **kw)` under autocast bf16 (unless `autocast` is off), backward, the
    optimizer's step, gradients set to None. (step, box): box["loss"] is the last loss."""
    import torch

    box = {}

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=tokens, labels=tokens, **kw).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        box["loss"] = loss.detach()

    return step, box


def variant_row(run: Callable[[], dict], device: str = "cuda", all_errors: bool = False) -> dict:
    """`run()`'s row with peak_bytes (torch.cuda.max_memory_allocated) on the GPU. Out of
    memory is the row {"error": "out of memory: ..."}; with `all_errors` every exception is
    a row {"error": "Type: message", "oom": bool} (its traceback printed), else it
    propagates (the process fails; launch reports its output)."""
    try:
        row = run()
        if device == "cuda":
            import torch

            row["peak_bytes"] = torch.cuda.max_memory_allocated()
        return row
    except Exception as exc:  # noqa: BLE001 (reported as the variant's failure)
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        if all_errors:
            import traceback

            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "oom": oom}
        if type(exc).__name__ != "OutOfMemoryError":
            raise
        return {"error": f"out of memory: {str(exc)[:200]}"}


def write_json(path, value) -> None:
    Path(path).write_text(json.dumps(value))


def gemm_ceiling(n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n GEMM, median of 20 (the MFUgemm columns' ceiling)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(20):
        events[0].record()
        a @ b
        events[1].record()
        torch.cuda.synchronize()
        times.append(events[0].elapsed_time(events[1]) / 1e3)
    del a, b
    torch.cuda.empty_cache()  # the variants' processes get the memory back
    return 2 * n ** 3 / sorted(times)[len(times) // 2]


# ------------------------------------------------------------------ the parent
MIN_VARIANT_S = 20  # under a Deadline, a variant left less than this is not started


class Deadline:
    """A whole run's `seconds` (None: no bound), counted from now: `timeout(t)` is a
    variant's timeout, `t` cut to the whole seconds left, or None when fewer than
    MIN_VARIANT_S are left (the variant is not started: `not_run()` is its row)."""

    def __init__(self, seconds: int | None):
        self.seconds, self.began = seconds, time.monotonic()
        self.left: int | None = seconds  # at the last timeout()

    def timeout(self, timeout: float | None) -> float | None:
        if self.seconds is None:
            return timeout
        self.left = int(self.seconds - (time.monotonic() - self.began))
        if self.left < MIN_VARIANT_S:
            return None
        return self.left if timeout is None else min(timeout, self.left)

    def not_run(self) -> dict:
        return {"unavailable": f"not run: {self.left} s left of --deadline {self.seconds}"}


def command(script, procs: int = 1) -> list[str]:
    """This Python running `script`: one plain process, or `procs` under torchrun on this
    host (--standalone), ranks in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    return [sys.executable, *(run if procs > 1 else []), str(script)]


def forward_args(args, *names: str) -> list[str]:
    """`--name value` for each attribute of `args` named (underscores as dashes), those
    that are None left out."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def launch(cmd: list[str], result: Path, timeout: float | None = None,
           log: Path | None = None, env: dict | None = None) -> dict:
    """Run `cmd` (one variant, which writes its row as JSON to `result`) in a session of
    its own, stdout and stderr together (into `log` when given); past `timeout` seconds
    it is killed with every process under it (`_kill_tree`). The row: the JSON in
    `result` when the child wrote it, else {"error": "timed out after N s"} or
    {"error": "exit status N: <output's end>"}."""
    result = Path(result)
    result.unlink(missing_ok=True)
    env = dict(env or os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=_pythonpath(env))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, timed_out = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        output, timed_out = proc.communicate()[0], True
    if log is not None:
        Path(log).write_text(output)
    if result.exists():
        return json.loads(result.read_text())
    if timed_out:
        return {"error": f"timed out after {timeout} s"}
    return {"error": f"exit status {proc.returncode}: {output[-1500:]}"}


def _kill_tree(pid: int) -> None:
    """SIGKILL to `pid`'s session and to every process under it with its process group:
    torchrun starts each worker in a session of its own, which a kill of torchrun's group
    alone leaves running (holding its GPU, and the output pipe the parent reads to its
    end). The tree is read (/proc) before anything dies, while the workers' parent is
    still torchrun; `pid` first, so no agent restarts a worker."""
    for p in [pid, *_descendants(pid)]:
        for kill, target in ((os.killpg, p), (os.kill, p)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone, or not a group leader
                pass


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, theirs, ...), from /proc ([] without it)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # ended while we read
            continue
        if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(
                int(entry.name))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def _pythonpath(env: dict | None) -> str:
    """The repository first, so a child finds `benchmarks`, `runtime` and `modulec`."""
    rest = (env or os.environ).get("PYTHONPATH")
    return f"{ROOT}{os.pathsep}{rest}" if rest else str(ROOT)


def progress(variant: str, row: dict, show: Callable[[dict], str] = str) -> None:
    """The line on stderr after each variant (`name: row`), as the device scripts grep."""
    print(f"{variant}: {show(row)}", file=sys.stderr, flush=True)


def add_rates(rows: dict, tokens: int, flops: float | None = None,
              gemm: float | None = None) -> None:
    """tokens_per_s for each measured row; with `flops` (per token) mfu_989 against PEAK,
    with `gemm` too mfu_gemm against the measured GEMM."""
    for r in rows.values():
        if "step_s" not in r:
            continue
        r["tokens_per_s"] = tokens / r["step_s"]
        if flops:
            r["mfu_989"] = r["tokens_per_s"] * flops / PEAK
            if gemm:
                r["mfu_gemm"] = r["tokens_per_s"] * flops / gemm


def finish(table: str, summary: dict, path: str | None, echo: bool = True) -> None:
    """Print the table, write the summary as JSON to `path` (if any), print it too unless
    `echo` is off."""
    print(table)
    text = json.dumps(summary, indent=2)
    if path:
        Path(path).write_text(text)
    if echo:
        print(text)


# ------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Column:
    """One right-aligned column: `row[key] * scale` formatted with `spec` in `width`
    characters (`value(row)` instead of `row[key]` when given; a string as it is); a row
    without a number there shows `missing` (padded to the width unless it is empty)."""

    title: str
    width: int
    key: str
    spec: str
    scale: float = 1.0
    missing: str = "-"
    value: Callable[[dict], object] | None = None

    def head(self) -> str:
        return f"{self.title:>{self.width}}"

    def cell(self, row: dict) -> str:
        value = self.value(row) if self.value else row.get(self.key)
        if isinstance(value, str):
            return f"{value:>{self.width}}"
        if not isinstance(value, (int, float)):
            return f"{self.missing:>{self.width}}" if self.missing else ""
        return format(value * self.scale if self.scale != 1.0 else value,
                      f">{self.width}{self.spec}")


def header(columns: list[Column], width: int, notes: bool = False) -> str:
    return f"{'variant':<{width}}" + "".join(c.head() for c in columns) + \
        ("  notes" if notes else "")


def table_rows(rows: dict, columns: list[Column], width: int, error_width: int = 90,
               note: Callable[[str, dict], str] | None = None,
               below: Callable[[str, dict], list[str]] | None = None,
               failed: Callable[[str, dict, str], str] | None = None) -> list[str]:
    """One line per variant: its cells (then `  note(name, row)`, then the lines of
    `below(name, row)`); for a row with an error `failed:` and its last line, for one not
    run (`unavailable`) the reason (`failed(name, row, why)` instead when given)."""
    lines = []
    for name, r in rows.items():
        why = why_not(r)
        if why is not None:
            lines.append(failed(name, r, why) if failed else f"{name:<{width}}  " +
                         ("" if "unavailable" in r else "failed: ") + why[:error_width])
            continue
        line = f"{name:<{width}}" + "".join(c.cell(r) for c in columns)
        lines.append(line + (f"  {note(name, r)}" if note else ""))
        lines += below(name, r) if below else []
    return lines


def why_not(row: dict) -> str | None:
    """Why a row has no figures: its `unavailable` reason (not run), or its error's last
    line; None for a measured row."""
    if row.get("unavailable"):
        return str(row["unavailable"])
    if "error" in row:
        return (str(row["error"]).strip().splitlines() or ["?"])[-1]
    return None


def best_peer(rows: dict, prefix: str = "hf") -> str | None:
    """The fastest measured variant whose name starts with `prefix`."""
    peers = {n: r["tokens_per_s"] for n, r in rows.items()
             if n.startswith(prefix) and "tokens_per_s" in r}
    return max(peers, key=peers.get) if peers else None


def versus_best(rows: dict, ours: str = "modulec") -> list[str]:
    """`modulec / best HF (name): N.NNx` when both were measured."""
    best = best_peer(rows)
    mine = rows.get(ours, {}).get("tokens_per_s")
    if not (mine and best):
        return []
    return [f"{ours} / best HF ({best}): {mine / rows[best]['tokens_per_s']:.2f}x"]
