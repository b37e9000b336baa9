"""Memory policy: spec §7.2.0's precedence ladder, one decision per tensor of a forward
graph; and E025 (§7.6.0), checkpoint regions that span pipeline stages.

| source | rule                                      | decides                             |
| ------ | ----------------------------------------- | ----------------------------------- |
| 1      | `@memory(mode)` on the tensor             | `mode`                              |
| 2      | `preserve=[...]` of a `@checkpoint` flow  | save                                |
| 3      | block-level `@checkpoint`                 | full: inputs save, the rest         |
|        |                                           | recompute (preserved ones save)     |
| 4      | the `save:` list                          | save                                |
| 5      | the `recompute:` list                     | recompute                           |
| 6      | default                                   | parameters pin; consumed by         |
|        |                                           | backward save; others temporary     |

The highest priority (lowest number) wins silently; the decision records the sources it
overrode. In the lists a name stands for a tensor or a parameter, a pattern with `*`
(`*_rstd`, `ln*_out`, `*`) for the graph's tensors it matches. A `@checkpoint` on a flow
is about the operations it calls (their internal tensors); of this graph's named tensors
it decides only those it preserves.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable, Iterator

from modulec.check.annotation_table import PIPELINE, argument_values
from modulec.diagnostics import Diagnostic, Label, error
from modulec.source import Span
from modulec.syntax import ast as A
from modulec.syntax.walk import tree_nodes
from modulec.syntax.printer import expr as expr_text

POLICIES = ("save", "recompute", "temporary", "pin", "offload", "stream")
LADDER = {
    1: "instance-level @memory annotation",
    2: "instance-level @checkpoint preserve list",
    3: "block-level @checkpoint annotation",
    4: "module's save: list",
    5: "module's recompute: list",
    6: "default policy",
}
MEMORY, CHECKPOINT = "memory", "checkpoint"
GRAPH_SECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class MemoryDecision:
    tensor: str
    policy: str
    source: int           # 1..6, the rung of the ladder that decided (see LADDER)
    reason: str
    span: Span
    overrides: tuple[int, ...] = ()  # lower-priority rungs that also had a say


# ====================================================================== graph helpers
def section(items: Iterable, name: str) -> A.Section | None:
    return next((i for i in items if isinstance(i, A.Section) and i.name == name), None)


def graph_items(decl: A.Decl, name: str = "forward") -> tuple:
    """The items of `name: graph:` (or of `name:` itself when it has no `graph:`)."""
    outer = section(decl.body, name)
    if outer is None:
        return ()
    graph = section(outer.body, "graph")
    return graph.body if graph is not None else outer.body


def iter_flows(items: Iterable) -> Iterator[A.Flow]:
    """Flows in order, both branches of `if` blocks included; a lone step is a flow."""
    for item in items:
        if isinstance(item, A.Flow):
            yield item
        elif isinstance(item, A.Step):
            yield A.Flow((item,), item.span)
        elif isinstance(item, A.IfBlock):
            yield from iter_flows(item.body + (item.orelse or ()))


def step_names(step: A.Step) -> list[A.Name]:
    """The tensors a step names: `y` or the names of a tuple `(a, b)`."""
    if isinstance(step.expr, A.Name):
        return [step.expr]
    if isinstance(step.expr, A.TupleExpr):
        return [e.value for e in step.expr.items if isinstance(e.value, A.Name)]
    return []


def produced(flow: A.Flow) -> list[A.Name]:
    return step_names(flow.destination) if len(flow.steps) > 1 else []


def consumed(flow: A.Flow) -> list[A.Name]:
    return step_names(flow.source)


def annotations_named(annotations: Iterable[A.Annotation], name: str) -> list[A.Annotation]:
    return [a for a in annotations if a.name == name]


def name_of(node) -> str | None:
    return node.id if isinstance(node, A.Name) else None


# ====================================================================== decisions
def memory_decisions(decl: A.Decl, consumed_by_backward: set[str] | None = None
                     ) -> dict[str, MemoryDecision]:
    """One decision per parameter and per named tensor of the forward graph."""
    flows = list(iter_flows(graph_items(decl)))
    tensors = _graph_tensors(flows)
    params = _params(decl)
    everything = {**params, **tensors}
    candidates: dict[str, list[MemoryDecision]] = {name: [] for name in everything}
    rules = (_memory_annotations(flows, params), _preserved(flows),
             _block_checkpoint(decl, flows, tensors),
             _listed(decl, "save", 4, tensors, params),
             _listed(decl, "recompute", 5, tensors, params),
             _defaults(decl, tensors, params, consumed_by_backward))
    for decisions in rules:
        for decision in decisions:
            if decision.tensor in candidates:
                candidates[decision.tensor].append(decision)
    return {name: _winner(found) for name, found in candidates.items()}


def _winner(found: list[MemoryDecision]) -> MemoryDecision:
    best = min(found, key=lambda d: d.source)  # stable: the first of equal rank wins
    others = tuple(sorted({d.source for d in found if d is not best and d.source != best.source}))
    return MemoryDecision(best.tensor, best.policy, best.source, best.reason, best.span, others)


def _decision(name: A.Name | str, policy: str, source: int, detail: str, span: Span
              ) -> MemoryDecision:
    tensor = name.id if isinstance(name, A.Name) else name
    return MemoryDecision(tensor, policy, source, f"{detail} ({LADDER[source]}, priority "
                                                  f"{source})", span)


def _graph_tensors(flows: list[A.Flow]) -> dict[str, A.Name]:
    """Named tensors in order of first appearance (sources before destinations)."""
    tensors: dict[str, A.Name] = {}
    for flow in flows:
        for name in consumed(flow) + produced(flow):
            tensors.setdefault(name.id, name)
    return tensors


def _params(decl: A.Decl) -> dict[str, A.Entry]:
    params = section(decl.body, "params")
    entries = [i for i in params.body if isinstance(i, A.Entry)] if params else []
    return {expr_text(entry.key): entry for entry in entries}


# ---------------------------------------------------------------- rule 1: @memory
def _memory_annotations(flows, params) -> list[MemoryDecision]:
    found = []
    for name, entry in params.items():
        found += _memory_modes(name, entry.annotations)
    for flow in flows:
        if len(flow.steps) > 1:  # an element's own @memory first: it is the more specific
            destination = flow.destination
            found += _element_memory(destination.expr)
            for tensor in step_names(destination):
                found += _memory_modes(tensor, destination.annotations)
    return found


def _element_memory(node) -> list[MemoryDecision]:
    if not isinstance(node, A.TupleExpr):
        return []
    return [d for e in node.items if isinstance(e.value, A.Name)
            for d in _memory_modes(e.value, e.annotations)]


def _memory_modes(tensor, annotations) -> list[MemoryDecision]:
    found = []
    for note in annotations_named(annotations, MEMORY):
        mode = name_of(argument_values(note).get("mode"))
        if mode in POLICIES:
            found.append(_decision(tensor, mode, 1, f"`@memory({mode})`", note.span))
    return found


# ---------------------------------------------------------------- rules 2 and 3: @checkpoint
def _preserved(flows) -> list[MemoryDecision]:
    found = []
    for flow in flows:
        for note in (n for step in flow.steps for n in annotations_named(step.annotations,
                                                                          CHECKPOINT)):
            kept = _preserve_list(note)
            detail = f"preserved by `@checkpoint(preserve=[{', '.join(kept)}])`"
            found += [_decision(name, "save", 2, detail, note.span) for name in kept]
    return found


def _preserve_list(note: A.Annotation) -> list[str]:
    value = argument_values(note).get("preserve")
    items = value.items if isinstance(value, A.ListExpr) else ()
    return [i.id if isinstance(i, A.Name) else i.value for i in items
            if isinstance(i, (A.Name, A.String))]


def block_checkpoints(decl: A.Decl, name: str = "forward") -> list[A.Annotation]:
    """`@checkpoint` on the header, on a line of its own in the body, the `forward:`
    section or its `graph:`, or after the `forward:` / `graph:` colon."""
    outer = section(decl.body, name)
    graph = section(outer.body, "graph") if outer else None
    notes = list(decl.annotations)
    for holder in (decl.body, outer.body if outer else (), graph.body if graph else ()):
        notes += [a for i in holder if isinstance(i, A.AnnotationLine) for a in i.annotations]
    notes += [a for s in (outer, graph) if s is not None for a in s.annotations]
    return annotations_named(notes, CHECKPOINT)


def _block_checkpoint(decl, flows, tensors) -> list[MemoryDecision]:
    found = []
    made = {n.id for flow in flows for n in produced(flow)}
    for note in block_checkpoints(decl):
        level = name_of(argument_values(note).get("granularity")) or "full"
        keep = set(_preserve_list(note))
        for tensor, node in tensors.items():
            policy, detail = _block_policy(level, tensor in keep, tensor in made)
            if policy:
                found.append(_decision(node, policy, 3, f"`@checkpoint({level})`, {detail}",
                                       note.span))
    return found


def _block_policy(level: str, kept: bool, made: bool) -> tuple[str | None, str]:
    if kept:
        return "save", "listed in `preserve`"
    if level != "full":
        return None, ""
    return ("recompute", "produced inside the region") if made else \
        ("save", "an input of the region")


# ---------------------------------------------------------------- rules 4 and 5: lists
def _listed(decl, key: str, source: int, tensors: dict, params: dict) -> list[MemoryDecision]:
    """A name matches itself (tensor or parameter); a pattern with `*` matches tensors."""
    policy = "save" if key == "save" else "recompute"
    found = []
    for item in _list_items(decl, key):
        pattern = _pattern(item)
        if pattern in params:
            found.append(_decision(pattern, policy, source, f"listed in `{key}:`", item.span))
        for name in (n for n in tensors if pattern and fnmatch.fnmatchcase(n, pattern)):
            detail = f"listed in `{key}:`" if pattern == name else \
                f"matches `{pattern}` in `{key}:`"
            found.append(_decision(name, policy, source, detail, item.span))
    return found


def _list_items(decl, key: str) -> list:
    forward = section(decl.body, "forward")
    holders = (decl.body, forward.body if forward else ())
    entries = [i for h in holders for i in h if isinstance(i, A.Entry) and name_of(i.key) == key]
    return [x for e in entries if isinstance(e.value, A.ListExpr) for x in e.value.items]


def _pattern(node) -> str | None:
    """`x`, `*_rstd`, `*`, `"x"` and `ln*_out` (parsed as the product `ln * _out`)."""
    if isinstance(node, A.Name):
        return node.id
    if isinstance(node, A.String):
        return node.value
    if isinstance(node, A.Star):
        return "*" + (node.suffix or "")
    if isinstance(node, A.Binary) and node.op == "*":
        left, right = _pattern(node.left), _pattern(node.right)
        return f"{left}*{right}" if left is not None and right is not None else None
    return None


# ---------------------------------------------------------------- rule 6: defaults
def _defaults(decl, tensors, params, consumed_by_backward) -> list[MemoryDecision]:
    found = [_decision(name, "pin", 6, "parameters are pinned", entry.key.span)
             for name, entry in params.items()]
    if consumed_by_backward is None:
        needed, how = saved_references(decl), "read as `saved.<name>` by the backward"
    else:
        needed, how = consumed_by_backward, "consumed by the backward"
    for name, node in tensors.items():
        policy, detail = ("save", how) if name in needed else ("temporary", "not " + how)
        found.append(_decision(node, policy, 6, detail, node.span))
    return found


def saved_references(decl: A.Decl) -> set[str]:
    """Names the backward reads as `saved.<name>`."""
    backward = section(decl.body, "backward")
    return {node.attr for node in _walk(backward) if isinstance(node, A.Attribute)
            and name_of(node.value) == "saved"} if backward else set()


def _walk(node) -> Iterator:
    return tree_nodes(node, sequences=(tuple,))


def name_span(note: A.Annotation) -> Span:
    """The annotation's name (the span of an annotation starts after its `@`)."""
    s = note.span
    return Span(s.file, s.start, s.start + len(note.name), s.line, s.column, s.line,
                s.column + len(note.name))


# ====================================================================== E025
def pipeline_problems(decl: A.Decl) -> list[Diagnostic]:
    problems = []
    for graph in GRAPH_SECTIONS:
        flows = list(iter_flows(graph_items(decl, graph)))
        problems += [d for flow in flows for d in _flow_stages(flow, flows)]
        if graph == "forward":  # header annotations belong to the forward pass
            problems += _block_stages(decl, graph, flows)
    return problems


def _stages(steps) -> list[tuple[int, A.Annotation]]:
    """(stage, annotation) of every `@partition` with an integer literal stage."""
    found = []
    for note in (n for s in steps for n in s.annotations if n.name == PIPELINE.stage):
        stage = argument_values(note).get(PIPELINE.stage_param)
        if isinstance(stage, A.Number) and isinstance(stage.value, int):
            found.append((stage.value, note))
    return found


def _regions(annotations) -> list[A.Annotation]:
    return [n for n in annotations if n.name == PIPELINE.region and
            name_of(argument_values(n).get(PIPELINE.switch)) != PIPELINE.off]


def _flow_stages(flow: A.Flow, flows) -> list[Diagnostic]:
    """A checkpointed flow lies in the stages of its operations and destination; a
    destination without its own `@partition` lies in the stage of the flows that read it."""
    regions = _regions(a for step in flow.steps for a in step.annotations)
    if not regions:
        return []
    labelled = [(stage, Label(note.span, f"stage {stage}")) for stage, note in
                _stages(flow.steps[1:])]
    if len(flow.steps) > 1 and not _stages([flow.destination]):
        labelled += _reader_stages(flow, flows)
    return _span_error(regions[0], labelled)


def _reader_stages(flow, flows) -> list[tuple[int, Label]]:
    made = {n.id for n in produced(flow)}
    found = []
    for reader in flows:
        read = made & {n.id for n in consumed(reader)}
        if not read:
            continue
        for stage, note in _stages(reader.steps[1:]):
            found.append((stage, Label(note.span, f"`{sorted(read)[0]}` is read in "
                                                  f"stage {stage} here")))
    return found


def _block_stages(decl, graph, flows) -> list[Diagnostic]:
    regions = _regions(block_checkpoints(decl, graph))
    if not regions:
        return []
    labelled = [(stage, Label(note.span, f"stage {stage}")) for flow in flows
                for stage, note in _stages(flow.steps[1:])]
    return _span_error(regions[0], labelled)


def _span_error(region: A.Annotation, labelled) -> list[Diagnostic]:
    stages = sorted({stage for stage, _ in labelled})
    if len(stages) < 2:
        return []
    firsts = {}
    for stage, label in labelled:
        firsts.setdefault(stage, label)
    listed = ", ".join(map(str, stages[:-1])) + f" and {stages[-1]}"
    return [error(PIPELINE.code, f"`@{region.name}` spans pipeline stages {listed}",
                  name_span(region), "checkpoint region crosses a stage boundary",
                  secondary=list(firsts.values()),
                  notes=["a checkpoint region is recomputed on one device in the backward "
                         "pass, so it must lie within one pipeline stage (spec §7.6.0)"],
                  help=[f"checkpoint each stage separately: put `@{PIPELINE.stage}(...)` and "
                        f"`@{region.name}` on the destination of a flow within one stage"])]
