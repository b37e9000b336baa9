"""Recompute intent: per saved activation (storage) of each forward function instance, what
the source asks for and what the recompute policies allow in the training mode.

User intent first: spec §7.2.0's ladder (`modulec.check.memory_policy.memory_decisions`)
on the declaration of each function, mapped to the IR through the values' source names
(a view's decision is its storage's). `@checkpoint` reaches into what it covers: a
block-level `@checkpoint(full)` recomputes everything its instance produces, callees'
activations included, and keeps the instance's inputs (the boundary); a `@checkpoint` on
a flow does the same for the calls of that flow; `none` keeps them; `selective` leaves
them to their own ladder; `preserve=[...]` keeps the named tensors, the callees' too.
Among decisions for one storage the lowest rung wins; on a tie keep, then swap, then
recompute. Rungs up to `binding` (default 3: annotations) are fixed decisions; the
module's `save:` / `recompute:` lists and the defaults (rungs 4-6) are suggestions the
budget planner may revise (`binding=5` fixes the lists too).

Then policies (docs/spec/dsl-driven-recompute.md): `always`, `lora_only` (recompute only
when training LoRA adapters; kept in full fine-tuning), `never`. The module language has
no syntax for them, so they come from a mapping of patterns (fnmatch) to policies, matched
against a storage's `Module.name`, `scope.name`, bare `name`s and its producing primitive
(`flash_attention`); the most restrictive match wins; unmatched storages are `always`.
`DOC_POLICIES` is the design doc's DenseTransformerBlock assignment by primitive.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from modulec.check.annotation_table import argument_values
from modulec.check.memory_policy import (
    block_checkpoints, graph_items, iter_flows, memory_decisions, name_of, produced,
)
from modulec.ir.graph import Function, Graph
from modulec.plan.from_graph import saved_input_positions, saved_values
from modulec.plan.timeline import Step
from modulec.syntax import ast as A

KEEP, RECOMPUTE, SWAP = "keep", "recompute", "swap"
MODES = {"save": KEEP, "pin": KEEP, "recompute": RECOMPUTE, "temporary": RECOMPUTE,
         "offload": SWAP, "stream": SWAP}
PREFERENCE = {KEEP: 0, SWAP: 1, RECOMPUTE: 2}
POLICIES = ("always", "lora_only", "never")
DOC_POLICIES = {p: "lora_only" for p in ("matmul", "flash_attention", "rope", "qk_norm",
                                         "qk_norm_rope", "swiglu", "geglu")}
NO_SAY = 7  # no rung decided


@dataclass(frozen=True)
class Said:
    rung: int
    kind: str
    reason: str


@dataclass(frozen=True)
class Intent:
    kind: str | None             # a fixed decision, or None: the planner's choice
    rung: int
    reason: str
    policy: str = "always"
    recomputable: bool = True    # the policy allows recompute in this training mode
    suggested: str | None = None  # a non-binding rung's decision


@dataclass
class Intents:
    by_storage: dict = field(default_factory=dict)
    forced: set = field(default_factory=set)   # kept though no backward reads them
    notes: list = field(default_factory=list)


def declarations(path: Path, search_path=()) -> dict:
    """Declarations by name: the file's and everything it imports."""
    from modulec.resolve import Resolver

    resolver = Resolver(search_path)
    resolver.load(path)
    return declarations_of(resolver)


def declarations_of(resolver) -> dict:
    """Declarations by name of every file a resolver loaded (`build` reuses its own)."""
    found: dict = {}
    for loaded in resolver.files():
        for decl in (loaded.program.decls if loaded.program else ()):
            if decl.kind != "primitive":
                found.setdefault(decl.name, decl)
    return found


def intents(step: Step, graph: Graph, decls: dict, training: str = "full",
            policies: dict | None = None, binding: int = 3) -> Intents:
    result = Intents()
    said = _ladder(step, graph, decls)
    _checkpoints(step, graph, decls, said, result.forced)
    for key in step.saved():
        policy = storage_policy(step, graph, key, policies or {})
        allowed = recomputable(policy, training)
        found = said.get(key, [])
        best = min(found, key=lambda s: (s.rung, PREFERENCE[s.kind])) if found else None
        if best is not None and best.rung <= binding:
            result.by_storage[key] = Intent(best.kind, best.rung, best.reason, policy, allowed)
            if best.kind == RECOMPUTE and not allowed:
                result.notes.append(f"{best.reason}: recomputed although its policy is "
                                    f"`{policy}` in {training} training (the annotation wins)")
        else:
            result.by_storage[key] = Intent(None, best.rung if best else NO_SAY,
                                            best.reason if best else "", policy, allowed,
                                            best.kind if best else None)
    return result


def recomputable(policy: str, training: str) -> bool:
    return policy == "always" or (policy == "lora_only" and training == "lora")


def storage_policy(step: Step, graph: Graph, key, policies: dict) -> str:
    storage = step.storages[key]
    function = graph.function(storage.function)
    texts = {step.ops[storage.producer].node.target}
    for name in storage.names:
        texts |= {name, f"{function.module}.{name}", f"{function.scope}.{name}"}
    matched = [policy for pattern, policy in policies.items()
               if any(fnmatch.fnmatchcase(t, pattern) for t in texts)]
    return max(matched, key=POLICIES.index, default="always")


# ====================================================================== the ladder
def _ladder(step: Step, graph: Graph, decls: dict) -> dict:
    said: dict = {}
    cache: dict = {}
    for path, name in step.instances.items():
        function = graph.function(name)
        decl = decls.get(function.module)
        if decl is None:
            continue
        if name not in cache:
            cache[name] = memory_decisions(decl, _consumed(graph, function))
        env = step.envs[path]
        for value in function.values + function.inputs:
            decision = cache[name].get(value.name) if value.name else None
            key = env.get(value.id)
            if decision is not None and decision.policy in MODES and key in step.storages:
                said.setdefault(key, []).append(Said(
                    decision.source, MODES[decision.policy],
                    f"{function.module}.{value.name}: {decision.reason}"))
    return said


def _consumed(graph: Graph, function: Function) -> set[str]:
    ids = saved_values(graph, function)
    ids |= {function.inputs[i].id for i in saved_input_positions(graph, function.name)}
    backward = next((f for f in graph.functions if f.gradient_of == function.name), None)
    ids |= set(backward.saved) if backward is not None else set()
    return {v.name for v in function.values + function.inputs if v.id in ids and v.name}


# ====================================================================== @checkpoint
def _checkpoints(step: Step, graph: Graph, decls: dict, said: dict, forced: set) -> None:
    saved = step.saved()
    for path, name in step.instances.items():
        function = graph.function(name)
        decl = decls.get(function.module)
        if decl is None:
            continue
        env = step.envs[path]
        for note in block_checkpoints(decl):
            inputs = [env.get(v.id) for v in function.inputs]
            _cover(step, saved, [path], inputs, note, f"block-level @checkpoint of "
                   f"{function.module}", said, forced)
        for flow in iter_flows(graph_items(decl)):
            for note in (n for s in flow.steps for n in s.annotations if n.name == "checkpoint"):
                names = {n.id for n in produced(flow)}
                calls = [n for n in function.nodes if n.kind == "call" and
                         any(_named(function, o) in names for o in n.outputs)]
                paths = [path + ((n.id, r),) for n in calls for r in range(int(n.repeat))]
                inputs = [env.get(i) for n in calls for i in n.inputs]
                _cover(step, saved, paths, inputs, note, f"@checkpoint on the flow to "
                       f"{', '.join(sorted(names))} in {function.module}", said, forced)


def _named(function: Function, value_id: str) -> str:
    value = function.value(value_id)
    return value.name if value is not None else ""


def _cover(step: Step, saved, paths, inputs, note, what: str, said: dict, forced) -> None:
    """Decisions of one `@checkpoint` on the storages made inside the instances `paths`."""
    level = name_of(argument_values(note).get("granularity")) or "full"
    keep = set(_preserve(note))
    inside = [k for k in saved if any(k[0][:len(p)] == p for p in paths)]
    for key in inside:
        if keep & set(step.storages[key].names):
            said.setdefault(key, []).append(Said(2, KEEP, f"preserved by {what}"))
        elif level in ("full", "none"):
            kind = RECOMPUTE if level == "full" else KEEP
            said.setdefault(key, []).append(Said(3, kind, f"{what} ({level})"))
    if level == "full":
        forced.update(k for k in inputs if k is not None and
                      step.storages[k].producer is not None)


def _preserve(note) -> list[str]:
    value = argument_values(note).get("preserve")
    items = value.items if isinstance(value, A.ListExpr) else ()
    return [i.id if isinstance(i, A.Name) else i.value for i in items
            if isinstance(i, (A.Name, A.String))]
