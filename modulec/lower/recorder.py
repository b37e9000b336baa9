"""Recording a checked instance's graph as Graph IR nodes.

The checker's graph walk knows every operation with its typed inputs and outputs; when a
`Recorder` is attached it writes them down: one node per primitive or module call, fresh
value ids for unnamed results (`%3`), and the source names bound to values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.ir.graph import Node, ValueInfo
from modulec.semantic.consteval import Ident, Unknown
from modulec.types.dims import Dim
from modulec.types.tensor import TensorType


@dataclass
class Recorder:
    function: str
    scope: str
    nodes: list[Node] = field(default_factory=list)
    values: dict[str, ValueInfo] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # source name -> value id
    phase: str = "forward"
    _counter: int = 0

    def fresh(self, type_: TensorType) -> str:
        self._counter += 1
        # a backward reads forward values by their ids: its own ids must not collide
        value = f"%{'b' if self.phase == 'backward' else ''}{self._counter}"
        self.values[value] = value_info(value, type_)
        return value

    def declare(self, value: str, type_: TensorType, name: str = "") -> None:
        self.values.setdefault(value, value_info(value, type_, name))

    def bind(self, name: str, value: str, accumulate: bool = False) -> None:
        """Name `value`; a gradient written again with accumulate=true (`-> d_w` twice)
        names the sum of its writes, recorded as an `add` node."""
        if name == "_":
            return
        previous = self.names.get(name)
        if accumulate and previous is not None and previous != value:
            self.names[name] = self._sum(previous, value)
        else:
            self.names.setdefault(name, value)
        info = self.values.get(value)
        if info is not None and not info.name:
            self.values[value] = ValueInfo(info.id, info.shape, info.dtype, name)

    def _sum(self, previous: str, value: str) -> str:
        self._counter += 1
        total = f"%{'b' if self.phase == 'backward' else ''}{self._counter}"
        info = self.values[value]
        self.values[total] = ValueInfo(total, info.shape, info.dtype, info.name)
        span = self.nodes[-1].span if self.nodes else ("", 0, 0)
        self.nodes.append(Node(f"{self.phase[0]}{len(self.nodes)}", "op", "add",
                               (previous, value), (total,), (), (), 1, self.phase, span,
                               (total,)))
        return total

    def node(self, kind: str, target: str, inputs, outputs, step, attrs=(), repeat=1,
             accumulate=()) -> None:
        span = (step.span.file, step.span.line, step.span.column)
        annotations = tuple((a.name, tuple(_arg_text(x) for x in a.args or ()))
                            for a in getattr(step, "annotations", ()))
        index = len(self.nodes)
        self.nodes.append(Node(f"{self.phase[0]}{index}", kind, target, tuple(inputs),
                               tuple(outputs), tuple(attrs), annotations, repeat, self.phase,
                               span, tuple(accumulate)))


def value_info(value: str, type_: TensorType, name: str = "") -> ValueInfo:
    dims = ("*",) if type_.variadic else tuple(str(d) for d in type_.dims)
    return ValueInfo(value, dims, type_.dtype, name)


def attr_value(value):
    """A parameter value as plain data (JSON-ready and canonical)."""
    if isinstance(value, Dim):
        return value.value if value.is_const else str(value)
    if isinstance(value, Ident):
        return value.name
    if isinstance(value, Unknown):
        return f"<{value.kind}>"
    if isinstance(value, tuple):
        return [attr_value(v) for v in value]
    return value


def _arg_text(arg) -> str:
    from modulec.syntax.printer import arg_text

    return arg_text(arg)
