"""Memory-aware topological ordering: the planner notes' "v2", lazy re-score.

Kahn's algorithm with a max-heap of ready ops. An op's priority is its net effect on live
bytes, plus a nudge toward in-place chains:

    score = freed_bytes - output_alloc_bytes + inplace_bonus

- freed_bytes: the storage roots (alias-resolved, each counted once even when read twice)
  that this op reads last, i.e. whose only remaining reader it is;
- output_alloc_bytes: its outputs that own storage (views allocate nothing);
- inplace_bonus: output_size / 8 for an output whose only reader is an elementwise
  `inplace_ok` op with an output of the same size, which may then reuse it in place.

Staleness. Scores only grow as readers run (a root's remaining readers drop to one), so
a heap entry can only under-estimate. The notes' lazy re-score alone (recompute on pop,
push back when changed) cannot repair that: an under-estimated entry below the top is
never popped, and one at the top is the maximum anyway, so pushing it back returns it at
once. So when a root's remaining readers drop to one, its last reader, if ready, gets a
fresh entry pushed (the notes' v3 refcount event; counting distinct reader ops, not edges,
avoids v3's multi-edge gap). The lazy check on pop stays: it drops entries superseded by a
fresher one. Ties go to the op earlier in the given order: deterministic and, among
equals, stable.

Dependencies: an op follows the producers of its inputs; `after` adds edges (op position
-> positions it must follow) for effects the data does not show, such as accumulating into
a gradient before the optimizer reads it (`pinned_edges` derives those conservatively).
Greedy ordering is a heuristic (optimal ordering is NP-hard), and "allocate the fewest
bytes first" is myopic: on a training step it hoists every layer's backward recomputation
(small allocations, nothing freed yet) into the forward. `defer_allocations` ranks all
net allocations alike, so they keep the given order while freeing ops still jump ahead;
`improve_order` keeps whichever of given / v2 / deferred has the lowest peak.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

from modulec.plan.memory.lifetimes import alias_root, storage
from modulec.plan.memory.model import Buffer, BufferId, Op, PlanError, validate
from modulec.plan.memory.offsets import lower_bound

Edges = Mapping[int, Iterable[int]]


def memory_aware_order(ops: Sequence[Op], buffers: Sequence[Buffer],
                       after: Edges | None = None, *, defer_allocations: bool = False) -> list[int]:
    """Positions of `ops` in a topological order that keeps peak live bytes low.

    `defer_allocations`: ops whose net effect is an allocation (score <= 0) all rank
    alike, so they run in the given order, while ops that free bytes still jump ahead."""
    ops, buffers = list(ops), list(buffers)
    by_id = validate(ops, buffers)
    preds = _predecessors(ops, after or {})
    succs: list[list[int]] = [[] for _ in ops]
    for i, ps in enumerate(preds):
        for p in sorted(ps):
            succs[p].append(i)
    scorer = _Scorer(ops, by_id, defer_allocations)
    waiting = [len(ps) for ps in preds]
    heap = [(-scorer.score(i), i) for i in range(len(ops)) if not waiting[i]]
    heapq.heapify(heap)
    order: list[int] = []
    done = [False] * len(ops)
    while heap:
        neg, i = heapq.heappop(heap)
        if done[i]:
            continue                                   # an entry superseded by a fresher one
        fresh = scorer.score(i)
        if fresh != -neg:
            heapq.heappush(heap, (-fresh, i))
            continue
        order.append(i)
        done[i] = True
        for j in scorer.ran(i):                        # now the last reader of something
            if not waiting[j] and not done[j]:
                heapq.heappush(heap, (-scorer.score(j), j))
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(heap, (-scorer.score(s), s))
    if len(order) != len(ops):
        stuck = sorted(set(range(len(ops))) - set(order))[:5]
        raise PlanError(f"dependency cycle among ops {[ops[i].name for i in stuck]}")
    return order


def _predecessors(ops: list[Op], after: Edges) -> list[set[int]]:
    producer = {bid: i for i, op in enumerate(ops) for bid in op.outputs}
    preds = []
    for i, op in enumerate(ops):
        ps = {producer[b] for b in op.inputs if b in producer} | set(after.get(i, ()))
        ps.discard(i)
        bad = [p for p in ps if not 0 <= p < len(ops)]
        if bad:
            raise PlanError(f"op {op.name!r}: dependency on unknown op position {bad[0]}")
        preds.append(ps)
    return preds


class _Scorer:
    def __init__(self, ops: list[Op], by_id: dict[BufferId, Buffer], defer: bool):
        self.defer = defer
        self.sizes = {bid: b.size_bytes for bid, b in by_id.items()}
        position = {bid: k for k, bid in enumerate(by_id)}
        root = {bid: alias_root(bid, by_id)[0] for bid in by_id}
        self.reads = [sorted({root[b] for b in op.inputs if by_id[root[b]].pinned_lifetime is None},
                             key=position.__getitem__) for op in ops]
        self.readers: dict[BufferId, list[int]] = {}
        for i, roots in enumerate(self.reads):
            for r in roots:
                self.readers.setdefault(r, []).append(i)
        self.remaining = {r: len(readers) for r, readers in self.readers.items()}
        self.ran_ops: set[int] = set()
        readers: dict[BufferId, list[Op]] = {}
        for op in ops:
            for b in dict.fromkeys(op.inputs):
                readers.setdefault(b, []).append(op)
        self.static = [_static(op, readers, by_id) for op in ops]

    def score(self, i: int) -> int:
        freed = sum(self.sizes[r] for r in self.reads[i] if self.remaining[r] == 1)
        score = freed + self.static[i]
        return max(score, 0) if self.defer else score

    def ran(self, i: int) -> list[int]:
        """Records op i as run; returns the ops that became the last reader of a root."""
        self.ran_ops.add(i)
        rose = []
        for r in self.reads[i]:
            self.remaining[r] -= 1
            if self.remaining[r] == 1:
                rose += [j for j in self.readers[r] if j not in self.ran_ops]
        return rose


def _static(op: Op, readers: dict[BufferId, list[Op]], by_id) -> int:
    """-output_alloc_bytes + inplace_bonus: the part of the score that never changes."""
    total = 0
    for bid in op.outputs:
        b = by_id[bid]
        if b.alias_of is not None or b.pinned_lifetime is not None:
            continue
        total -= b.size_bytes
        only = readers.get(bid, [])
        if len(only) == 1 and _inplace_sink(only[0], b, by_id):
            total += b.size_bytes // 8
    return total


def _inplace_sink(reader: Op, b: Buffer, by_id) -> bool:
    return reader.kind == "elementwise" and reader.inplace_ok and any(
        by_id[o].size_bytes == b.size_bytes and by_id[o].region == b.region
        for o in reader.outputs)


def pinned_edges(ops: Sequence[Op], buffers: Sequence[Buffer]) -> dict[int, set[int]]:
    """Keep the given relative order of ops that touch the same pinned buffer (a gradient
    accumulated then read by the optimizer): each such op follows the previous one."""
    pinned = {b.id for b in buffers if b.pinned_lifetime is not None}
    last: dict[BufferId, int] = {}
    edges: dict[int, set[int]] = {}
    for i, op in enumerate(ops):
        for bid in (*op.inputs, *op.outputs):
            if bid in pinned:
                if bid in last and last[bid] != i:
                    edges.setdefault(i, set()).add(last[bid])
                last[bid] = i
    return edges


def reorder(ops: Sequence[Op], order: Sequence[int]) -> list[Op]:
    """The ops in `order` (positions), renumbered with the same set of indices."""
    indices = sorted(op.index for op in ops)
    if sorted(order) != list(range(len(ops))):
        raise PlanError("order is not a permutation of the ops")
    return [replace(ops[p], index=t) for p, t in zip(order, indices)]


def peak_live_bytes(ops: Sequence[Op], buffers: Sequence[Buffer]) -> int:
    """Largest live bytes at one op, all regions together, after alias/in-place sharing."""
    return lower_bound(storage(list(ops), list(buffers)).blocks)


def improve_order(ops: Sequence[Op], buffers: Sequence[Buffer],
                  after: Edges | None = None) -> list[Op]:
    """The lowest-peak of: the given order, v2's, v2's with `defer_allocations` (ties: in
    that order, so the given ops come back unchanged unless an order is strictly better)."""
    ops, buffers = list(ops), list(buffers)
    best, best_peak = ops, peak_live_bytes(ops, buffers)
    for defer in (False, True):
        candidate = reorder(ops, memory_aware_order(ops, buffers, after, defer_allocations=defer))
        peak = peak_live_bytes(candidate, buffers)
        if peak < best_peak:
            best, best_peak = candidate, peak
    return best
