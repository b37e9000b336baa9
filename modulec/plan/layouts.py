"""Memory order of values, where an op makes its output in another order than its logical
one, so that a `contiguous` of a value already laid out contiguously is known to be a view
(no copy, no bytes of its own) by the memory plan and the budget planner alike.

`OUTPUT_ORDER` is the per-op fact: the attention kernels write `out` [B, H, T, D] as
[B, T, H, D] in memory (FlashAttention-2's and cuDNN's layout, and the reference kernel
makes it so too), so the attention module's `transpose(1, 2) -> contiguous` before its
output projection copies nothing: 32 MiB a layer at the TinyLlama shape that the planner
would otherwise count twice.

An order is a tuple of logical dims from the outermost in memory to the innermost; the
identity is a contiguous tensor. `transpose` and `permute` carry an order along, `view`
keeps the identity only, and anything else (a split's parts, a function's inputs) is
unknown: its `contiguous` stays a copy.
"""

from __future__ import annotations

from modulec.ir.graph import Function

OUTPUT_ORDER = {"flash_attention": {0: (0, 2, 1, 3)}}  # op -> {output: memory order}
UNKNOWN = ("split",)  # views whose outputs are strided parts of their input


def free_contiguous(function: Function) -> frozenset:
    """Ids of `function`'s `contiguous` nodes whose input is already contiguous in memory."""
    order: dict = {}
    free = set()
    for node in function.nodes:
        if node.kind != "op":
            continue
        source = order.get(node.inputs[0]) if node.inputs else None
        if node.target == "contiguous":
            if source is not None and _identity(source):
                free.add(node.id)
            order[node.outputs[0]] = _rank(function, node.outputs[0])
        elif node.target in ("transpose", "permute"):
            order[node.outputs[0]] = _carry(node, source)
        elif node.target == "view":
            order[node.outputs[0]] = _rank(function, node.outputs[0]) \
                if source is not None and _identity(source) else None
        elif node.target in UNKNOWN:
            order.update({value: None for value in node.outputs})
        else:
            declared = OUTPUT_ORDER.get(node.target, {})
            for i, value in enumerate(node.outputs):
                order[value] = declared.get(i) or _rank(function, value)
    return frozenset(free)


def _identity(order: tuple) -> bool:
    return order == tuple(range(len(order)))


def _rank(function: Function, value: str) -> tuple | None:
    info = function.value(value)
    return tuple(range(len(info.shape))) if info is not None else None


def _carry(node, source: tuple | None) -> tuple | None:
    """The output's memory order: the input's, its logical dims renamed by the op."""
    if source is None:
        return None
    rank = len(source)
    if node.target == "transpose":
        a, b = (int(node.attr(d)) % rank for d in ("dim0", "dim1"))
        rename = {a: b, b: a}
        return tuple(rename.get(d, d) for d in source)
    dims = [int(d) % rank for d in node.attr("dims", ())]
    if sorted(dims) != list(range(rank)):
        return None
    where = {old: new for new, old in enumerate(dims)}  # input dim -> output dim
    return tuple(where[d] for d in source)
