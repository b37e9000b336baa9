"""`@partition(stage)` (spec §7.6.2): the stages of a forward graph must form a pipeline.

Stages are numbered 0, 1, 2, ... without gaps, and each is a contiguous range of the
forward graph: in source order, a flow (or a step of one) never goes back to an earlier
stage than one already seen. Only integer literals are checked here; a stage given by a
name is checked when the pipeline is built (modulec.plan.pipeline). Checkpoint regions
that cross stages are E025 (memory_policy.pipeline_problems). Both are E008 (an
invalid annotation), with the line of the offending `@partition`.
"""

from __future__ import annotations

from modulec.check.annotation_table import PIPELINE, argument_values
from modulec.check.memory_policy import graph_items, iter_flows, name_span
from modulec.diagnostics import Diagnostic, Label, error
from modulec.syntax import ast as A

NOTE = ("a pipeline stage is a contiguous range of the forward graph, and stages are "
        "numbered 0, 1, 2, ... (spec §7.6.2)")


def partition_problems(decl: A.Decl) -> list[Diagnostic]:
    found = list(_stage_notes(decl))
    stages = [(stage, note) for stage, note in found if stage is not None and stage >= 0]
    problems = [_negative(note) for stage, note in found if stage is not None and stage < 0]
    named = any(stage is None for stage, _ in found)  # its number is known when built
    return problems + _order(stages) + ([] if named else _gaps(stages))


def _stage_notes(decl: A.Decl):
    """(stage, annotation) of each `@partition` of the forward graph, in source order (a
    flow's steps, then its destination); the stage is None where it is not a literal."""
    for flow in iter_flows(graph_items(decl, "forward")):
        for step in flow.steps[1:]:
            for note in (n for n in step.annotations if n.name == PIPELINE.stage):
                yield _literal(argument_values(note).get(PIPELINE.stage_param)), note


def _literal(value) -> int | None:
    if isinstance(value, A.Number) and isinstance(value.value, int):
        return value.value
    if isinstance(value, A.Unary) and value.op == "-" and isinstance(value.operand, A.Number) \
            and isinstance(value.operand.value, int):
        return -value.operand.value
    return None


def _negative(note: A.Annotation) -> Diagnostic:
    return error("E008", "a pipeline stage is numbered from 0", name_span(note),
                 "negative stage", notes=[NOTE])


def _order(stages) -> list[Diagnostic]:
    """A stage after a later one: the stage would be split in two ranges."""
    problems, latest = [], None
    for stage, note in stages:
        if latest is not None and stage < latest[0]:
            problems.append(error(
                "E008", f"stage {stage} comes after stage {latest[0]}: stage {stage} would "
                "not be one contiguous range", name_span(note), f"back to stage {stage}",
                secondary=[Label(name_span(latest[1]), f"stage {latest[0]} starts here")],
                notes=[NOTE], help=["move this flow next to the other flows of its stage, "
                                    "or give it a stage of its own"]))
        elif latest is None or stage > latest[0]:
            latest = (stage, note)
    return problems


def _gaps(stages) -> list[Diagnostic]:
    used = {stage for stage, _ in stages}
    missing = [k for k in range(max(used, default=-1) + 1) if k not in used]
    if not missing:
        return []
    stage, note = next((s, n) for s, n in stages if s > missing[0])
    listed = ", ".join(map(str, missing))
    return [error("E008", f"`@{PIPELINE.stage}({stage})` but no operation is in stage "
                  f"{listed}", name_span(note), f"stage {stage} follows a missing stage",
                  notes=[NOTE], help=[f"renumber the stages from 0 without gaps"])]
