"""The Graph IR verifier: what every pass may assume, checked (`modulec ir verify`).

Each problem is reported with the function and node it is in and the IR text around it,
in the manner of JAX's check_jaxpr: values are defined once before use, callees and
primitives exist, arities fit the primitive signatures, repeat counts are positive, a
backward function reads only values its forward function defines. Then every type is
re-derived with the op table's rules (modulec.ir.verify_types): a flipped matmul mode, an
edited shape or dtype, a missing operand is reported with the op, the value and what the
rules expected.
"""

from __future__ import annotations

import math

from modulec.ir.graph import WAIT, Function, Graph, Node
from modulec.ir.printer import node_text
from modulec.ir.verify_types import graph_assumptions, type_problems
from modulec.ops.registry import op_table


class IRError(Exception):
    pass


def verify_graph(graph: Graph) -> list[str]:
    problems: list[str] = []
    names = [f.name for f in graph.functions]
    if len(set(names)) != len(names):
        problems.append("duplicate function names: " + ", ".join(
            sorted({n for n in names if names.count(n) > 1})))
    functions = {f.name: f for f in graph.functions}
    for required, label in ((graph.entry, "entry"), (graph.backward, "backward")):
        if required and required not in functions:
            problems.append(f"the graph's {label} function `{required}` does not exist")
    problems += [f"`{f.name}` is the gradient of `{f.gradient_of}`, not a function of this "
                 "graph" for f in graph.functions if f.gradient_of and f.gradient_of not in
                 functions]
    problems += call_cycles(functions) or _runs(graph)
    tables: dict = {}  # each function's declared types, shared by its callers and backward
    assumptions = graph_assumptions(graph)
    for function in graph.functions:
        problems += _verify_function(function, functions, tables, assumptions)
    return problems


def call_cycles(functions: dict) -> list[str]:
    """A function that calls itself, directly or through others: a runtime would recurse
    for ever. Depth-first with an explicit stack (no Python recursion on hostile IR)."""
    state: dict = {}  # name -> 1 on the current path, 2 done
    for root in functions:
        if root in state:
            continue
        stack = [(root, iter(_callees(functions[root])))]
        state[root] = 1
        while stack:
            name, callees = stack[-1]
            callee = next(callees, None)
            if callee is None:
                state[name] = 2
                stack.pop()
            elif state.get(callee) == 1:
                path = [n for n, _ in stack][[n for n, _ in stack].index(callee):]
                return [f"`{callee}` calls itself (through {' -> '.join(path + [callee])})"]
            elif callee not in state and callee in functions:
                state[callee] = 1
                stack.append((callee, iter(_callees(functions[callee]))))
    return []


MAX_RUNS = 1_000_000  # function runs of one forward (layers x modules: thousands)


def _runs(graph: Graph) -> list[str]:
    from modulec.ir.verify_schedule import instance_counts

    total = sum(instance_counts(graph).values())
    return [f"the graph runs {total} function instances, more than the limit {MAX_RUNS}"] \
        if total > MAX_RUNS else []


def _callees(function: Function) -> list[str]:
    return [n.target for n in function.nodes if n.kind == "call"]


def _verify_function(function: Function, functions: dict, tables: dict,
                     assumptions) -> list[str]:
    found: list[tuple[int | None, str]] = []  # (node index or None, message)
    forward = functions.get(function.gradient_of) if function.gradient_of else None
    defined = {v.id for v in function.params + function.inputs}
    outside = {v.id for v in forward.values + forward.inputs} if forward else set()
    ids: set = set()
    for index, node in enumerate(function.nodes):
        found += [(index, m) for m in _node_problems(node, defined, outside, functions)]
        if node.id in ids:
            found.append((index, f"node id {node.id} is used twice"))
        ids.add(node.id)
        for output in node.outputs:
            if output and output in defined:
                found.append((index, f"`{output}` is defined twice"))
            defined.add(output)
    found += [(None, f"output `{output}` is never defined") for output in function.outputs
              if output and output not in defined]
    if not found:
        from modulec.ir.verify_async import async_problems

        found = async_problems(function)
    if not found:  # types are re-derived on a sound structure only
        found = type_problems(function, functions, tables, assumptions)
    return [_report(function, index, message, shown < LOCATED)
            for shown, (index, message) in enumerate(found)]


LOCATED = 20  # reports of a function that print the IR around them (each prints 5 lines)


def _report(function: Function, index: int | None, message: str, located: bool) -> str:
    if index is None:
        return f"in `{function.name}`: {message}"
    if located:
        return _located(function, index, message)
    return f"in `{function.name}`, node {function.nodes[index].id}: {message}"


def _node_problems(node: Node, defined: set, outside: set, functions: dict) -> list[str]:
    problems = [f"input `{i}` is used before it is defined" for i in node.inputs
                if i and i not in defined and i not in outside and not i.startswith("param:")]
    if not isinstance(node.repeat, int) or isinstance(node.repeat, bool) or node.repeat < 1:
        problems.append(f"repeat must be a positive integer, not {node.repeat!r}")
    problems += _node_notes(node)
    if node.kind == "call" and node.target not in functions:
        problems.append(f"calls `{node.target}`, which is not a function of this graph")
    elif node.kind == "op":
        problems += _op_problems(node)
    elif node.kind == WAIT:
        problems += [] if isinstance(node.target, str) and node.target else [
            "a wait names the op it waits for"]
    elif node.kind not in ("op", "call"):
        problems.append(f"unknown node kind `{node.kind}`")
    return problems


def _node_notes(node: Node) -> list[str]:
    """Its source span (printed in runtime errors) and annotations (read by the runtime)."""
    from modulec.check.annotation_table import ANNOTATIONS

    span = node.span
    problems = [] if len(span) == 3 and isinstance(span[0], str) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in span[1:]) \
        else [f"`span` must be [file, line, column], not {list(span)!r:.80}"]
    problems += [f"unknown annotation `@{name}`" for name, _ in node.annotations
                 if name not in ANNOTATIONS]
    return problems


def _op_problems(node: Node) -> list[str]:
    backward = node.target.endswith("_backward")
    name = node.target[:-9] if backward else node.target
    rule = op_table().get(name)
    if rule is None:
        return [f"`{node.target}` is not a primitive"]
    phase = rule.definition.backward if backward else rule.definition.forward
    if phase is None:
        return [f"`{name}` has no {'backward' if backward else 'forward'}"]
    problems = [f"attribute `{k}` is {v}: attributes must be finite numbers"
                for k, v in node.attrs if isinstance(v, float) and not math.isfinite(v)]
    if len(node.inputs) > len(phase.inputs) and not _variadic(phase.inputs):
        problems.append(f"`{node.target}` takes {len(phase.inputs)} inputs, node has "
                        f"{len(node.inputs)}")
    if len(node.outputs) != len(phase.outputs) and not _variadic(phase.outputs):
        problems.append(f"`{node.target}` returns {len(phase.outputs)} values, node binds "
                        f"{len(node.outputs)}")
    return problems


def _variadic(signature) -> bool:
    """`parts: [n] x [*]` (split's outputs, concat's inputs): any number of tensors."""
    from modulec.syntax import ast as A

    return any(isinstance(s.type, A.ArrayType) for s in signature)


def _located(function: Function, index: int, message: str) -> str:
    lines = [f"in `{function.name}`, node {function.nodes[index].id}: {message}"]
    for around in range(max(0, index - 2), min(len(function.nodes), index + 3)):
        marker = ">" if around == index else " "
        lines.append(f"  {marker} {node_text(function.nodes[around], function)}")
    return "\n".join(lines)
