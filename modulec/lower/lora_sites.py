"""Where the `lora` pass adapts: each `@adapter(lora)` resolved to the matmul it adapts, the
weight's parts (fused projections) and the annotation's rank / alpha / targets.

An annotation on a matmul `x @ W^T` (NT, W a parameter) adapts it; on `add(matmul, bias)`
the matmul; on a module call, the matmul that produces the callee's (single) output,
through nested calls; under tensor parallel, the row-parallel matmul whose partial sum a
`tp_all_reduce` (`sp_reduce_scatter` with `--sp`) reduces. Anything else is E008 at the
annotation.
"""

from __future__ import annotations

import re

from modulec.diagnostics import error
from modulec.ir.graph import Function, Graph, Node
from modulec.lower.lora import DEFAULT_ALPHA, DEFAULT_RANK, Part, Site


def find_sites(graph: Graph, context) -> list[Site]:
    functions = {f.name: f for f in graph.functions}
    sites: dict = {}
    for function in graph.functions:
        if function.gradient_of:
            continue
        for node in function.nodes:
            for name, args in node.annotations:
                if name == "adapter" and args and args[0] == "lora":
                    site = _site(graph, functions, function, node, args, context)
                    if site is not None:
                        sites.setdefault((site.function, site.node), site)
    return list(sites.values())


def _site(graph, functions, function: Function, node: Node, args, context) -> Site | None:
    settings = _settings(args, function, node, context)
    found = _matmul_of(functions, function, node, 0)
    if isinstance(found, str):
        context.diagnostics.append(error(
            "E008", f"`@adapter(lora)` is on {found}, not on a matmul `x @ W^T` with a "
            "weight parameter", context.annotation_span(node.span, "adapter"),
            "no weight to adapt here",
            help=["put it on the flow whose output is `matmul(weight, transpose=NT)` (or a "
                  "module call whose output is one)"]))
        return None
    if settings is None:
        return None
    owner, matmul = found
    rank, alpha, targets, dropout = settings
    prefix = "" if owner.name == graph.entry else owner.scope
    parts = _parts(owner, matmul, prefix, targets, context)
    return Site(owner.name, matmul.id, matmul.inputs[1], parts, rank, alpha, targets, prefix,
                dropout=dropout)


# ====================================================================== the adapted matmul
# what ends a tensor-parallel region (`--tp`, `--tp --sp`): the row-parallel matmul before
# it is the adapted one, its delta added to the rank's partial sum (modulec/lower/lora_tp.py)
REDUCTIONS = ("tp_all_reduce", "sp_reduce_scatter")


def _matmul_of(functions: dict, function: Function, node: Node, depth: int):
    """(function, matmul node) the annotation adapts, or a description of what it is on."""
    if node.kind == "call" and node.target in functions and depth < 16:
        callee = functions[node.target]
        if len(callee.outputs) != 1:
            return f"a call of `{callee.module}`, which has {len(callee.outputs)} outputs"
        producer = _producer(callee, callee.outputs[0])
        if producer is None:
            return f"a call of `{callee.module}`, whose output is one of its inputs"
        found = _matmul_of(functions, callee, producer, depth + 1)
        return found if not isinstance(found, str) else \
            f"a call of `{callee.module}`, whose output comes from {found}"
    if node.kind == "op" and node.target == "add":
        params = [i for i in node.inputs if i.startswith("param:")]
        other = [_producer(function, i) for i in node.inputs if not i.startswith("param:")]
        linear = _linear(function, other[0]) if len(other) == 1 else None
        if len(params) == 1 and linear is not None:
            return function, linear
    linear = _linear(function, node)
    if linear is not None:
        return function, linear
    return f"`{node.target}`"


def _linear(function: Function, node: Node | None) -> Node | None:
    """The matmul `x @ W^T` that `node` is, or whose partial sum it reduces (the end of a
    tensor-parallel region: the row-parallel matmul's output summed over the ranks)."""
    if node is not None and node.kind == "op" and node.target in REDUCTIONS and \
            len(node.inputs) == 1:
        node = _producer(function, node.inputs[0])
    return node if node is not None and _is_linear(node) else None


def _is_linear(node: Node) -> bool:
    return node.kind == "op" and node.target == "matmul" and len(node.inputs) >= 2 and \
        node.attr("transpose") == "NT" and node.inputs[1].startswith("param:") and \
        not node.attr("accumulate")


def _producer(function: Function, value: str) -> Node | None:
    return next((n for n in function.nodes if value in n.outputs), None)


# ====================================================================== rank, alpha, targets
def _settings(args, function: Function, node: Node, context):
    """(rank, alpha, targets, dropout) of `@adapter(lora, rank=..., alpha=..., targets=[...],
    dropout=...)`; names are the enclosing instance's parameters (`rank=lora_rank`)."""
    values = {"rank": str(DEFAULT_RANK), "alpha": str(DEFAULT_ALPHA), "targets": "[]",
              "dropout": "0.0"}
    for arg in args[1:]:
        key, sep, value = arg.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    env = dict(function.args)
    try:
        rank = int(_number(values["rank"], env))
        alpha = float(_number(values["alpha"], env))
        dropout = float(_number(values["dropout"], env))
    except ValueError as exc:
        context.diagnostics.append(error(
            "E008", f"`@adapter(lora)`: {exc}", context.annotation_span(node.span, "adapter"),
            "not a compile-time number", help=["give rank, alpha and dropout as numbers or "
                                               "as parameters of the enclosing declaration"]))
        return None
    if not 0 <= dropout < 1:
        context.diagnostics.append(error(
            "E008", f"`@adapter(lora)`: dropout is a probability below 1, not {dropout}",
            context.annotation_span(node.span, "adapter"), "not a probability"))
        return None
    targets = tuple(t.strip() for t in values["targets"].strip("[]").split(",") if t.strip())
    return rank, alpha, targets, dropout


def _number(text: str, env: dict) -> float:
    text = env.get(text, text)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"cannot evaluate `{text}`") from None


# ====================================================================== parts of a fused weight
def _parts(function: Function, matmul: Node, prefix: str, targets, context) -> tuple:
    weight = matmul.inputs[1][len("param:"):]
    rows_text = function.value(matmul.inputs[1]).shape[0]
    hf = _hf_modules(getattr(context, "weight_schema", ()) or (),
                     f"{prefix}.{weight}" if prefix else weight)
    sizes = _split_sizes(function, matmul.outputs[0])
    if sizes and not rows_text.isdigit() or sizes and sum(sizes) != int(rows_text):
        sizes = None
    if len(hf) > 1 and sizes and len(sizes) == len(hf):
        return _sized([_short(m) for m, _ in hf], sizes, hf)
    if len(hf) == 1:
        module, placeholders = hf[0]
        return (Part(_short(module), 0, _rows(rows_text), module, placeholders),)
    if len(targets) > 1 and sizes and len(sizes) == len(targets):
        return _sized(list(targets), sizes, [("", ())] * len(sizes))
    return (Part(re.sub(r"_?weight$", "", weight.rsplit(".", 1)[-1]) or weight, 0,
                 _rows(rows_text)),)


def _sized(names: list, sizes: list, hf: list) -> tuple:
    parts, start = [], 0
    for name, rows, (module, placeholders) in zip(names, sizes, hf):
        parts.append(Part(name, start, rows, module, placeholders))
        start += rows
    return tuple(parts)


def _rows(text: str):
    return int(text) if text.isdigit() else text


def _short(module: str) -> str:
    """`model.layers.{i}.self_attn.q_proj` -> `q` (PEFT's target_modules name: q_proj)."""
    last = module.rsplit(".", 1)[-1]
    return last[:-len("_proj")] if last.endswith("_proj") else last


def _hf_modules(schema, path: str) -> list:
    """The HF modules (`...q_proj`, with the stack placeholders) a weight's rows come from,
    in order; none for a weight mapped through a transform or fused along another dim."""
    for entry in schema:
        if re.sub(r"\[\{\w+\}\]", "[*]", entry.get("param", "")) != path:
            continue
        fused = entry.get("kind") == "fuse" and entry.get("dim") == 0
        if entry.get("fn") or not (entry.get("kind") == "direct" or fused):
            return []
        names = entry.get("hf") or []
        if not all(n.endswith(".weight") for n in names):
            return []
        placeholders = tuple(s["placeholder"] for s in entry.get("stacks") or ())
        return [(n[:-len(".weight")], placeholders) for n in names]
    return []


def _split_sizes(function: Function, value: str, depth: int = 0) -> list | None:
    """Rows of the parts a projection's output [..., N] is split into downstream: a split
    of its last dim, or of the head dim of a view [..., heads, d] (through a bias add)."""
    shape = function.value(value).shape
    for node in (n for n in function.nodes if value in n.inputs):
        if node.target == "add" and depth < 4 and any(i.startswith("param:")
                                                      for i in node.inputs):
            return _split_sizes(function, node.outputs[0], depth + 1)
        if node.target == "split" and node.attr("dim") in (-1, len(shape) - 1):
            return _ints(node.attr("sizes"), 1)
        if node.target == "view":
            viewed = function.value(node.outputs[0]).shape
            if tuple(viewed[:-2]) == tuple(shape[:-1]) and viewed[-1].isdigit():
                for split in (n for n in function.nodes if node.outputs[0] in n.inputs):
                    if split.target == "split" and split.attr("dim") in (-2, len(viewed) - 2):
                        return _ints(split.attr("sizes"), int(viewed[-1]))
    return None


def _ints(sizes, factor: int) -> list | None:
    if not sizes or not all(isinstance(s, int) for s in sizes):
        return None
    return [s * factor for s in sizes]
