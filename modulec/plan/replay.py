"""Replay segments: what the backward re-runs to get back a recomputed activation.

The segment of a recomputed storage is the forward ops between it and the recompute
frontier: walking back through producers, a storage that is available in the backward
(kept, swapped, a step input, or an implicit checkpoint) stops the walk (the frontier);
anything else is replayed too. A segment stays inside its region (one block of a stack,
or one op of the entry): a storage it needs from another region is made an implicit
checkpoint (kept from the forward), which is how "keep only each block's inputs" comes
about. A norm's normalized output is replayed from its saved statistics when they are
available (`fused_residual_rmsnorm_apply_saved` of the recompute design doc): from the
norm's residual output (or input) and rstd, memory-bound, without the norm's inputs.

Segments are merged: an op shared by several recomputed storages is replayed once, at the
earliest placement among them, a placement being the first backward op that reads the
storage (recompute groups of the design doc: a fused op's outputs come back together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.plan.devices import Device
from modulec.plan.timeline import Key, Step

# norm -> (output replayed, outputs or input positions it is replayed from): ("out", i) is
# output i, ("in", i) input i of the op's storage reads
APPLY_SAVED = {
    "fused_residual_rmsnorm": (1, (("out", 0), ("out", 2))),
    "rmsnorm": (0, (("in", 0), ("out", 1))),
    "layernorm": (0, (("in", 0), ("out", 1), ("out", 2))),
}
FULL, APPLY = "op", "apply"
Unit = tuple  # (op index, FULL | APPLY)


@dataclass(frozen=True)
class Closure:
    units: frozenset            # Units replayed
    frontier: frozenset         # available storages it reads
    crossings: frozenset        # storages of other regions it needs: implicit checkpoints


def closure(step: Step, key: Key, available) -> Closure:
    """The replay segment of storage `key`, given `available(key) -> bool`."""
    ops, storages = step.ops, step.storages
    region = region_of(ops[storages[key].producer])
    units, frontier, crossings, seen = set(), set(), set(), set()
    todo = [key]
    while todo:
        wanted = todo.pop()
        if wanted in seen:
            continue
        seen.add(wanted)
        op = ops[storages[wanted].producer]
        deps = apply_deps(step, op.index, wanted)
        if deps and all(available(d) for d in deps):
            units.add((op.index, APPLY))
            frontier.update(deps)
            continue
        units.add((op.index, FULL))
        for read in op.reads:
            source = storages[read]
            if source.producer is None or available(read):
                frontier.add(read)
            elif region_of(ops[source.producer]) != region:
                crossings.add(read)
            else:
                todo.append(read)
    return Closure(frozenset(units), frozenset(frontier), frozenset(crossings))


def apply_deps(step: Step, index: int, wanted: Key) -> tuple:
    """Storages the norm op `index` replays `wanted` from, or () when it cannot."""
    op = step.ops[index]
    rule = APPLY_SAVED.get(op.node.target)
    if rule is None or len(op.writes) <= rule[0] or op.writes[rule[0]] != wanted:
        return ()
    found = []
    for where, position in rule[1]:
        pool = op.writes if where == "out" else op.reads
        if position >= len(pool):
            return ()
        found.append(pool[position])
    return tuple(found)


def unit_reads(step: Step, unit: Unit) -> tuple:
    index, how = unit
    if how == APPLY:
        rule = APPLY_SAVED[step.ops[index].node.target]
        return apply_deps(step, index, step.ops[index].writes[rule[0]])
    return step.ops[index].reads


def unit_writes(step: Step, unit: Unit) -> tuple:
    index, how = unit
    op = step.ops[index]
    return (op.writes[APPLY_SAVED[op.node.target][0]],) if how == APPLY else op.writes


def unit_seconds(step: Step, unit: Unit, device: Device) -> float:
    index, how = unit
    if how == FULL:
        return step.ops[index].seconds
    moved = sum(step.storages[k].bytes for k in unit_reads(step, unit) + unit_writes(step, unit))
    return moved / device.bytes_per_s


def regions_last_first(step: Step) -> list[tuple]:
    """Regions, the one whose last forward op runs latest first: a segment only needs
    storages of regions that ran before its own, so those are settled after it."""
    last: dict[tuple, int] = {}
    for op in step.ops[:step.forward_ops]:
        last[region_of(op)] = op.index
    return sorted(last, key=lambda r: -last[r])


def region_of(op) -> tuple:
    """A block of a stack (first path step), or, for the entry's own ops, the op."""
    return op.path[:1] if op.path else ("entry", op.index)


def storage_region(step: Step, key: Key) -> tuple:
    return region_of(step.ops[step.storages[key].producer])


@dataclass
class Replays:
    """All segments of one set of decisions."""
    closures: dict = field(default_factory=dict)      # replayed storage -> Closure
    checkpoints: set = field(default_factory=set)     # implicit checkpoints (+ forced)
    placement: dict = field(default_factory=dict)     # Unit -> backward op it runs before

    def replayed(self) -> list[Key]:
        return list(self.closures)


def plan_replays(step: Step, recompute: set, candidates: set, forced: set) -> Replays:
    """Segments of the storages in `recompute`, region by region (latest first), adding
    the storages they need from earlier regions to the implicit checkpoints."""
    result = Replays(checkpoints=set(forced))
    by_region: dict[tuple, list] = {}
    for key in step.saved():
        if key in recompute:
            by_region.setdefault(storage_region(step, key), []).append(key)

    def available(key):
        return key in result.checkpoints or (key in candidates and key not in recompute)

    for region in regions_last_first(step):
        for key in by_region.get(region, ()):
            if key in result.checkpoints:
                continue
            found = closure(step, key, available)
            result.closures[key] = found
            result.checkpoints |= found.crossings
    _place(step, result)
    return result


def _place(step: Step, replays: Replays) -> None:
    for key, found in replays.closures.items():
        first = step.storages[key].reads_backward[0]
        for unit in sorted(found.units):
            if unit not in replays.placement or first < replays.placement[unit]:
                replays.placement[unit] = first
    for unit in [u for u in replays.placement if u[1] == APPLY]:
        full = (unit[0], FULL)
        if full in replays.placement:
            replays.placement[full] = min(replays.placement[full], replays.placement.pop(unit))
