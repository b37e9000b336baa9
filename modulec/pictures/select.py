"""Which functions a picture shows: a forward function and its derived backward."""

from __future__ import annotations

import re
from dataclasses import dataclass

from modulec.ir.graph import Function, Graph
from modulec.pictures import PictureError

PHASES = ("both", "forward", "backward")


@dataclass(frozen=True)
class Selection:
    forward: Function | None
    backward: Function | None

    @property
    def functions(self) -> tuple[Function, ...]:
        return tuple(f for f in (self.forward, self.backward) if f is not None)

    @property
    def title(self) -> str:
        main = self.forward or self.backward
        return f"{main.name} ({main.scope})" if main.scope != main.name.split("#")[0] \
            else main.name


def select(graph: Graph, scope: str | None = None, phase: str | None = None) -> Selection:
    """`scope`: a function's name (`CausalSelfAttention#1`, `MLP#1.backward`), the scope
    where it first appears (`blocks[*].attention`; `blocks[3]` reads as `blocks[*]`), or its
    module's name when one function has it. None: the model's entry function.
    `phase`: both (default), forward or backward; naming a backward function by its name
    shows the backward alone unless a phase says otherwise."""
    if phase is not None and phase not in PHASES:
        raise PictureError(f"unknown phase `{phase}` (phases: {', '.join(PHASES)})")
    if scope is None:
        function = graph.function(graph.entry)
    else:
        function = _find(graph, scope)
        if phase is None and function.gradient_of:
            phase = "backward"
    phase = phase or "both"
    forward = graph.function(function.gradient_of) if function.gradient_of else function
    backward = next((f for f in graph.functions if f.gradient_of == forward.name), None)
    return Selection(forward if phase != "backward" else None,
                     backward if phase != "forward" else None)


def _find(graph: Graph, scope: str) -> Function:
    by_name = [f for f in graph.functions if f.name == scope]
    if by_name:
        return by_name[0]
    wanted = re.sub(r"\[\d+\]", "[*]", scope.strip())
    forwards = [f for f in graph.functions if not f.gradient_of]
    for key in (lambda f: f.scope, lambda f: f.module):
        found = [f for f in forwards if key(f) == wanted]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise PictureError(f"`{scope}` names several functions: "
                               + ", ".join(f.name for f in found) + "; name one of them")
    known = ", ".join(f"{f.name} ({f.scope})" for f in forwards)
    raise PictureError(f"no function `{scope}` in {graph.model} (functions: {known}; a "
                       "backward is `NAME.backward`)")
