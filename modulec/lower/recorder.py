"""Recording a checked instance's graph as Graph IR nodes.

The checker's graph walk knows every operation with its typed inputs and outputs; when a
`Recorder` is attached it writes them down: one node per primitive or module call, fresh
value ids for unnamed results (`%3`), and the source names bound to values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
    marked: dict[str, str] = field(default_factory=dict)  # param -> its @gradient value
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
        annotations = tuple(map(_annotation, getattr(step, "annotations", ())))
        index = len(self.nodes)
        self.nodes.append(Node(f"{self.phase[0]}{index}", kind, target, tuple(inputs),
                               tuple(outputs), tuple(attrs), annotations, repeat, self.phase,
                               span, tuple(accumulate)))


    def flow_annotations(self, start: int, destination) -> None:
        """Carry a flow's destination annotations to its nodes: `@fuse`/`@nofuse`/`@kernel`
        written after the destination concern every operation of the flow (spec §7.5), `@hook`
        concerns the node that produces the hooked value (a fusion barrier when it may
        write, §5.11.3), also when the flow only renames that value."""
        wide = tuple(_annotation(a) for a in destination.annotations if a.name in FLOW_WIDE)
        stage = tuple(_annotation(a) for a in destination.annotations if a.name in STAGE_WIDE)
        for index in range(start, len(self.nodes)):
            if wide and self.nodes[index].kind == "op":
                self._annotate(index, wide)
            if stage and not any(n[0] in STAGE_WIDE for n in self.nodes[index].annotations):
                self._annotate(index, stage)
        for name, notes in _hooked_names(destination):
            value = self.names.get(name)
            producer = next((i for i in range(len(self.nodes) - 1, -1, -1)
                             if value and value in self.nodes[i].outputs), None)
            if producer is not None:
                self._annotate(producer, tuple(_on_value(a, name, value) for a in notes))

    def _annotate(self, index: int, notes: tuple) -> None:
        node = self.nodes[index]
        added = tuple(n for n in notes if n not in node.annotations)
        self.nodes[index] = replace(node, annotations=node.annotations + added)


FLOW_WIDE = ("fuse", "nofuse", "kernel")  # `@kernel` after the destination: each op's
# a destination's pipeline stage (spec §7.6.2) goes to every node of its flow, calls too,
# unless a step of the flow names its own (`x -> blocks[0:8]() @partition(0) -> ...`)
STAGE_WIDE = ("partition",)
# annotations of a destination value that go to the node producing it; all but `@hook`
# also record which output they concern (`on=name`, `value=id`) for the runtime (probes,
# trace lines, assertions and profile regions name the value; a node may have several
# outputs); `@adapter` marks an injection point of the `lora` pass (modulec.lower.lora)
VALUE_NOTES = ("hook", "probe", "assert", "trace", "profile", "adapter")


def _hooked_names(destination):
    """(destination name, its value annotations) for a `-> name` or `-> (a, b)` flow."""
    from modulec.syntax import ast as A

    expr = destination.expr
    shared = [a for a in destination.annotations if a.name in VALUE_NOTES]
    if isinstance(expr, A.Name):
        return [(expr.id, shared)] if shared else []
    if isinstance(expr, A.TupleExpr):
        pairs = [(e.value.id, shared + [a for a in e.annotations if a.name in VALUE_NOTES])
                 for e in expr.items if isinstance(e.value, A.Name)]
        return [(name, notes) for name, notes in pairs if notes]
    return []


def _on_value(annotation, name: str, value: str) -> tuple[str, tuple[str, ...]]:
    name_, args = _annotation(annotation)
    if name_ in ("hook", "adapter"):
        return name_, args
    return name_, args + (f"on={name}", f"value={value}")


def _annotation(annotation) -> tuple[str, tuple[str, ...]]:
    return annotation.name, tuple(_arg_text(x) for x in annotation.args or ())


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
