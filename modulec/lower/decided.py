"""The planner's keep / recompute / swap decisions, placed into the hierarchical Schedule IR.

The planner decides per storage of the flattened step (modulec.plan.timeline), one block
instance at a time; the schedule holds one op list per function however often it runs.
The bridge is the *instance index*: instance i of function F is the i-th time F runs in
the forward, in execution order, and instance i of F's backward differentiates it (an
80-layer stack: instances 0..79 of the block and of everything it calls). An op this
module inserts is anchored before or after a node of the function it runs in, runs only
for the instances listed in `instances` (inclusive [first, last] ranges; absent: all),
and names the storage it acts on by its owner function, value id and `instance`, the
owner's instance relative to the running one (0: the same instance; -1: the previous
repetition; 21 from the entry, which runs once: block 21). Grouping per (anchor, what)
keeps the schedule O(functions), not O(layers), while decisions differ per layer.

Recompute: each replay unit of modulec.plan.replay becomes a `recompute` op (the forward
node it re-runs, phase `recompute`, stream 0) before the backward node the planner places
it at, in forward order. Swap: after the storage's last forward use, `record_event
ready:F/v` on stream 0, `wait_event` of it and `swap_out` on stream 1; at the point of the
backward the planner issues its prefetch, `swap_in` and `record_event prefetched:F/v` on
stream 1; before its first backward use (an op, or a replay reading it), `wait_event
prefetched:F/v` on stream 0. Events are keyed at run time by (name, owner instance).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from modulec.ir.graph import COMPUTE_STREAM as COMPUTE, COPY_STREAM as COPY
from modulec.plan.memory import SAVED
from modulec.plan.recompute import KEEP, RECOMPUTE, SWAP
from modulec.plan.replay import APPLY, FULL, region_of, unit_reads, unit_seconds, unit_writes

BEFORE, AFTER = "before", "after"
HOST = "host_activations"


@dataclass
class Decided:
    """Everything the schedule needs from one set of planner decisions."""
    step: object                                  # modulec.plan.timeline.Step
    outcome: object                               # modulec.plan.simulate.Outcome
    kinds: dict                                   # storage key -> keep | recompute | swap
    index: dict = field(default_factory=dict)     # forward instance path -> instance index
    counts: dict = field(default_factory=dict)    # function -> instances (backward too)
    begins: list = field(default_factory=list)    # op index -> its slot's start time (s)
    nodes: dict = field(default_factory=dict)     # (function, node id) -> an op index
    replay_reads: dict = field(default_factory=dict)  # storage -> first replay placement


def decide(problem, recompute: set, swap: set, outcome) -> Decided:
    """The final decision per saved storage, as `modulec plan` reports it: an implicit
    checkpoint is kept, a swap the simulation dropped is kept."""
    step = problem.step
    kinds = {}
    for key in step.saved():
        if key in outcome.replays.checkpoints:
            kinds[key] = KEEP
        elif key in recompute:
            kinds[key] = RECOMPUTE
        elif key in swap and key in outcome.swap_times:
            kinds[key] = SWAP
        else:
            kinds[key] = KEEP
    index, counts = instance_indices(problem.graph, step)
    nodes = {}
    for op in step.ops:
        nodes.setdefault((op.function, op.node.id), op.index)
    return Decided(step, outcome, kinds, index, counts,
                   _begins(step, outcome, problem.device), nodes,
                   _replay_reads(step, outcome))


def instance_indices(graph, step) -> tuple[dict, dict]:
    """Instance index of every forward instance path, and instances per function (a
    backward function has its forward function's)."""
    index, counts = {}, {}
    for path, name in step.instances.items():
        index[path] = counts.get(name, 0)
        counts[name] = index[path] + 1
    for function in graph.functions:
        if function.gradient_of:
            counts[function.name] = counts.get(function.gradient_of, 0)
    return index, counts


# ====================================================================== inserted ops
class _Groups:
    """Inserted op templates by (anchor, sort key, template) -> running instances."""

    def __init__(self, decided: Decided):
        self.decided = decided
        self.found: dict = {}

    def add(self, op_index: int, where: str, order: tuple, template: tuple, owner: int):
        op = self.decided.step.ops[op_index]
        running = self.decided.index.get(op.path, 0)
        template = template + (owner - running,)
        anchor = (op.function, op.node.id, where)
        self.found.setdefault((anchor, order, template), set()).add(running)

    def by_anchor(self) -> dict:
        placed: dict = {}
        for (anchor, order, template), running in sorted(self.found.items(), key=_sort_key):
            placed.setdefault(anchor, []).append((template, sorted(running)))
        return placed


def _sort_key(item) -> tuple:
    (anchor, order, template), running = item
    return (anchor, order, repr(template), min(running))


def inserted_ops(decided: Decided, placements: dict, host_offsets: dict) -> dict:
    """(function, node id, before | after) -> the op dicts inserted there, in order."""
    groups = _Groups(decided)
    _recompute_groups(decided, groups)
    _swap_groups(decided, groups)
    ops: dict = {}
    for anchor, entries in groups.by_anchor().items():
        total = decided.counts.get(anchor[0], 1)
        for template, running in entries:
            ops.setdefault(anchor, []).extend(
                _expand(template, _ranges(running, total), placements, host_offsets,
                        decided, anchor))
    return ops


def _ranges(running: list[int], total: int) -> list | None:
    """Inclusive [first, last] runs of sorted instance indices; None when all run."""
    if running == list(range(total)):
        return None
    runs: list = []
    for x in running:
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return runs


def _region_offsets(step) -> dict:
    """Forward op index -> its position inside its region (the same in every block)."""
    first: dict = {}
    for op in step.ops[:step.forward_ops]:
        first.setdefault(region_of(op), op.index)
    return {op.index: op.index - first[region_of(op)] for op in step.ops[:step.forward_ops]}


def _recompute_groups(decided: Decided, groups: _Groups) -> None:
    step = decided.step
    offsets = _region_offsets(step)
    for unit, placed in decided.outcome.replays.placement.items():
        replayed = step.ops[unit[0]]
        owner = decided.index.get(replayed.path, 0)
        template = ("recompute", replayed.function, replayed.node.id, unit[1])
        groups.add(placed, BEFORE, (2, offsets[unit[0]]), template, owner)


def _swap_groups(decided: Decided, groups: _Groups) -> None:
    step = decided.step
    for key, kind in decided.kinds.items():
        if kind != SWAP:
            continue
        storage = step.storages[key]
        owner = decided.index.get(key[0], 0)
        what = (storage.function, key[1])
        groups.add(storage.last_read_forward, AFTER, (0,), ("swap_out",) + what, owner)
        first = first_backward_use(decided, key)
        issue = _prefetch_at(decided, key, first)
        groups.add(issue, BEFORE, (0,), ("swap_in",) + what, owner)
        groups.add(first, BEFORE, (1,), ("wait_in",) + what, owner)


def first_backward_use(decided: Decided, key) -> int:
    """The first backward op that reads `key`, or before which a replay reading it runs."""
    first = decided.step.storages[key].reads_backward[0]
    return min(first, decided.replay_reads.get(key, first))


def _replay_reads(step, outcome) -> dict:
    """Storage -> the earliest backward op before which a replay reading it runs."""
    found: dict = {}
    for unit, placed in outcome.replays.placement.items():
        for key in unit_reads(step, unit):
            found[key] = min(found.get(key, placed), placed)
    return found


def _prefetch_at(decided: Decided, key, first: int) -> int:
    """The backward op before which the prefetch is issued: the first whose start (its
    replays' start, when it has some) is at or after the planner's issue time."""
    issue = decided.outcome.swap_times[key][1]
    found = bisect_left(decided.begins, issue - 1e-12, decided.step.forward_ops, first)
    return min(found, first)


def _begins(step, outcome, device) -> list:
    """When each op's slot starts: the op's start less the replays placed before it."""
    before: dict = {}
    for unit, placed in outcome.replays.placement.items():
        before[placed] = before.get(placed, 0.0) + unit_seconds(step, unit, device)
    return [outcome.start[i] - before.get(i, 0.0) for i in range(len(step.ops))]


# ====================================================================== op dicts
def _expand(template: tuple, running, placements, host_offsets, decided, anchor) -> list[dict]:
    kind, delta = template[0], template[-1]
    phase = "backward" if decided.step.ops[decided.nodes[anchor[:2]]].backward else "forward"
    where = {"instance": delta} | ({"instances": running} if running is not None else {})
    if kind == "recompute":
        return [_recompute_op(template, where, placements, decided)]
    function, value = template[1], template[2]
    ref = {"function": function, "value": value}
    event = f"{function}/{value}"
    if kind == "swap_out":
        return [_sync("record_event", f"ready:{event}", COMPUTE, phase, ref, where),
                _sync("wait_event", f"ready:{event}", COPY, phase, ref, where),
                _copy("swap_out", phase, ref, where, placements, host_offsets)]
    if kind == "swap_in":
        return [_copy("swap_in", phase, ref, where, placements, host_offsets),
                _sync("record_event", f"prefetched:{event}", COPY, phase, ref, where)]
    return [_sync("wait_event", f"prefetched:{event}", COMPUTE, phase, ref, where)]


def _recompute_op(template, where, placements, decided) -> dict:
    from modulec.lower.schedule import kernel_of

    _, function, node_id, how, _ = template
    index = decided.nodes[(function, node_id)]
    node = decided.step.ops[index].node
    placed = placements.get(function, {})
    outputs = node.outputs if how == FULL else \
        tuple(key[1] for key in unit_writes(decided.step, (index, APPLY)))
    # only saved slots: a replayed transient value's forward bytes belong to the backward
    # by then, so it has no planned place (runtimes use scratch space; decisions.md)
    buffers = [[v, placed[v].region, placed[v].offset, placed[v].size_bytes]
               for v in outputs if v in placed and placed[v].region == SAVED]
    op = {"kind": "recompute", "node": node_id, "function": function,
          "kernel": kernel_of(node), "replay": "apply_saved" if how == APPLY else "op",
          "repeat": 1, "phase": "recompute", "stream": COMPUTE} | where
    return op | ({"buffers": buffers} if buffers else {})


def _sync(kind: str, event: str, stream: int, phase: str, ref: dict, where: dict) -> dict:
    return {"kind": kind, "kernel": kind, "event": event, "repeat": 1, "phase": phase,
            "stream": stream} | ref | where


def _copy(kind: str, phase: str, ref: dict, where: dict, placements, host_offsets) -> dict:
    placed = placements.get(ref["function"], {}).get(ref["value"])
    host = host_offsets.get((ref["function"], ref["value"]))
    buffers = []
    if placed is not None:
        device = [ref["value"], placed.region, placed.offset, placed.size_bytes]
        copy = [ref["value"], HOST, host, placed.size_bytes] if host is not None else None
        buffers = [device, copy] if kind == "swap_out" else [copy, device]
        buffers = [b for b in buffers if b is not None]
    op = {"kind": kind, "kernel": kind, "repeat": 1, "phase": phase, "stream": COPY} | ref \
        | where
    return op | ({"buffers": buffers} if buffers else {})
