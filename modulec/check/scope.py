"""Tensors in a graph: the values a scope holds and the SSA rule (§5.11.1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.diagnostics import Label
from modulec.source import Span
from modulec.types.tensor import TensorType


@dataclass(frozen=True)
class Tensor:
    name: str
    type: TensorType
    span: Span
    kind: str = "local"  # "input" | "param" | "local" | "saved" | "gradient"
    accumulated: bool = False  # written with accumulate=true (may be written again)
    value: str = ""  # its Graph IR value id, when the graph is being recorded


@dataclass
class GraphScope:
    """Names of one graph (or of one branch of an `if`, with the graph as parent)."""

    parent: "GraphScope | None" = None
    names: dict[str, Tensor] = field(default_factory=dict)

    def lookup(self, name: str) -> Tensor | None:
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def visible(self) -> list[str]:
        names, scope = [], self
        while scope is not None:
            names += list(scope.names)
            scope = scope.parent
        return names

    def define(self, tensor: Tensor, world) -> None:
        previous = self.lookup(tensor.name)
        if previous is not None and not _may_rewrite(previous, tensor):
            world.error("E017", f"tensor `{tensor.name}` is already defined",
                        tensor.span, "defined again here",
                        secondary=[Label(previous.span, "first defined here")],
                        help=[_ssa_help(tensor)])
            return
        self.names[tensor.name] = tensor


def _may_rewrite(previous: Tensor, tensor: Tensor) -> bool:
    """Gradient buffers accumulate: `d_w` may be written again with accumulate=true; a
    "pending" placeholder (a name inside a reported cycle) is replaced silently."""
    return previous.kind == "pending" or previous.kind == "gradient" and tensor.accumulated


def _ssa_help(tensor: Tensor) -> str:
    if tensor.name.startswith("d_"):
        return ("a gradient buffer may be written several times only with "
                "`accumulate=true` (e.g. `matmul(transpose=TN, accumulate=true)`)")
    return "each tensor is assigned once in a graph (SSA); give the new value another name"
