"""The GPU step's 2-D GEMMs with a measured algorithm (`mm_into`).

torch's `mm` / `addmm` run the algorithm cuBLAS's heuristic ranks first. For some of the
step's shapes another of cuBLASLt's candidates is faster (H100, bf16: LoRA 8B's gate/up
d_x 0.718 -> 0.672 ms, its head 3.48 -> 2.91 ms; `benchmarks/kernels/bench_gemm_algos.py`).
So the first time the step runs a GEMM of a given problem (shapes, strides, dtype,
alignment, whether beta reads the old output), eagerly, `mm_into` times torch's call and
each of cuBLASLt's candidates (`TUNE_CANDIDATES`, in rounds, median) and keeps the
fastest; later calls, the captured CUDA graph's included, run that one. A problem first
met while a graph is being captured (no timing can run then) runs torch's call.

The choice is per process: two processes may pick different algorithms for one problem,
whose sums round differently (within bf16's rounding of fp32 accumulation). Steps that
must repeat bit for bit across processes set MODULEC_GEMM_TUNE=0 (torch's call always).
`choices()` lists what was picked (`modulec train` prints a summary; docs/gpu.md).
"""

from __future__ import annotations

import os

import torch

TUNE_CANDIDATES = 8  # cuBLASLt's first 8 (8 was all it offered for the measured shapes)
ROUNDS, ITERS = 3, 3  # timing: ROUNDS rounds of ITERS runs of every candidate
TORCH = -1  # the choice "torch's own call"
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU clock: longer than the host takes to queue ITERS

_choices: dict[tuple, int] = {}  # problem -> TORCH or a candidate index
_timings: dict[tuple, list[float]] = {}  # problem -> median ms (torch first), for reports


def enabled() -> bool:
    return os.environ.get("MODULEC_GEMM_TUNE", "1") != "0"


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float = 1.0,
            beta: float = 0.0) -> torch.Tensor:
    """out = alpha * a @ b + beta * out (2-D; out's old values are not read when beta is
    0) with the problem's measured algorithm where it can run one, else torch's."""
    key = _problem(a, b, out, beta)
    choice = TORCH if key is None else _choices.get(key)
    if choice is None:
        choice = TORCH if torch.cuda.is_current_stream_capturing() else _tune(key, a, b, out,
                                                                            beta)
    if choice == TORCH:
        return _torch_mm(a, b, out, alpha, beta)
    _lt(a, b, out, alpha, beta, choice)
    return out


def choices() -> dict[tuple, int]:
    """{problem: choice} so far (TORCH, or the index of cuBLASLt's candidate)."""
    return dict(_choices)


def summary() -> str:
    """One line: how many GEMM problems were timed and what the choices saved there."""
    if not _timings:
        return ""
    torch_ms = sum(t[0] for t in _timings.values())
    best_ms = sum(min(t) for t in _timings.values())
    moved = sum(1 for c in _choices.values() if c != TORCH)
    return (f"GEMM algorithms: {len(_timings)} problems timed, {moved} run a cuBLASLt "
            f"candidate other than torch's; {torch_ms:.2f} -> {best_ms:.2f} ms per pass "
            "over them, one call each")


def _torch_mm(a, b, out, alpha: float, beta: float) -> torch.Tensor:
    if beta == 0.0 and alpha == 1.0:
        return torch.mm(a, b, out=out)
    return out.addmm_(a, b, beta=beta, alpha=alpha)  # beta = 0: out's bytes are not read


def _problem(a, b, out, beta: float) -> tuple | None:
    """The key of a GEMM cuBLASLt can run here (bindings_gemm.cpp's terms), or None."""
    if not enabled() or not all(isinstance(t, torch.Tensor) for t in (a, b, out)):
        return None
    if not (a.is_cuda and a.dim() == b.dim() == out.dim() == 2) \
            or a.dtype not in (torch.bfloat16, torch.float16) \
            or not (a.dtype == b.dtype == out.dtype) \
            or not (a.device == b.device == out.device) \
            or 0 in (a.shape[0], a.shape[1], b.shape[1]) \
            or out.stride(1) != 1 or not (_unit(a) and _unit(b)):
        return None
    return (a.device.index, a.dtype, beta != 0.0, *a.shape, b.shape[1], a.stride(), b.stride(),
            out.stride(), _align(a), _align(b), _align(out))


def _unit(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 or t.stride(0) == 1


def _align(t: torch.Tensor) -> int:
    address, align = t.data_ptr(), 256
    while align > 1 and address % align:
        align //= 2
    return align


def _lt(a, b, out, alpha: float, beta: float, index: int) -> None:
    from runtime.cuda.build import load

    load().gemm_run(a, b, out, alpha, beta, TUNE_CANDIDATES, index)


def _tune(key, a, b, out, beta: float) -> int:
    """Time torch's call and every candidate on these operands; keep the fastest. Runs
    into `out` (its old values restored where beta reads them); where the copy of out
    does not fit in memory, or the extension does not load, torch's call is kept."""
    try:
        from runtime.cuda.build import load

        found = load().gemm_candidates(a, b, out, beta != 0.0, TUNE_CANDIDATES)
        saved = out.clone() if beta != 0.0 else None
    except (RuntimeError, ImportError, OSError):  # no room for the copy, no extension
        _choices[key] = TORCH
        return TORCH
    runs = {TORCH: lambda: _torch_mm(a, b, out, 1.0, beta)}
    runs.update({i: (lambda i=i: _lt(a, b, out, 1.0, beta, i)) for i in _running(a, b, out,
                                                                                beta, found)})
    times = dict(zip(runs, _median_times(list(runs.values()))))
    if saved is not None:
        out.copy_(saved)
    best = min(times, key=times.get)
    _choices[key], _timings[key] = best, list(times.values())  # torch's first
    return best


def _running(a, b, out, beta: float, found: int) -> list[int]:
    """The candidates that run on these operands (cuBLASLt may refuse one it offered)."""
    ok = []
    for i in range(found):
        try:
            _lt(a, b, out, 1.0, beta, i)
            ok.append(i)
        except RuntimeError:
            continue
    return ok


def _median_times(runs: list) -> list[float]:
    """Median ms per run over ROUNDS rounds, each round timing every run in turn (a card
    under a power cap slows as it heats: the rounds share that drift out). A sleeping
    kernel ahead of each timed group lets the host queue the whole group first, so a
    small GEMM is timed on the GPU alone, as the captured graph will run it, not at the
    host's launch rate."""
    for run in runs:
        run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(ROUNDS):
        for i, run in enumerate(runs):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            for _ in range(ITERS):
                run()
            stop.record()
            stop.synchronize()
            samples[i].append(start.elapsed_time(stop) / ITERS)
    return [sorted(s)[len(s) // 2] for s in samples]
