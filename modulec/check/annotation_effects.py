"""W006: an annotation, or one of its arguments, that has no effect on a backend yet.

Driven by each annotation's `status` (modulec.check.annotation_status): the warning names
the backends the status says it does not act on, at the annotation (or at the argument
whose part does not act). Nothing here knows an annotation by name.
"""

from __future__ import annotations

from modulec.check.annotation_status import BACKENDS, Effect, Part
from modulec.check.memory_policy import name_span
from modulec.diagnostics import Diagnostic, warning
from modulec.syntax import ast as A

CODE = "W006"
HELP = "remove it, or keep it for when it acts: docs/annotations.md lists what every " \
       "annotation does on each backend"


def without_effect(spec, bound: dict, placement: str, note: A.Annotation,
                   in_flow: bool = False, rank: int | None = None) -> list[Diagnostic]:
    """W006s for a valid annotation `note` (`spec`, its given arguments `bound`, written on
    `placement`, in a flow or not; on a parameter of `rank` dims): the whole first, then
    each part that applies on backends the whole already acts on."""
    status = spec.status
    whole = status.effect.missing()
    found = [_warning(f"`@{spec.name}`", whole, status.effect, name_span(note))] \
        if whole else []
    for part in status.parts:
        missing = tuple(b for b in part.effect.missing() if b not in whole)
        if missing and _applies(part, bound, placement, in_flow, rank):
            span = bound[part.param].span if part.param else name_span(note)
            found.append(_warning(part.describe(spec.name), missing, part.effect, span))
    return found


def _applies(part: Part, bound: dict, placement: str, in_flow: bool,
             rank: int | None = None) -> bool:
    if part.min_rank is not None and (rank is None or rank < part.min_rank):
        return False
    if part.placement is not None:
        return placement == part.placement and part.in_flow in (None, in_flow)
    arg = bound.get(part.param)
    if part.when is not None:
        other = bound.get(part.when[0])
        if other is None or _text(other.value) != part.when[1]:
            return False
    return arg is not None and (part.value is None or _text(arg.value) == part.value)


def _text(node) -> str | None:
    if isinstance(node, A.Name):
        return node.id
    return node.value if isinstance(node, A.String) else None


def backends_text(backends) -> str:
    """("cpu", "gpu") -> "the CPU reference or GPU backend"."""
    names = [BACKENDS[b] for b in backends]
    return "the " + " or ".join(names) + " backend"


def _warning(what: str, missing, effect: Effect, span) -> Diagnostic:
    notes = [effect.note] if effect.note else []
    refused = [b for b in missing if b in effect.refused()]
    if refused:  # the backend refuses the program when it loads, never ignores it
        return warning(CODE, f"{what} has no effect on {backends_text(missing)} yet: "
                       f"{backends_text(refused)} refuses it when it loads", span,
                       "refused on " + " and ".join(BACKENDS[b] for b in refused),
                       notes=notes, help=[HELP])
    return warning(CODE, f"{what} has no effect on {backends_text(missing)} yet", span,
                   "no effect yet", notes=notes, help=[HELP])

