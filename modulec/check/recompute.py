"""Recompute legality (§7.2.0) and the cost of the derived backward.

E021: a tensor whose memory decision is `recompute` must be derivable from what the
backward has: saved tensors, parameters, and tensors that are themselves recomputable;
a forward input is available only if saved. (Cycles inside a backward `recompute:` block
are E022, reported by the graph checker.)

W003: a module that leaves its backward to the compiler and lists `save:` explicitly
gets the derived backward's needs compared with that list: a tensor some primitive's
backward reads (its `save:`) that is neither saved nor marked recompute must be
recomputed silently; the warning makes the choice explicit.
"""

from __future__ import annotations

from modulec.check.instance import Instance
from modulec.check.memory_policy import memory_decisions
from modulec.check.order import used_names
from modulec.diagnostics import Label
from modulec.syntax import ast as A

KEPT = ("save", "pin", "offload", "stream")


def check_recompute(instance: Instance, producers: dict[str, A.Flow], uses: list) -> None:
    decl = instance.definition.decl
    if instance.definition.forward is None or decl.kind == "primitive":
        return
    decisions = memory_decisions(decl)
    available = _available(instance, decisions)
    inputs = {sig.name for sig in instance.definition.forward.inputs}
    tensors = set(producers) | inputs
    for name, decision in decisions.items():
        if decision.policy == "recompute" and name in tensors:
            missing = _underivable(name, producers, available, set(), tensors)
            if missing:
                _report_underivable(instance, name, decision, missing)
    if instance.definition.backward is None and instance.definition.forward.save is not None:
        _derived_backward_needs(instance, decisions, producers, uses)


def _available(instance: Instance, decisions) -> set[str]:
    """What a backward has without recomputing: kept tensors, saved inputs, parameters."""
    kept = {n for n, d in decisions.items() if d.policy in KEPT}
    save = instance.definition.forward.save
    listed = {i.id for i in save.value.items if isinstance(i, A.Name)} \
        if save is not None and isinstance(save.value, A.ListExpr) else set()
    return kept | listed | set(instance.params)


def _underivable(name: str, producers, available: set[str], visiting: set[str],
                 tensors: set[str]) -> set[str]:
    """The unsaved forward inputs `name` depends on (empty: derivable)."""
    if name in available:
        return set()
    flow = producers.get(name)
    if flow is None:
        return {name}  # a forward input: only a saved one is there in the backward
    if name in visiting:
        return set()
    missing: set[str] = set()
    for source in sorted(used_names(flow) & tensors):
        missing |= _underivable(source, producers, available, visiting | {name}, tensors)
    return missing


def _report_underivable(instance: Instance, name: str, decision, missing: set[str]) -> None:
    shown = ", ".join(f"`{m}`" for m in sorted(missing))
    instance.world.error(
        "E021", f"`{name}` is marked recompute but cannot be derived from saved tensors",
        decision.span, f"needs {shown}, not saved",
        notes=[f"decided by: {decision.reason}"] if decision.reason else [],
        help=[f"add {shown} to `save:` (the recompute frontier), or save `{name}` itself"])


def _derived_backward_needs(instance: Instance, decisions, producers, uses) -> None:
    forward = instance.definition.forward
    for rule, inputs, outputs, span in uses:
        for needed in _needed_names(rule, inputs, outputs):
            decision = decisions.get(needed)
            if needed in producers and decision is not None and \
                    decision.policy not in KEPT + ("recompute",):
                instance.world.warn(
                    "W003", f"the derived backward needs `{needed}` ({rule.name}'s backward "
                    "reads it), which is not saved: it will be recomputed", span,
                    f"`{rule.name}` saves `{needed}` for its backward",
                    secondary=[Label(forward.save.span, "the save list")],
                    help=[f"add `{needed}` to `save:` to keep it, or to `recompute:` to make "
                          "recomputation explicit"])


def _needed_names(rule, inputs, outputs) -> list[str]:
    """Names of this flow's tensors that the primitive's `save:` list asks for."""
    save = rule.definition.save
    if save is None or not isinstance(save.value, A.ListExpr):
        return []
    forward = rule.definition.forward
    by_signature = {}
    for sig, tensor in zip(forward.inputs, inputs):
        if tensor is not None and tensor.name:
            by_signature[sig.name] = tensor.name
    for sig, name in zip(forward.outputs, outputs):
        if name and name != "_":  # a discarded output is the planner's, unnamed
            by_signature[sig.name] = name
    wanted = [item.id for item in save.value.items if isinstance(item, A.Name)]
    return [by_signature[w] for w in wanted if w in by_signature]
