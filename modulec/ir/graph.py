"""Graph IR (spec §9.7.1): the typed DAG of an instantiated model, forward and backward.

Hierarchical: each distinct module instance is one `Function` (its parameters, inputs,
outputs, and nodes in topological order); a node applies a primitive or calls another
function, `repeat` times in a row for `StackedBlocks` (an 80-layer model holds one block
function called 80 times). Values are function-local ids (`x`, `%3`); parameters are
`param:<name>`. Everything is an immutable value with a canonical printer and a verifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class ValueInfo:
    id: str
    shape: tuple[str, ...]  # dims as canonical text ("4096", "B", "2*d_ff")
    dtype: str
    name: str = ""  # the source name it was bound to, if any


@dataclass(frozen=True)
class Node:
    id: str
    kind: str  # "op" (a primitive) | "call" (a function) | "alias" | "wait" (WAIT)
    target: str  # primitive name, or callee function name
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    annotations: tuple[tuple[str, tuple], ...] = ()
    repeat: int | str = 1
    phase: str = "forward"  # "forward" | "backward" | "recompute"
    span: tuple[str, int, int] = ("", 0, 0)
    accumulate: tuple[str, ...] = ()  # outputs added into an existing gradient value

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)


# An op with attr STREAM = COMM runs on the communication stream, asynchronously: it starts
# once what the compute stream issued before it is done, and the compute stream goes on.
# A node of kind WAIT (target: that op's id, inputs: its outputs, no outputs) is where the
# compute stream joins it; every reader of the op's outputs comes after the wait, and the
# op's inputs and outputs keep their bytes until the wait (modulec.lower.tp_overlap).
STREAM, COMM, WAIT = "stream", "comm", "wait"
# The Schedule IR's stream numbers: compute, the swaps' copies, the collectives.
COMPUTE_STREAM, COPY_STREAM, COMM_STREAM = 0, 1, 2


def is_async(node: "Node") -> bool:
    """An op issued on the communication stream (joined by a WAIT node)."""
    return node.kind == "op" and node.attr(STREAM) is not None


def async_reads(function: "Function") -> dict[str, tuple[str, ...]]:
    """{wait node id: the values its async op reads and writes}: in use until the wait."""
    issued = {n.id: n for n in function.nodes if is_async(n)}
    return {n.id: tuple(v for v in issued[n.target].inputs + issued[n.target].outputs if v)
            for n in function.nodes if n.kind == WAIT and n.target in issued}


@dataclass(frozen=True)
class Function:
    name: str  # unique: `DenseTransformerBlock#1`
    module: str  # the declaration's name
    scope: str  # where it first appears: `blocks[*].attention`
    args: tuple[tuple[str, str], ...]  # parameter values of the instance, as text
    params: tuple[ValueInfo, ...]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[str, ...]  # value ids
    values: tuple[ValueInfo, ...]
    nodes: tuple[Node, ...]
    saved: tuple[str, ...] = ()  # forward values the backward reads
    gradient_of: str = ""  # for a backward function: its forward function
    param_grads: tuple[tuple[str, str], ...] = ()  # (param, gradient value) of a backward
    no_gradient: tuple[str, ...] = ()  # frozen params, @gradient(skip) inputs: pruned

    def value(self, value_id: str) -> ValueInfo | None:
        return self._values_by_id.get(value_id)

    @cached_property
    def _values_by_id(self) -> dict[str, ValueInfo]:
        """Every value, parameter and input by id, the first of a repeated id winning (a
        lookup per op was a scan: quadratic in a long function)."""
        found: dict[str, ValueInfo] = {}
        for v in self.values + self.params + self.inputs:
            found.setdefault(v.id, v)
        return found


@dataclass(frozen=True)
class Graph:
    model: str
    entry: str  # forward function of the model
    backward: str  # its backward function ("" when not derived)
    functions: tuple[Function, ...] = field(default_factory=tuple)

    def function(self, name: str) -> Function:
        for function in self.functions:
            if function.name == name:
                return function
        raise KeyError(name)


def function_runs(graph: Graph, function: Function, prefix: str = ""):
    """(function, its parameter path prefix) for `function` and every run of what it
    calls, in call order: a repeated call's layers as `blocks[3]` (from the call's
    `instance` and `first`; IR without them: the callee's scope)."""
    yield function, prefix
    for node in function.nodes:
        if node.kind != "call":
            continue
        callee = graph.function(node.target)
        name, first = node.attr("instance"), node.attr("first")
        for layer in range(int(node.repeat)):
            if name is None:
                yield from function_runs(graph, callee,
                                         callee.scope.replace("[*]", f"[{layer}]"))
                continue
            inner = name if first is None else f"{name}[{int(first) + layer}]"
            yield from function_runs(graph, callee, f"{prefix}.{inner}" if prefix else inner)
