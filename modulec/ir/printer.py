"""The canonical text of Graph IR (`modulec build --emit graph`)."""

from __future__ import annotations

from modulec.ir.graph import STREAM, WAIT, Function, Graph, Node, ValueInfo


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.model}: entry {graph.entry}, backward {graph.backward or '-'}"]
    for function in graph.functions:
        lines += [""] + function_lines(function)
    return "\n".join(lines) + "\n"


def function_lines(function: Function) -> list[str]:
    args = ", ".join(f"{k}={v}" for k, v in function.args)
    head = f"func {function.name}({args})  # {function.scope}"
    lines = [head]
    lines += [f"  param {_value(p)}" for p in function.params]
    lines += [f"  in {_value(i)}" for i in function.inputs]
    lines += [f"  {node_text(n, function)}" for n in function.nodes]
    lines.append(f"  out {', '.join(o or '_' for o in function.outputs)}")
    if function.saved:
        lines.append(f"  saved {', '.join(function.saved)}")
    if function.param_grads:
        lines.append("  grads " + ", ".join(f"{p}: {g}" for p, g in function.param_grads))
    return lines


def node_text(node: Node, function: Function) -> str:
    """`b13: %g19: [B, T, 32] = op tp_copy_backward(%g17, ...) on comm` for an op issued on
    the communication stream; `b13.wait: wait b13(%g19)` for the compute stream's join."""
    if node.kind == WAIT:
        return f"{node.id}: wait {node.target}({', '.join(node.inputs)})"
    outputs = ", ".join(_typed(o, function) for o in node.outputs) or "()"
    arguments = [i or "_" for i in node.inputs] + [f"{k}={_attr(v)}" for k, v in node.attrs
                                                   if k != STREAM]
    repeat = f" x{node.repeat}" if node.repeat != 1 else ""
    notes = "".join(f" @{name}({', '.join(args)})" if args else f" @{name}"
                    for name, args in node.annotations)
    stream = f" on {node.attr(STREAM)}" if node.attr(STREAM) is not None else ""
    return (f"{node.id}: {outputs} = {node.kind} {node.target}({', '.join(arguments)})"
            f"{repeat}{stream}{notes}")


def _typed(value: str, function: Function) -> str:
    info = function.value(value) if value else None
    return f"{value}: {_type(info)}" if info is not None else (value or "_")


def _value(info: ValueInfo) -> str:
    return f"{info.id}: {_type(info)}"


def _type(info: ValueInfo) -> str:
    dtype = [] if info.dtype == "float" else [info.dtype]
    return f"[{', '.join(list(info.shape) + dtype)}]"


def _attr(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_attr, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "None" if value is None else str(value)
