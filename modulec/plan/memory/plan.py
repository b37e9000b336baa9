"""`plan_memory`: lifetimes -> storage sharing -> offsets, per region, and `verify`.

Each region (weights, gradients, optimizer state, saved activations, transient
activations, workspace, or any other name the input uses) is its own arena. In each, every
strategy of `offsets.STRATEGIES` runs and the smallest arena wins (ties: the earlier
strategy); the baselines run on the same blocks. Totals add the regions up, so the total
lower bound is the sum of the regions' bounds; `single_arena_lower_bound_bytes` is the
peak of everything together, for a planner that would share one arena across regions.

Deterministic: the same input gives the same plan, byte for byte (ties are broken by
position in the buffer list, never by hashing). So `plan_memory` keeps the last plans it
made (`RECENT`, by ops and buffers) and hands out a copy: a step's function is planned
once per metric (from_graph.METRICS) and mostly with the same input, and the same module
built again plans the same functions.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Sequence

from modulec.plan.memory import offsets as O
from modulec.plan.memory.lifetimes import Block, storage
from modulec.plan.memory.model import Buffer, BufferId, Op, PlanError, region_order, round_up


@dataclass(frozen=True)
class Placement:
    region: str
    offset: int               # bytes from the start of the region's arena
    size_bytes: int
    block: BufferId           # the buffer owning the storage (itself unless view / in place)
    first_use: int
    last_use: int


@dataclass(frozen=True)
class RegionPlan:
    region: str
    arena_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    strategy: str                       # the strategy that won
    strategies: dict[str, int]          # arena bytes of every strategy tried
    baselines: dict[str, int]           # greedy_by_size (TFLite), exact_size_reuse (ORT)
    blocks: tuple[Block, ...] = field(repr=False)
    block_offsets: dict[BufferId, int] = field(repr=False)

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def summary(self) -> dict:
        return {"region": self.region, "arena_bytes": self.arena_bytes,
                "lower_bound_bytes": self.lower_bound_bytes, "naive_bytes": self.naive_bytes,
                "strategy": self.strategy, **{f"{k}_bytes": v for k, v in self.baselines.items()}}


@dataclass(frozen=True)
class MemoryPlan:
    regions: dict[str, RegionPlan]                 # canonical region order
    placements: dict[BufferId, Placement]          # every buffer, views included
    inplace: dict[BufferId, BufferId]              # output -> input whose storage it took
    single_arena_lower_bound_bytes: int

    @property
    def arena_bytes(self) -> int:
        return sum(r.arena_bytes for r in self.regions.values())

    @property
    def lower_bound_bytes(self) -> int:
        return sum(r.lower_bound_bytes for r in self.regions.values())

    @property
    def naive_bytes(self) -> int:
        return sum(r.naive_bytes for r in self.regions.values())

    def baseline_bytes(self, name: str) -> int:
        return sum(r.baselines[name] for r in self.regions.values())

    def offset(self, bid: BufferId) -> int:
        return self.placements[bid].offset

    def summary(self) -> dict:
        """What `modulec plan` reports: bytes per region and in total (JSON-ready)."""
        return {"regions": [r.summary() for r in self.regions.values()],
                "arena_bytes": self.arena_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "naive_bytes": self.naive_bytes,
                **{f"{k}_bytes": self.baseline_bytes(k) for k in O.BASELINES},
                "single_arena_lower_bound_bytes": self.single_arena_lower_bound_bytes}


RECENT: OrderedDict[tuple, MemoryPlan] = OrderedDict()  # (ops, buffers) -> plan, newest last
RECENT_SIZE = 32


def plan_memory(ops: Sequence[Op], buffers: Sequence[Buffer]) -> MemoryPlan:
    """The plan of `ops` and `buffers`; a copy of the one made before for an equal input
    (its dicts are the caller's to change)."""
    key = (tuple(ops), tuple(buffers))
    try:
        plan = RECENT.get(key)
    except TypeError:  # an unhashable id or a list for a tuple: planned, not kept
        return _plan_memory(list(ops), list(buffers))
    if plan is None:
        plan = _plan_memory(list(ops), list(buffers))
        RECENT[key] = plan
        if len(RECENT) > RECENT_SIZE:
            RECENT.popitem(last=False)
    else:
        RECENT.move_to_end(key)
    return _copy(plan)


def _copy(plan: MemoryPlan) -> MemoryPlan:
    regions = {name: replace(r, strategies=dict(r.strategies), baselines=dict(r.baselines),
                             block_offsets=dict(r.block_offsets))
               for name, r in plan.regions.items()}
    return MemoryPlan(regions, dict(plan.placements), dict(plan.inplace),
                      plan.single_arena_lower_bound_bytes)


def _plan_memory(ops: list[Op], buffers: list[Buffer]) -> MemoryPlan:
    shared = storage(ops, buffers)
    by_region: dict[str, list[Block]] = {}
    for b in shared.blocks:
        by_region.setdefault(b.region, []).append(b)
    naive: dict[str, int] = {}
    for b in buffers:
        if b.alias_of is None:
            naive[b.region] = naive.get(b.region, 0) + round_up(b.size_bytes, b.alignment)
    regions = {name: plan_region(name, by_region.get(name, []), naive[name])
               for name in sorted(naive, key=region_order)}
    placements = _placements(buffers, shared, regions)
    return MemoryPlan(regions, placements, shared.inplace, O.lower_bound(shared.blocks))


def plan_region(name: str, blocks: list[Block], naive_bytes: int) -> RegionPlan:
    results = {s: fn(blocks) for s, fn in O.STRATEGIES.items()}
    arenas = {s: O.arena_bytes(blocks, offs) for s, offs in results.items()}
    winner = min(arenas, key=lambda s: (arenas[s], list(O.STRATEGIES).index(s)))
    O.check_offsets(blocks, results[winner], arenas[winner])
    baselines = {k: arenas[k] if k in arenas else O.arena_bytes(blocks, fn(blocks))
                 for k, fn in O.BASELINES.items()}
    return RegionPlan(name, arenas[winner], O.lower_bound(blocks), naive_bytes, winner,
                      arenas, baselines, tuple(blocks), results[winner])


def _placements(buffers, shared, regions) -> dict[BufferId, Placement]:
    block_region = {b.id: b.region for b in shared.blocks}
    out = {}
    for b in buffers:
        block, inner = shared.placement[b.id]
        region = block_region[block]
        first, last = shared.spans[b.id]
        out[b.id] = Placement(region, regions[region].block_offsets[block] + inner,
                              b.size_bytes, block, first, last)
    return out


def verify(plan: MemoryPlan) -> None:
    """Raises PlanError, saying which buffers and bytes, if two blocks live at the same
    time overlap, an offset is misaligned or outside its arena, or a buffer strays out of
    the storage it shares."""
    for region in plan.regions.values():
        O.check_offsets(region.blocks, region.block_offsets, region.arena_bytes)
        if region.arena_bytes < region.lower_bound_bytes:
            raise PlanError(f"region {region.region}: arena {region.arena_bytes} below its "
                            f"lower bound {region.lower_bound_bytes}: lifetimes are inconsistent")
    sizes = {b.id: (b.region, b.size) for r in plan.regions.values() for b in r.blocks}
    for bid, p in plan.placements.items():
        region, size = sizes[p.block]
        base = plan.regions[region].block_offsets[p.block]
        if p.region != region or not base <= p.offset <= p.offset + p.size_bytes <= base + size:
            raise PlanError(f"buffer {bid!r} at [{p.offset}, {p.offset + p.size_bytes}) in "
                            f"{p.region} lies outside its storage {p.block!r} "
                            f"[{base}, {base + size}) in {region}")
