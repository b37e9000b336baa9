"""Offset assignment inside one region's arena, and the numbers to judge it by.

Every strategy places blocks one at a time, in its own order, at a gap among the blocks
already placed that are live at the same time (first fit: the lowest gap that fits; best
fit: the smallest, then the lowest), or on top of them. Any such placement is valid:
blocks live at the same time never overlap, and every offset is a multiple of the block's
alignment. The strategies differ only in the order (planner notes; Pisarchyk & Lee 2020,
"Efficient Memory Management for Deep Neural Net Inference"):

- greedy_by_size: largest first, best fit (TFLite's ArenaPlanner: its baseline too);
- greedy_by_size_first_fit: largest first, first fit;
- greedy_by_breadth: ops by live bytes, largest first; each op's blocks largest first;
- greedy_by_lifetime: longest-lived first, best fit (pinned and saved blocks settle at
  the bottom, short transients fill the holes above);
- greedy_by_area: size x lifetime, largest first, best fit;
- first_fit_schedule / best_fit_schedule: in order of allocation, as a runtime would.

`exact_size_reuse` is ONNX Runtime's baseline: in schedule order, a new block takes a
freed block of exactly its size, or grows the arena.

The lower bound is the largest sum of (aligned) block sizes live at one op: no placement
can do better, and on interval lifetimes heuristics usually come within a few percent.
"""

from __future__ import annotations

import bisect
import heapq

from typing import Callable, Sequence

import numpy as np

from modulec.plan.memory.lifetimes import Block
from modulec.plan.memory.model import BufferId, PlanError, round_up

Offsets = dict[BufferId, int]


def lower_bound(blocks: Sequence[Block]) -> int:
    delta: dict[int, int] = {}
    for b in blocks:
        delta[b.start] = delta.get(b.start, 0) + b.size
        delta[b.end + 1] = delta.get(b.end + 1, 0) - b.size
    live = peak = 0
    for t in sorted(delta):
        live += delta[t]
        peak = max(peak, live)
    return peak


def arena_bytes(blocks: Sequence[Block], offsets: Offsets) -> int:
    return max((offsets[b.id] + b.size for b in blocks), default=0)


class _Placer:
    """The blocks placed so far, as arrays, to find the ones live together with a new one.

    A block spanning at most LONG buckets of WIDTH ops is filed under each bucket it
    spans; a query reads the buckets of the new block's lifetime (and the long blocks)
    instead of every placed block, so a long graph of short-lived values places in
    linear time. The blocks found are the same, in the same order, as a scan of all."""

    WIDTH, LONG = 32, 8

    def __init__(self, n: int):
        self.arrays = np.zeros((4, max(n, 1)), dtype=np.int64)   # start, end, offset, top
        self.count = 0
        self.buckets: dict[int, list[int]] = {}
        self.long: list[int] = []

    def place(self, block: Block, fit: str) -> int:
        found = self._candidates(block)
        start, end, offset, top = self.arrays[:, found]
        live = found[(start <= block.end) & (end >= block.start) & (top > offset)]
        order = live[np.argsort(self.arrays[2, live], kind="stable")]
        chosen = _choose_gap(self.arrays[2, order], self.arrays[3, order], block, fit)
        self.arrays[:, self.count] = (block.start, block.end, chosen, chosen + block.size)
        self._file(block, self.count)
        self.count += 1
        return chosen

    def _span(self, block: Block) -> range:
        return range(block.start // self.WIDTH, block.end // self.WIDTH + 1)

    def _candidates(self, block: Block) -> np.ndarray:
        span = self._span(block)
        if len(span) > self.LONG or len(self.long) * 2 > self.count:
            return np.arange(self.count)
        parts = [self.buckets[b] for b in span if b in self.buckets] + \
            ([self.long] if self.long else [])
        if len(parts) == 1:  # each list holds indices in the order placed: ascending
            return np.array(parts[0], dtype=np.int64)
        return np.unique(np.concatenate([np.array(p, dtype=np.int64) for p in parts])) \
            if parts else np.zeros(0, dtype=np.int64)

    def _file(self, block: Block, index: int) -> None:
        span = self._span(block)
        if len(span) > self.LONG:
            self.long.append(index)
            return
        for bucket in span:
            self.buckets.setdefault(bucket, []).append(index)


def _choose_gap(offsets: np.ndarray, tops: np.ndarray, block: Block, fit: str) -> int:
    """The gap below each live block (from the highest top under it, aligned up), by
    `fit`; on top of everything when none is large enough."""
    if not len(offsets):
        return 0
    reached = np.maximum.accumulate(tops)
    below = np.concatenate(([0], reached[:-1]))
    candidates = -(-below // block.alignment) * block.alignment
    gaps = offsets - candidates
    fits = np.nonzero(gaps >= block.size)[0]
    if len(fits):
        pick = fits[0] if fit == "first" else fits[np.argmin(gaps[fits])]
        return int(candidates[pick])
    return round_up(int(reached[-1]), block.alignment)


PLAIN = 64  # at most this many blocks: placed by plain Python, not numpy arrays


def place_in_order(blocks: Sequence[Block], order: Sequence[Block], fit: str) -> Offsets:
    if _stacked(blocks):
        return _stack(order)
    if len(blocks) <= PLAIN:
        return _place_plainly(order, fit)
    placer = _Placer(len(blocks))
    return {b.id: placer.place(b, fit) for b in order}


def _place_plainly(order: Sequence[Block], fit: str) -> Offsets:
    """`_Placer` and `_choose_gap` for a few blocks (most functions' regions), in plain
    Python: each block against every one placed before it, the live ones by offset
    (a stable sort, as the arrays' argsort), the gap below each from the highest top under
    it. The same offsets; numpy's cost per call outweighs a short scan."""
    offsets: Offsets = {}
    placed: list[tuple[int, int, int, int]] = []  # (offset, top, start, end), in order placed
    first = fit == "first"
    for b in order:
        start, end, size, alignment = b.start, b.end, b.size, b.alignment
        live = sorted([(o, t) for o, t, s, e in placed if s <= end and e >= start and t > o],
                      key=_offset)
        reached, chosen, best = 0, -1, 0
        for o, t in live:
            candidate = -(-reached // alignment) * alignment
            gap = o - candidate
            if gap >= size and (chosen < 0 or gap < best):
                chosen, best = candidate, gap
                if first:
                    break
            if t > reached:
                reached = t
        if chosen < 0:
            chosen = round_up(reached, alignment)
        placed.append((chosen, chosen + size, start, end))
        offsets[b.id] = chosen
    return offsets


def _offset(entry: tuple[int, int]) -> int:
    return entry[0]


def _stacked(blocks: Sequence[Block]) -> bool:
    """All blocks live at one op (saved activations, read in the backward in reverse),
    of one alignment and non-zero sizes (multiples of it): every placement puts each block
    on top of those before it, and there is no gap for first or best fit to find."""
    return bool(blocks) and max(b.start for b in blocks) <= min(b.end for b in blocks) and \
        len({b.alignment for b in blocks}) == 1 and all(b.size > 0 for b in blocks)


def _stack(order: Sequence[Block]) -> Offsets:
    offsets, top = {}, 0
    for b in order:
        offsets[b.id] = top
        top += b.size  # a multiple of the alignment (lifetimes.Block)
    return offsets


def _sorted(blocks: Sequence[Block], key: Callable[[Block], tuple]) -> list[Block]:
    return sorted(blocks, key=lambda b: (*key(b), b.key))


def greedy_by_size(blocks: Sequence[Block]) -> Offsets:
    return place_in_order(blocks, _sorted(blocks, lambda b: (-b.size, b.start)), "best")


def greedy_by_size_first_fit(blocks: Sequence[Block]) -> Offsets:
    return place_in_order(blocks, _sorted(blocks, lambda b: (-b.size, b.start)), "first")


def greedy_by_lifetime(blocks: Sequence[Block]) -> Offsets:
    key = lambda b: (b.start - b.end, -b.size)                            # noqa: E731
    return place_in_order(blocks, _sorted(blocks, key), "best")


def greedy_by_area(blocks: Sequence[Block]) -> Offsets:
    key = lambda b: (-b.size * (b.end - b.start + 1), b.start)            # noqa: E731
    return place_in_order(blocks, _sorted(blocks, key), "best")


def first_fit_schedule(blocks: Sequence[Block]) -> Offsets:
    return place_in_order(blocks, _sorted(blocks, lambda b: (b.start, -b.size)), "first")


def best_fit_schedule(blocks: Sequence[Block]) -> Offsets:
    return place_in_order(blocks, _sorted(blocks, lambda b: (b.start, -b.size)), "best")


def greedy_by_breadth(blocks: Sequence[Block]) -> Offsets:
    """Ops in order of live bytes (largest first); at each, its unplaced blocks by size.

    A block is placed at the first op of that order at which it is live: the op of least
    rank over its lifetime, a range minimum (a sparse table over the ops), so the order
    comes from one sort rather than a scan of every block at every op."""
    if not blocks:
        return {}
    if len(blocks) <= PLAIN:
        return place_in_order(blocks, _breadth_order_plainly(blocks), "best")
    starts = np.array([b.start for b in blocks], dtype=np.int64)
    ends = np.array([b.end for b in blocks], dtype=np.int64)
    sizes = np.array([b.size for b in blocks], dtype=np.int64)
    times = np.unique(starts)
    first = np.searchsorted(times, starts, side="left")
    last = np.searchsorted(times, ends, side="right") - 1
    delta = np.zeros(len(times) + 1, dtype=np.int64)  # live bytes at each op: a sweep
    np.add.at(delta, first, sizes)
    np.add.at(delta, last + 1, -sizes)
    breadth = np.cumsum(delta[:-1])
    rank = np.empty(len(times), dtype=np.int64)
    rank[np.lexsort((times, -breadth))] = np.arange(len(times))
    chosen = _range_min(rank, first, last)
    order = sorted(range(len(blocks)), key=lambda i: (chosen[i], -blocks[i].size,
                                                      blocks[i].key))
    return place_in_order(blocks, [blocks[i] for i in order], "best")


def _breadth_order_plainly(blocks: Sequence[Block]) -> list[Block]:
    """greedy_by_breadth's order for a few blocks, without arrays: the same sort keys."""
    times = sorted({b.start for b in blocks})
    breadth = {t: sum(b.size for b in blocks if b.start <= t <= b.end) for t in times}
    rank = {t: r for r, t in enumerate(sorted(times, key=lambda t: (-breadth[t], t)))}
    chosen = [min(rank[t] for t in times if b.start <= t <= b.end) for b in blocks]
    order = sorted(range(len(blocks)), key=lambda i: (chosen[i], -blocks[i].size,
                                                      blocks[i].key))
    return [blocks[i] for i in order]


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[int]:
    """min(values[lo[i] .. hi[i]]) for every i (inclusive), by a sparse table."""
    table = [values]
    while 2 ** len(table) <= len(values):
        step = 2 ** (len(table) - 1)
        previous = table[-1]
        table.append(np.minimum(previous[:-step], previous[step:]))
    level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
    found = np.empty(len(lo), dtype=np.int64)
    for k in np.unique(level).tolist():
        at = level == k
        row = table[k]
        found[at] = np.minimum(row[lo[at]], row[hi[at] - 2 ** k + 1])
    return found.tolist()


def exact_size_reuse(blocks: Sequence[Block]) -> Offsets:
    """ONNX Runtime-style: reuse a freed block only of exactly the same size."""
    offsets: Offsets = {}
    free: dict[int, list[int]] = {}
    pending = sorted(blocks, key=lambda b: (b.end, b.key))    # not yet released, by death
    top = released = 0
    for b in sorted(blocks, key=lambda b: (b.start, b.key)):
        while released < len(pending) and pending[released].end < b.start:
            dead = pending[released]
            if dead.id in offsets:
                free.setdefault(dead.size, []).append(offsets[dead.id])
            released += 1
        slots = sorted(free.get(b.size, []))
        slot = next((s for s in slots if s % b.alignment == 0), None)
        if slot is None:
            slot, top = round_up(top, b.alignment), round_up(top, b.alignment) + b.size
        else:
            free[b.size].remove(slot)
        offsets[b.id] = slot
    return offsets


STRATEGIES: dict[str, Callable[[Sequence[Block]], Offsets]] = {
    "greedy_by_size": greedy_by_size,
    "greedy_by_size_first_fit": greedy_by_size_first_fit,
    "greedy_by_breadth": greedy_by_breadth,
    "greedy_by_lifetime": greedy_by_lifetime,
    "greedy_by_area": greedy_by_area,
    "first_fit_schedule": first_fit_schedule,
    "best_fit_schedule": best_fit_schedule,
}
BASELINES: dict[str, Callable[[Sequence[Block]], Offsets]] = {
    "greedy_by_size": greedy_by_size,
    "exact_size_reuse": exact_size_reuse,
}


def check_offsets(blocks: Sequence[Block], offsets: Offsets, arena: int | None = None) -> None:
    """Raises PlanError when a block is unplaced, misaligned, outside the arena, or overlaps
    a block live at the same time."""
    for b in blocks:
        if b.id not in offsets:
            raise PlanError(f"block {b.id!r} has no offset")
        off = offsets[b.id]
        if off < 0 or off % b.alignment:
            raise PlanError(f"block {b.id!r} at offset {off}: not a multiple of {b.alignment}")
        if arena is not None and off + b.size > arena:
            raise PlanError(f"block {b.id!r} [{off}, {off + b.size}) exceeds the arena of {arena}")
    _check_disjoint_while_live(blocks, offsets)


def _check_disjoint_while_live(blocks: Sequence[Block], offsets: Offsets) -> None:
    """A sweep over the blocks in start order holding the live ones sorted by offset: they
    are pairwise disjoint (else the check has failed already), so a new block can only
    overlap its neighbours there, the one below its offset and the one above (n log n;
    comparing each block with every live one was quadratic in a long graph)."""
    live: list[tuple] = []  # (offset, end byte, order, block), sorted
    expiring: list[tuple] = []  # heap of (last op, offset, end byte, order, block)
    for order, b in enumerate(sorted(blocks, key=lambda b: (b.start, b.key))):
        while expiring and expiring[0][0] < b.start:
            entry = heapq.heappop(expiring)[1:]
            del live[bisect.bisect_left(live, entry)]
        if b.size <= 0:
            continue
        off = offsets[b.id]
        entry = (off, off + b.size, order, b)
        at = bisect.bisect_left(live, entry)
        for a_off, a_end, _, a in live[max(at - 1, 0):at + 1]:
            if a_off < off + b.size and off < a_end:
                raise PlanError(
                    f"blocks {a.id!r} (ops #{a.start}..#{a.end}, bytes [{a_off}, {a_end})) "
                    f"and {b.id!r} (ops #{b.start}..#{b.end}, bytes [{off}, {off + b.size})) "
                    "overlap while both live")
        live.insert(at, entry)
        heapq.heappush(expiring, (b.end, *entry))


def _overlap(a_off: int, a_size: int, b_off: int, b_size: int) -> bool:
    return a_size > 0 and b_size > 0 and a_off < b_off + b_size and b_off < a_off + a_size
