"""The runtime side of a node's annotations: `@hook` points, `@probe` captures (spec §7.3.3),
`@assert` checks (§7.7.1) and `@trace` lines (§7.7.3), read from the Graph IR.

The recorder puts an annotation written after a flow's destination on the node producing
that value and, except for `@hook`, adds `on=<name>` and `value=<id>` (which output it
concerns: a node may have several). An annotation written on the op itself, or a `@hook`,
concerns every output of the node.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

KEYWORD = re.compile(r"^([A-Za-z_]\w*)\s*=(?!=)\s*(.*)$", re.S)
HISTOGRAM_BINS = 32
SAMPLE_SIZE = 64
GRAD_CAPTURES = ("grad_stats", "grad_full")


@dataclass(frozen=True)
class Note:
    """One annotation of a node: its positional and keyword arguments."""

    kind: str  # hook | probe | assert | trace
    positional: tuple[str, ...]
    keywords: dict = field(hash=False, compare=False)

    @property
    def value(self) -> str | None:
        return self.keywords.get("value")

    def text(self, name: str, default=None):
        raw = self.keywords.get(name)
        return default if raw is None else _unquote(raw)


def parse_notes(annotations) -> tuple[Note, ...]:
    notes = []
    for kind, args in annotations:
        if kind not in ("hook", "probe", "assert", "trace"):
            continue
        positional, keywords = [], {}
        for arg in args:
            match = KEYWORD.match(arg)
            if match:
                keywords[match.group(1)] = match.group(2).strip()
            else:
                positional.append(arg)
        notes.append(Note(kind, tuple(positional), keywords))
    return tuple(notes)


def _unquote(text: str):
    if text[:1] in "\"'":
        return ast.literal_eval(text)
    return {"true": True, "false": False}.get(text, text)


def describe(annotations) -> str:
    """`@hook(AfterX), @probe("p")`: what a non-finite message names, or ""."""
    parts = []
    for note in parse_notes(annotations):
        if note.kind in ("hook", "probe") and note.positional:
            parts.append(f"@{note.kind}({note.positional[0]})")
    return ", ".join(parts)


# ====================================================================== probes
@dataclass
class ProbeRecord:
    """What one probe captured at one layer (the latest capture wins)."""

    name: str
    layer: int | None
    capture: str
    scope: str
    value: str  # the probed value's source name
    phase: str  # "forward", or "backward" for grad_stats / grad_full
    step: int  # the forward run it was captured in (0, 1, ...)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0
    absmax: float = 0.0
    norm: float = 0.0
    nan: int = 0
    inf: int = 0
    histogram: tuple[Tensor, Tensor] | None = None  # (counts, bin edges)
    sample: Tensor | None = None
    tensor: Tensor | None = None  # capture=full / grad_full


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    capture: str
    condition: str | None
    frequency: int

    @classmethod
    def from_note(cls, note: Note) -> "ProbeSpec":
        name = _unquote(note.positional[0]) if note.positional else note.text("name", "")
        return cls(str(name), str(note.text("capture", "stats")), note.text("condition"),
                   int(note.text("frequency", 1)))

    @property
    def on_gradient(self) -> bool:
        return self.capture in GRAD_CAPTURES


def capture(spec: ProbeSpec, record: ProbeRecord, tensor: Tensor) -> ProbeRecord:
    record.shape, record.dtype = tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")
    data = tensor.detach()
    data = data if data.is_floating_point() else data.double()
    _stats(record, data)
    if spec.capture == "histogram":
        record.histogram = _histogram(data)
    elif spec.capture == "sample":
        generator = torch.Generator().manual_seed(record.step)
        flat = data.reshape(-1).cpu()
        pick = torch.randperm(flat.numel(), generator=generator)[:SAMPLE_SIZE]
        record.sample = flat[pick].clone()
    elif spec.capture in ("full", "grad_full"):
        record.tensor = tensor.detach().clone()
    return record


def _stats(record: ProbeRecord, data: Tensor) -> None:
    if data.numel() == 0:
        return
    finite = torch.isfinite(data)
    record.nan = int(torch.isnan(data).sum())
    record.inf = int(torch.isinf(data).sum())
    record.mean = float(data.mean())
    record.std = float(data.std()) if data.numel() > 1 else 0.0
    record.min, record.max = float(data.min()), float(data.max())
    record.absmax = float(data.abs().max())
    record.norm = float(data.norm())
    if not bool(finite.all()):  # NaN poisons min/max: report the finite range
        kept = data[finite]
        record.min = float(kept.min()) if kept.numel() else float("nan")
        record.max = float(kept.max()) if kept.numel() else float("nan")


def _histogram(data: Tensor) -> tuple[Tensor, Tensor]:
    kept = data[torch.isfinite(data)].double().cpu()
    low, high = (float(kept.min()), float(kept.max())) if kept.numel() else (0.0, 1.0)
    high = high if high > low else low + 1.0
    counts = torch.histc(kept, bins=HISTOGRAM_BINS, min=low, max=high)
    return counts, torch.linspace(low, high, HISTOGRAM_BINS + 1, dtype=torch.float64)


# ====================================================================== trace lines
def trace_line(level: str, op: str, scope: str, inputs: list, outputs: list,
               place: str) -> str:
    """`[TRACE] blocks[1].mlp swiglu: gate=[2, 6, 48], up=[2, 6, 48] -> hidden=[2, 6, 48]`;
    `inputs`/`outputs` are (name, tensor or None); level ops gives names only, values
    adds each output's dtype and stats."""
    where = f"{scope} " if scope else ""
    ins = ", ".join(_shown(n, t, level) for n, t in inputs)
    outs = ", ".join(_shown(n, t, level) for n, t in outputs)
    line = f"[TRACE] {where}{op}: {ins} -> {outs}"
    if level == "values":
        line += "".join(f"  {n}: {_values(t)}" for n, t in outputs if isinstance(t, Tensor))
    return f"{line}  ({place})"


def _shown(name: str, tensor, level: str) -> str:
    if level == "ops" or not isinstance(tensor, Tensor):
        return name
    return f"{name}={list(tensor.shape)}"


def _values(tensor: Tensor) -> str:
    data = tensor.detach()
    data = data if data.is_floating_point() else data.double()
    dtype = str(tensor.dtype).replace("torch.", "")
    if data.numel() == 0:
        return dtype
    std = float(data.std()) if data.numel() > 1 else 0.0
    return (f"{dtype} mean={float(data.mean()):.4g} std={std:.4g} "
            f"min={float(data.min()):.4g} max={float(data.max()):.4g}")
