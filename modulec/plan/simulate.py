"""Predicted peak memory and time overhead of one set of keep / recompute / swap decisions.

Time: the flattened step (modulec.plan.timeline) with each placement's replay inserted
before its backward op. Swaps: an offload starts after the storage's last forward use,
one at a time on the device-to-host link; prefetches run one at a time on the
host-to-device link, issued as late as the link allows (latest deadline first), never
before the backward starts nor before the offload ended; the compute waits when a
prefetch ends after its first backward use (the stall, MuTWO's unhidden swap time).

Memory: weights, gradients and optimizer state (fixed), plus the transient arena of the
phase (from_graph's forward or backward arena, the larger one all through that phase),
plus the activations alive at that moment: a kept storage from its producer to its last
backward use, a swapped one until its offload ends and again from its prefetch, a
recomputed one during its forward uses and from its replay to its last backward use,
and a replay's intermediates from their replay to the last replayed op reading them.
The peak is the maximum over the step. With every activation kept it equals
`modulec plan`'s total: saved + max(forward, backward transient) + fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.plan.replay import Replays, plan_replays, unit_reads, unit_seconds, unit_writes


@dataclass
class Outcome:
    peak_bytes: int
    recompute_s: float
    stall_s: float
    replays: Replays
    start: list                  # op start times (s), replays included
    end: list
    backward_start: float
    peak_at: dict = field(default_factory=dict)   # phase, time, activations, transient bytes
    swap_times: dict = field(default_factory=dict)  # key -> (offload end, prefetch issue)
    uses: dict = field(default_factory=dict)        # key -> (first, last) replay read time

    @property
    def overhead_s(self) -> float:
        return self.recompute_s + self.stall_s


def evaluate(problem, recompute: set, swap: set) -> Outcome:
    step = problem.step
    replays = plan_replays(step, recompute, problem.candidates, problem.forced)
    windows, start, end, replay_s = _timeline(problem, replays)
    uses = _replay_uses(step, replays, windows)
    outcome = Outcome(0, replay_s, 0.0, replays, start, end, end[step.forward_ops - 1],
                      uses=uses)
    items = [swap_item(problem, outcome, uses, k) for k in sorted(swap, key=problem.order.get)
             if k not in replays.checkpoints]
    outcome.stall_s, outcome.swap_times = swap_schedule(items, outcome.backward_start,
                                                        problem.device.host_bytes_per_s)
    events = _events(problem, outcome, uses, windows, set(swap))
    outcome.peak_bytes, outcome.peak_at = _peak(problem, events, outcome.backward_start)
    return outcome


# ====================================================================== time
def _timeline(problem, replays: Replays):
    """Replay windows per placement, op start / end times, and total replay time."""
    step, device = problem.step, problem.device
    at: dict[int, float] = {}
    for unit, placed in replays.placement.items():
        at[placed] = at.get(placed, 0.0) + unit_seconds(step, unit, device)
    start, end, windows = [], [], {}
    now = 0.0
    for op in step.ops:
        if op.index in at:
            windows[op.index] = (now, now + at[op.index])
            now += at[op.index]
        start.append(now)
        now += op.seconds
        end.append(now)
    return windows, start, end, sum(at.values())


def _replay_uses(step, replays: Replays, windows) -> dict:
    """Storage -> (first, last) time a replay reads it."""
    uses: dict = {}
    for unit, placed in replays.placement.items():
        begin, finish = windows[placed]
        for key in unit_reads(step, unit):
            first, last = uses.get(key, (begin, finish))
            uses[key] = (min(first, begin), max(last, finish))
    return uses


def _last_use(problem, outcome, uses, key) -> float:
    step = problem.step
    storage = step.storages[key]
    reads = storage.reads_backward
    last = outcome.end[reads[-1]] if reads else \
        outcome.end[storage.last_read_forward]
    return max(last, uses.get(key, (0.0, 0.0))[1])


# ====================================================================== swaps
@dataclass(frozen=True)
class SwapItem:
    key: tuple
    order: int
    bytes: int
    produced: float
    last_forward: float          # end of its last forward use: the offload may start
    deadline: float              # start of its first backward use (a replay's or an op's)
    last_use: float


def swap_item(problem, outcome: Outcome, uses: dict, key) -> SwapItem:
    step = problem.step
    storage = step.storages[key]
    reads = storage.reads_backward
    deadline = outcome.start[reads[0]]
    if key in uses:
        deadline = min(deadline, uses[key][0])
    return SwapItem(key, problem.order[key], storage.bytes, outcome.start[storage.producer],
                    outcome.end[storage.last_read_forward], deadline,
                    _last_use(problem, outcome, uses, key))


def swap_schedule(items: list[SwapItem], backward_start: float, link: float):
    """(stall seconds, key -> (offload end, prefetch issue)) of these swaps."""
    free, offloaded = 0.0, {}
    for item in sorted(items, key=lambda i: (i.last_forward, i.order)):
        free = max(free, item.last_forward) + item.bytes / link
        offloaded[item.key] = free
    prompt, latest = {}, float("inf")
    for item in sorted(items, key=lambda i: (-i.deadline, -i.order)):
        latest = min(item.deadline, latest) - item.bytes / link
        prompt[item.key] = latest
    stall, free, times = 0.0, float("-inf"), {}
    for item in sorted(items, key=lambda i: (i.deadline, i.order)):
        ready = max(offloaded[item.key], backward_start)
        issue = max(prompt[item.key] + stall, ready, free)
        free = issue + item.bytes / link
        times[item.key] = (offloaded[item.key], issue - stall)
        stall += max(0.0, free - (item.deadline + stall))
    return stall, times


# ====================================================================== memory
def _events(problem, outcome: Outcome, uses: dict, windows: dict, swap: set) -> list:
    step, replays = problem.step, outcome.replays
    events: list = []
    replayed = set(replays.closures)

    def alive(key, begin, finish):
        events.append((begin, 1, step.storages[key].bytes))
        events.append((finish, 0, -step.storages[key].bytes))

    for key in problem.candidates | replays.checkpoints:
        storage = step.storages[key]
        produced = outcome.start[storage.producer]
        if key in replayed:
            alive(key, produced, outcome.end[storage.last_read_forward])
        elif key in swap and key in outcome.swap_times:
            offloaded, issued = outcome.swap_times[key]
            alive(key, produced, offloaded)
            alive(key, issued, _last_use(problem, outcome, uses, key))
        else:
            alive(key, produced, _last_use(problem, outcome, uses, key))
    for unit, placed in replays.placement.items():
        for key in unit_writes(step, unit):
            if key in replayed or key not in problem.candidates | replays.checkpoints:
                finish = max(windows[placed][1], uses.get(key, (0, 0))[1])
                if key in replayed:
                    finish = max(finish, _last_use(problem, outcome, uses, key))
                alive(key, windows[placed][0], finish)
    return events


def _peak(problem, events: list, backward_start: float):
    fixed = sum(problem.fixed_bytes.values())
    transient = {"forward": problem.transient_forward, "backward": problem.transient_backward}
    best = {"phase": "forward", "time_s": 0.0, "activations": 0,
            "transient": transient["forward"]}
    level = 0
    events.append((backward_start, 0, 0))  # the level as the backward starts
    events.sort()
    for index, (time, _, delta) in enumerate(events):
        level += delta
        if index + 1 < len(events) and events[index + 1][0] == time:
            continue
        phase = "backward" if time >= backward_start else "forward"
        if level + transient[phase] > best["activations"] + best["transient"]:
            best = {"phase": phase, "time_s": time, "activations": level,
                    "transient": transient[phase]}
    best["transient"] = max(best["transient"], 0)
    peak = fixed + best["activations"] + best["transient"]
    floor = fixed + max(transient.values())
    if peak < floor:
        best = {"phase": "backward", "time_s": backward_start, "activations": 0,
                "transient": max(transient.values())}
        peak = floor
    return peak, best
