"""The activation layout of the Schedule IR: where every saved activation of every layer
lives, so a runtime allocates the saved-activation region once and indexes into it.

It follows the memory plan (modulec.plan.from_graph): each forward function is planned
once, its saved values placed in a per-instance *record* of `stride` bytes (the function's
saved arena); the region holds one record per instance, functions one after another in
graph order, so instance i of F's value v is at `base + i * stride + offset`, for every
function, however deeply its calls repeat (instance i: the i-th time F runs in the
forward; modulec.lower.decided). The region's size is the plan's saved-activation total.
A view (`view_of`) shares its source's bytes; a value laid with spare columns after each
row (modulec.plan.pads) says so (`rows`: its row's elements and their stride). `decisions` gives, per run of instances,
keep / recompute / swap as the planner decided (keep without a planner). Swapped values
also get a slot in a host record (`host_offset`; the host region is laid out the same
way, with only the values swapped in some instance): swap_out / swap_in copy between the
two. The device record still reserves a slot for every saved value whatever its decision:
shrinking it to the values kept is left to a runtime allocator.
"""

from __future__ import annotations

from modulec.plan.memory import SAVED
from modulec.plan.memory.model import round_up
from modulec.plan.recompute import KEEP, SWAP

HOST = "host_activations"
ALIGNMENT = 256


def activation_layout(graph, plan, decided=None) -> dict:
    """The `layout` section of a memory plan (modulec.plan.from_graph.StepPlan);
    `decided` (modulec.lower.decided.Decided) adds the planner's decisions."""
    functions, base, host_base = [], 0, 0
    for function in graph.functions:
        placed = {v: p for v, p in plan.placements.get(function.name, {}).items()
                  if p.region == SAVED}
        if function.gradient_of or not placed:
            continue
        count = plan.invocations.get(function.name, 0)
        entry = _function_layout(function, placed, count, decided,
                                 getattr(plan, "pads", {}).get(function.name, {}))
        entry["saved"]["stride"] = _saved_arena(plan, function.name)
        entry["saved"]["base"], entry["host"]["base"] = base, host_base
        base += entry["saved"]["stride"] * count
        host_base += entry["host"]["stride"] * count
        functions.append(entry)
    return {"regions": {SAVED: base, HOST: host_base}, "functions": functions}


def _saved_arena(plan, name: str) -> int:
    regions = plan.functions.get(name, {}).get("regions", [])
    return next((r["arena_bytes"] for r in regions if r["region"] == SAVED), 0)


def _function_layout(function, placed: dict, count: int, decided, pads: dict) -> dict:
    values, host = [], 0
    for value_id, placement in sorted(placed.items(), key=lambda i: (i[1].offset, i[0])):
        info = function.value(value_id)
        runs = _decisions(function.name, value_id, count, decided)
        row = {"value": value_id, "name": info.name if info else "",
               "shape": list(info.shape) if info else [], "dtype": info.dtype if info else "",
               "offset": placement.offset, "bytes": placement.size_bytes, "decisions": runs}
        if value_id in pads and placement.block == value_id:
            row["rows"] = {"elements": pads[value_id].row,
                           "stride": pads[value_id].row + pads[value_id].pad}
        if placement.block != value_id:
            row["view_of"] = placement.block
        elif any(kind == SWAP for kind, _, _ in runs):
            row["host_offset"] = host
            host += round_up(placement.size_bytes, ALIGNMENT)
        values.append(row)
    return {"function": function.name, "instances": count,
            "saved": {"base": 0, "stride": 0},
            "host": {"base": 0, "stride": host}, "values": values}


def _decisions(function: str, value_id: str, count: int, decided) -> list:
    """[kind, first, last] runs over the instances (inclusive)."""
    kinds = [KEEP] * count
    if decided is not None:
        for path, name in decided.step.instances.items():
            if name == function:
                key = decided.step.envs[path].get(value_id)
                kinds[decided.index[path]] = decided.kinds.get(key, KEEP)
    runs: list = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][0] == kind:
            runs[-1][2] = i
        else:
            runs.append([kind, i, i])
    return runs


def host_offsets(layout: dict) -> dict:
    """(function, value) -> its offset in the function's host record."""
    return {(f["function"], v["value"]): v["host_offset"] for f in layout["functions"]
            for v in f["values"] if "host_offset" in v}
