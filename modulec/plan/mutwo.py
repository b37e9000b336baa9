"""MuTWO's scheduler (Algorithm B, docs/spec/mutwo-checkpointing-plan.md) over the
activations user intent left free: keep, recompute or swap each, until the predicted peak
fits the budget, at the least predicted time overhead it can find.

Fixed decisions (modulec.plan.recompute) apply first. Then, while the peak is over the
budget and candidates remain:
- swap candidate: the one inactive longest (last forward use to first backward use); its
  overhead is the stall it adds to the swap schedule (`SwapOverhead`, Algorithm C:
  simulate.swap_schedule, prefetches as late as the link allows);
- recompute candidate: the highest recompute ratio, bytes freed per second of replay
  (`RecomputeOverhead`: the replay ops its segment adds to those already replayed; bytes
  freed net of the implicit checkpoints it needs); only where the policy allows it;
- the cheaper per byte freed wins (the plan compares raw overheads; per byte, a tiny
  tensor's free recompute does not beat a large one's cheap swap), recompute on a tie;
- update: segments are re-derived (`update_recomps`: recomputing a frontier extends the
  segments that stopped at it), candidates of the regions it touched re-estimated
  (`update_candidates`), the swap schedule re-simulated (`update_swap_prompts`), and the
  peak simulated again (`get_mem_consumption`).
Deterministic: ties go to the activation produced first. The loop does not depend on the
budget until it stops, so budgets are met monotonically: a larger budget stops no later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.plan.recompute import RECOMPUTE, SWAP
from modulec.plan.replay import (
    APPLY, FULL, closure, region_of, storage_region, unit_seconds,
)
from modulec.plan.simulate import Outcome, evaluate, swap_item, swap_schedule


@dataclass
class Schedule:
    recompute: set
    swap: set
    outcome: Outcome
    budget: int
    feasible: bool
    minimum_peak: int                     # the lowest peak the loop reached
    steps: list = field(default_factory=list)   # (kind, keys, peak, overhead) per decision


def fixed_decisions(problem) -> tuple[set, set]:
    intents = problem.intents.by_storage
    return ({k for k, i in intents.items() if i.kind == RECOMPUTE},
            {k for k, i in intents.items() if i.kind == SWAP})


def schedule(problem, budget: int) -> Schedule:
    recompute, swap = fixed_decisions(problem)
    outcome = evaluate(problem, recompute, swap)
    result = Schedule(recompute, swap, outcome, budget, False, outcome.peak_bytes)
    remaining = [k for k in problem.step.saved() if problem.intents.by_storage[k].kind is None]
    estimates = _Estimates(problem)
    while outcome.peak_bytes > budget and remaining:
        choice = _choose(problem, outcome, remaining, recompute, swap, estimates)
        if choice is None:
            break
        kind, keys = choice
        _apply(recompute, swap, kind, keys)
        remaining = [k for k in remaining if k not in keys]
        before = set(outcome.replays.checkpoints)
        outcome = evaluate(problem, recompute, swap)
        if kind == RECOMPUTE:
            estimates.invalidate(keys, outcome.replays.checkpoints - before)
        result.steps.append((kind, keys, outcome.peak_bytes, outcome.overhead_s))
        result.minimum_peak = min(result.minimum_peak, outcome.peak_bytes)
    result.outcome, result.feasible = outcome, outcome.peak_bytes <= budget
    if result.feasible:
        return result
    lowest = prefix(problem, result, result.minimum_peak)  # report the lowest state
    lowest.budget, lowest.feasible = budget, False
    return lowest


def prefix(problem, result: Schedule, budget: int) -> Schedule:
    """The schedule `schedule(problem, budget)` gives, read off a run for a lower budget
    (the loop is the same until it stops): a sweep of budgets costs one run."""
    recompute, swap = fixed_decisions(problem)
    peak = evaluate(problem, recompute, swap).peak_bytes
    steps = []
    for kind, keys, after, overhead in result.steps:
        if peak <= budget:
            break
        _apply(recompute, swap, kind, keys)
        steps.append((kind, keys, after, overhead))
        peak = after
    outcome = evaluate(problem, recompute, swap)
    return Schedule(recompute, swap, outcome, budget, outcome.peak_bytes <= budget,
                    min([outcome.peak_bytes] + [s[2] for s in steps]), steps)


def _apply(recompute: set, swap: set, kind: str, keys) -> None:
    """One decision; a recompute may take over a swap (one still offloading at the peak)."""
    if kind == SWAP:
        swap.update(keys)
    else:
        recompute.update(keys)
        swap.difference_update(keys)


def _choose(problem, outcome: Outcome, remaining, recompute, swap, estimates):
    """The next decision: the cheaper per byte of the swap and the recompute candidate,
    among those that lower the current peak (free the activation where it happens)."""
    storages = problem.step.storages
    stored = outcome.replays.checkpoints
    s_cand, s_cost = _swap_candidate(problem, outcome, remaining, swap, stored)
    r_cand, r_cost = None, None
    groups: dict = {}
    for key in remaining + _in_flight(problem, outcome, swap):
        intent = problem.intents.by_storage[key]
        if not intent.recomputable or key in stored:
            continue
        groups.setdefault(storage_region(problem.step, key), []).append(key)
        if not _recompute_helps(problem, outcome, key):
            continue
        net, seconds = estimates.get(outcome, recompute, (key,))
        if net > 0 and (r_cost is None or seconds / net < r_cost):
            r_cand, r_cost = (key,), seconds / net
    for members in groups.values():
        if len(members) < 2 or not any(_recompute_helps(problem, outcome, k) for k in members):
            continue
        net, seconds = estimates.get(outcome, recompute, tuple(members))
        if net > 0 and (r_cost is None or seconds / net < r_cost):
            r_cand, r_cost = tuple(members), seconds / net
    if s_cand is None and r_cand is None:
        return None
    if r_cand is None or (s_cand is not None and s_cost / storages[s_cand].bytes < r_cost):
        return SWAP, (s_cand,)
    return RECOMPUTE, r_cand


def _in_flight(problem, outcome: Outcome, swap: set) -> list:
    """Swapped activations (the planner's, not fixed) still being offloaded at the peak:
    recomputing them instead frees them there (the swap is undone)."""
    peak = outcome.peak_at["time_s"]
    found = []
    for key in sorted(swap, key=problem.order.get):
        times = outcome.swap_times.get(key)
        produced = outcome.start[problem.step.storages[key].producer]
        if problem.intents.by_storage[key].kind is None and times and \
                produced <= peak < times[0]:
            found.append(key)
    return found


def _recompute_helps(problem, outcome: Outcome, key) -> bool:
    """Whether recomputing `key` frees it at the peak: made before, last read in the
    forward before, first read in the backward after."""
    step, peak = problem.step, outcome.peak_at["time_s"]
    storage = step.storages[key]
    first = storage.reads_backward[0]
    return outcome.start[storage.producer] <= peak and \
        outcome.end[storage.last_read_forward] <= peak < outcome.start[first]


def _swap_candidate(problem, outcome: Outcome, remaining, swap, stored, tries: int = 6):
    """The free activation inactive longest whose swap frees it at the peak (offloaded
    before, prefetched after), and the stall swapping it adds."""
    if not problem.device.host_bytes_per_s:  # a `-noswap` profile: no host link
        return None, None
    peak = outcome.peak_at["time_s"]
    found = []
    for key in remaining:
        if key in stored:
            continue
        item = swap_item(problem, outcome, outcome.uses, key)
        if item.produced <= peak < item.deadline and item.last_forward <= peak:
            found.append((-(item.deadline - item.last_forward), item.order, item))
    items = [swap_item(problem, outcome, outcome.uses, k)
             for k in sorted(swap, key=problem.order.get) if k not in stored]
    for _, _, item in sorted(found)[:tries]:
        stall, times = swap_schedule(items + [item], outcome.backward_start,
                                     problem.device.host_bytes_per_s)
        offloaded, issued = times[item.key]
        if offloaded <= peak < issued:
            return item.key, max(0.0, stall - outcome.stall_s)
    return None, None


class _Estimates:
    """Recompute estimates per candidate (one activation, or all the free ones of a
    region: recomputing a whole block at once frees what one by one would not, its
    segments needing only the block's inputs): (net bytes freed, replay seconds added),
    kept until a decision touches the region."""

    def __init__(self, problem):
        self.problem = problem
        self.cache: dict = {}

    def get(self, outcome: Outcome, recompute: set, keys: tuple) -> tuple[int, float]:
        if keys not in self.cache:
            self.cache[keys] = self._estimate(outcome, recompute, set(keys))
        return self.cache[keys]

    def _estimate(self, outcome: Outcome, recompute: set, keys: set) -> tuple[int, float]:
        problem, step = self.problem, self.problem.step
        stored = outcome.replays.checkpoints
        placed = outcome.replays.placement

        def available(k):
            return k in stored or (k in problem.candidates and k not in recompute
                                   and k not in keys)

        units, crossings = set(), set()
        for key in sorted(keys, key=problem.order.get):
            found = closure(step, key, available)
            units |= found.units
            crossings |= found.crossings
        new = [u for u in sorted(units) if u not in placed and
               not (u[1] == APPLY and ((u[0], FULL) in placed or (u[0], FULL) in units))]
        seconds = sum(unit_seconds(step, u, problem.device) for u in new)
        needed = sum(step.storages[k].bytes for k in crossings - stored)
        return sum(step.storages[k].bytes for k in keys) - needed, seconds

    def invalidate(self, keys, new_checkpoints) -> None:
        step = self.problem.step
        regions = {storage_region(step, k) for k in keys}
        regions |= {region_of(step.ops[i]) for k in keys for i in step.storages[k].readers
                    if i < step.forward_ops}
        regions |= {storage_region(step, k) for k in new_checkpoints}
        for cached in list(self.cache):
            if storage_region(step, cached[0]) in regions:
                del self.cache[cached]
