"""`@profile(name, memory=, cuda_events=, nvtx=)` (spec §7.7.2) in the runtime.

A node (an op, or a call: a whole submodule or stack) that carries `@profile` is timed as a
region: with CUDA events on the GPU (read when the report is asked for, so a step has no
host sync), with the wall clock on the CPU; NVTX ranges mark it for Nsight when the tensors
are on CUDA; `memory=true` records the bytes allocated over the region (CUDA) or the bytes
of its results (CPU). The backward of a profiled forward node is a region too, under the
same name with phase `backward`. Disabled (the default), the interpreter does not look at
annotations at all: profiling costs nothing.

    model.enable_profiling()
    model.forward(...); model.backward(...)
    model.profile_report()   # [{"name", "layer", "phase", "calls", "ms", "bytes"}, ...]
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from runtime.probes import _unquote


@dataclass
class _Region:
    name: str
    layer: int | None
    phase: str
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    events: list = field(default_factory=list)  # (start, end) CUDA events not yet read

    def milliseconds(self) -> float:
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        self.events.clear()
        return self.seconds * 1000


@dataclass
class Profiler:
    regions: dict = field(default_factory=dict)  # (name, layer, phase) -> _Region

    def spec_of(self, node, frame, graph) -> dict | None:
        """The `@profile` arguments of `node`, or of the forward node it differentiates."""
        found = _profile_args(node.annotations)
        origin = node.attr("forward_node")
        if found is None and origin and frame.function.gradient_of:
            forward = graph.function(frame.function.gradient_of)
            op = next((n for n in forward.nodes if n.id == origin), None)
            found = _profile_args(op.annotations) if op is not None else None
        return found

    @contextmanager
    def region(self, spec: dict, frame, phase: str, cuda: bool):
        region = self._region(spec["name"], frame, phase)
        nvtx = cuda and spec.get("nvtx", True)
        if nvtx:
            torch.cuda.nvtx.range_push(f"{spec['name']} ({phase})")
        before = torch.cuda.memory_allocated() if cuda and spec.get("memory") else 0
        timing = _CudaTiming() if cuda and spec.get("cuda_events", True) else _WallTiming()
        try:
            yield region
        finally:
            timing.stop(region)
            if cuda and spec.get("memory"):
                region.bytes = max(region.bytes, torch.cuda.memory_allocated() - before)
            if nvtx:
                torch.cuda.nvtx.range_pop()
            region.calls += 1

    def _region(self, name: str, frame, phase: str) -> _Region:
        layer = frame.indices[0] if frame.indices else None
        key = (name, layer, phase)
        if key not in self.regions:
            self.regions[key] = _Region(name, layer, phase)
        return self.regions[key]

    def report(self) -> list[dict]:
        return [{"name": r.name, "layer": r.layer, "phase": r.phase, "calls": r.calls,
                 "ms": round(r.milliseconds(), 6), "bytes": r.bytes}
                for r in sorted(self.regions.values(), key=_order)]


class _WallTiming:
    def __init__(self):
        self.start = time.perf_counter()

    def stop(self, region: _Region) -> None:
        region.seconds += time.perf_counter() - self.start


class _CudaTiming:
    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def stop(self, region: _Region) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        region.events.append((self.start, end))


def _profile_args(annotations) -> dict | None:
    for kind, args in annotations:
        if kind == "profile" and args:
            spec = {"name": str(_unquote(args[0]))}
            for arg in args[1:]:
                key, _, value = arg.partition("=")
                if key.strip() in ("memory", "cuda_events", "nvtx"):
                    spec[key.strip()] = _unquote(value.strip())
            return spec
    return None


def _order(region: _Region) -> tuple:
    return (region.phase != "forward", -1 if region.layer is None else region.layer,
            region.name)
