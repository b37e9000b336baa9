"""The memory planner's input: ops in schedule order and the buffers they read and write.

This is the whole contract with the schedule: whoever lowers a Schedule IR to memory
planning produces a sequence of `Op` (schedule order, strictly increasing `index`) and a
sequence of `Buffer`. Nothing here knows about graphs, dtypes or shapes.

Lifetimes (`first_use`/`last_use`, computed by `lifetimes.py`, inclusive op indices):
- a buffer lives from the op that produces it (lists it in `outputs`) to the last op that
  reads it (lists it in `inputs`); a buffer nobody produces is a step input and lives from
  the first op; a buffer nobody reads dies where it is produced;
- `pinned_lifetime=(start, end)` fixes the span of a buffer that lives across the step
  (weights, gradients, optimizer state); computed uses widen it, never shrink it;
- a view or split (`alias_of`) owns no storage: it lives at `offset_in_source` inside its
  source, and its uses extend the source's lifetime. Its storage's region is the
  source's, whatever its own `region` says.

Read-modify-write of a buffer (accumulating into a gradient) is an input: the op reads it.
Sharing comes from buffers (`alias_of`) and from `Op.kind == "elementwise"` with
`inplace_ok`; kind "view" only documents the op (its outputs say what they alias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal

BufferId = Hashable
OpKind = Literal["elementwise", "view", "other"]
OP_KINDS = ("elementwise", "view", "other")

WEIGHTS = "weights"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
SAVED = "saved_activations"
TRANSIENT = "transient_activations"
WORKSPACE = "workspace"
REGIONS = (WEIGHTS, GRADIENTS, OPTIMIZER_STATE, SAVED, TRANSIENT, WORKSPACE)
DEFAULT_ALIGNMENT = 256


class PlanError(ValueError):
    """Invalid planner input, or a plan that breaks an invariant (overlap, misalignment)."""


@dataclass(frozen=True)
class Op:
    index: int                      # position in the schedule (strictly increasing)
    name: str
    inputs: tuple[BufferId, ...]
    outputs: tuple[BufferId, ...]
    kind: OpKind = "other"
    inplace_ok: bool = False        # may write an output into a dying input's storage


@dataclass(frozen=True)
class Buffer:
    id: BufferId
    size_bytes: int
    region: str = TRANSIENT
    alignment: int = DEFAULT_ALIGNMENT
    alias_of: BufferId | None = None
    offset_in_source: int = 0
    pinned_lifetime: tuple[int, int] | None = None


def round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def region_order(region: str) -> tuple[int, str]:
    """Canonical regions first in `REGIONS` order, any other region after, by name."""
    return (REGIONS.index(region), "") if region in REGIONS else (len(REGIONS), region)


def validate(ops: list[Op], buffers: list[Buffer]) -> dict[BufferId, Buffer]:
    """The buffers by id; raises PlanError on input the planner cannot make sense of."""
    by_id: dict[BufferId, Buffer] = {}
    for b in buffers:
        _check_buffer(b)
        if b.id in by_id:
            raise PlanError(f"buffer {b.id!r} declared twice")
        by_id[b.id] = b
    for b in buffers:
        if b.alias_of is not None:
            _check_alias(b, by_id)
    _check_ops(ops, by_id)
    return by_id


def _check_buffer(b: Buffer) -> None:
    if b.size_bytes < 0:
        raise PlanError(f"buffer {b.id!r}: negative size {b.size_bytes}")
    if b.alignment <= 0 or b.alignment & (b.alignment - 1):
        raise PlanError(f"buffer {b.id!r}: alignment {b.alignment} is not a power of two")
    if b.pinned_lifetime is not None and b.pinned_lifetime[0] > b.pinned_lifetime[1]:
        raise PlanError(f"buffer {b.id!r}: pinned lifetime {b.pinned_lifetime} ends first")


def _check_alias(b: Buffer, by_id: dict[BufferId, Buffer]) -> None:
    source = by_id.get(b.alias_of)
    if source is None:
        raise PlanError(f"buffer {b.id!r} aliases unknown buffer {b.alias_of!r}")
    if b.offset_in_source < 0 or b.offset_in_source + b.size_bytes > source.size_bytes:
        raise PlanError(
            f"view {b.id!r} [{b.offset_in_source}, {b.offset_in_source + b.size_bytes}) "
            f"lies outside its source {source.id!r} of {source.size_bytes} bytes")
    seen = {b.id}
    while source.alias_of is not None:
        if source.id in seen:
            raise PlanError(f"alias cycle through buffer {source.id!r}")
        seen.add(source.id)
        source = by_id[source.alias_of]


def _check_ops(ops: list[Op], by_id: dict[BufferId, Buffer]) -> None:
    producer: dict[BufferId, int] = {}
    previous = None
    for op in ops:
        if op.kind not in OP_KINDS:
            raise PlanError(f"op {op.name!r}: unknown kind {op.kind!r}")
        if previous is not None and op.index <= previous:
            raise PlanError(f"op {op.name!r}: index {op.index} after {previous} is not increasing")
        previous = op.index
        for bid in (*op.inputs, *op.outputs):
            if bid not in by_id:
                raise PlanError(f"op {op.name!r} (#{op.index}) uses unknown buffer {bid!r}")
        for bid in op.outputs:
            if bid in producer:
                raise PlanError(f"buffer {bid!r} produced twice "
                                f"(ops #{producer[bid]} and #{op.index})")
            producer[bid] = op.index
