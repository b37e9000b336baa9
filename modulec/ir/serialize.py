"""Graph IR <-> plain JSON data. Deterministic: identical graphs give identical bytes."""

from __future__ import annotations

import json

from modulec.ir.graph import Function, Graph, Node, ValueInfo

IR_VERSION = 1


def graph_to_data(graph: Graph) -> dict:
    return {"model": graph.model, "entry": graph.entry, "backward": graph.backward,
            "functions": [_function(f) for f in graph.functions]}


def _function(f: Function) -> dict:
    return {
        "name": f.name, "module": f.module, "scope": f.scope, "args": dict(f.args),
        "params": [_value(v) for v in f.params], "inputs": [_value(v) for v in f.inputs],
        "outputs": list(f.outputs), "values": [_value(v) for v in f.values],
        "nodes": [_node(n) for n in f.nodes], "saved": list(f.saved),
        "gradient_of": f.gradient_of, "param_grads": dict(f.param_grads),
        "no_gradient": list(f.no_gradient),
    }


def _value(v: ValueInfo) -> dict:
    return {"id": v.id, "shape": list(v.shape), "dtype": v.dtype, "name": v.name}


def _node(n: Node) -> dict:
    return {"id": n.id, "kind": n.kind, "target": n.target, "inputs": list(n.inputs),
            "outputs": list(n.outputs), "attrs": dict(n.attrs),
            "annotations": [[name, list(args)] for name, args in n.annotations],
            "repeat": n.repeat, "phase": n.phase, "span": list(n.span),
            "accumulate": list(n.accumulate)}


def graph_from_data(data: dict) -> Graph:
    """The inverse of graph_to_data; raises KeyError/TypeError/ValueError on malformed data
    (`modulec ir verify` turns those into readable reports)."""
    return Graph(data["model"], data["entry"], data["backward"],
                 tuple(_function_back(f) for f in data["functions"]))


def _function_back(f: dict) -> Function:
    return Function(f["name"], f["module"], f["scope"], tuple(f["args"].items()),
                    tuple(map(_value_back, f["params"])), tuple(map(_value_back, f["inputs"])),
                    tuple(f["outputs"]), tuple(map(_value_back, f["values"])),
                    tuple(map(_node_back, f["nodes"])), tuple(f["saved"]), f["gradient_of"],
                    tuple(f["param_grads"].items()), tuple(f.get("no_gradient", ())))


def _value_back(v: dict) -> ValueInfo:
    return ValueInfo(str(v["id"]), tuple(map(str, v["shape"])), str(v["dtype"]), str(v["name"]))


def _node_back(n: dict) -> Node:
    return Node(str(n["id"]), str(n["kind"]), str(n["target"]), tuple(n["inputs"]),
                tuple(n["outputs"]), tuple(n["attrs"].items()),
                tuple((a[0], tuple(a[1])) for a in n["annotations"]), n["repeat"],
                str(n["phase"]), tuple(n["span"]), tuple(n.get("accumulate", ())))


def dumps(document: dict) -> str:
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
