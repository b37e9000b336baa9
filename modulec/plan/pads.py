"""Rows laid with spare columns: a LoRA-adapted projection's input planned [rows, in + k r].

An adapted projection is `y = add(matmul(x, W), matmul(t, B))` with `t = matmul(x, A)`
(modulec/lower/lora.py; A the adapters' `lora_A`, or their concat for a fused weight, k r
wide). A GPU runtime may run it as one GEMM over [x | t] and [W | s B] (K = in + k r),
which needs x and t side by side in one matrix. Copying x there moves it once more (at
Llama-3-8B, T=2048, 17 MB read and written per projection); planned here, x's own buffer
has k r spare columns after each row, t is written into them, and the GEMM reads x's
bytes as the wide matrix: nothing is copied.

`requested_pads(graph)` finds those inputs and follows them to the buffer that holds them:
through `view`s (that keep the row) to the op that made it in the same function, or, for
a function input, to the value each call passes (recursively). The memory plan
(modulec.plan.from_graph) lays the buffer with the spare columns (its bytes grow by
pad / row: 48 / 4096 at q/k/v) where it may: a buffer of its own made by an op (not a
view, not written over its input, not a function's result) in row order. Every value
on the way is recorded with its `Pad`, so a runtime knows where to look; it still checks
the tensor's strides, since a kernel that cannot write strided rows, or a replay, may
hand it a dense copy.

Only LoRA's pattern asks for spare columns (its A is a `lora_A` parameter or a concat of
them), only where both row and pad are whole 16-byte runs, so rows stay aligned, and not
in a tensor-parallel rank's program (its collectives want dense buffers, and the one-GEMM
path runs in single-process steps only)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from modulec.ir.graph import Function, Graph
from modulec.types.tensor import BITS, FLOAT

ALIGN_BYTES = 16
ROW_VIEWS = ("view",)  # aliases a padded row passes through (the row's elements kept)
COLLECTIVES = ("tp_", "sp_", "vocab_parallel_")  # a tensor-parallel rank's program's ops


@dataclass(frozen=True)
class Pad:
    row: int   # elements of a row (x's last dim)
    pad: int   # spare elements after each row (t's last dim: k r)


def requested_pads(graph: Graph) -> dict[str, dict[str, Pad]]:
    """{function: {value: Pad}}: each adapted projection's input and the values it is
    made from (views, the caller's arguments) down to the buffer the plan may lay wide."""
    requests: dict[str, dict[str, Pad]] = {}
    if any(n.kind == "op" and n.target.startswith(COLLECTIVES)
           for f in graph.functions for n in f.nodes):
        return requests
    for function in graph.functions:
        if function.gradient_of:
            continue
        for x, pad in adapted_inputs(function).items():
            _request(graph, function, x, pad, requests, depth=0)
    return requests


def adapted_inputs(function: Function) -> dict[str, Pad]:
    """{x: Pad} of the function's LoRA-adapted projections whose rows can be laid wide."""
    producers = {o: n for n in function.nodes for o in n.outputs if o}
    found: dict[str, Pad] = {}
    for node in function.nodes:
        if node.kind != "op" or node.target != "add" or len(node.inputs) != 2:
            continue
        for base, delta in (node.inputs, node.inputs[::-1]):
            pad = _adapter_pad(function, producers, base, delta)
            if pad is not None:
                found[pad[0]] = pad[1]
                break
    return found


def _adapter_pad(function, producers, base: str, delta: str):
    """(x, Pad) where `base` = matmul(x, W) and `delta` = matmul(matmul(x, A), B) with A
    LoRA's, else None."""
    base_op, delta_op = producers.get(base), producers.get(delta)
    if not (_is_matmul(base_op) and _is_matmul(delta_op)):
        return None
    t_op = producers.get(delta_op.inputs[0])
    if not _is_matmul(t_op) or t_op.inputs[0] != base_op.inputs[0]:
        return None
    if not _is_lora_a(function, producers, t_op.inputs[1]):
        return None
    x, t = function.value(t_op.inputs[0]), function.value(t_op.outputs[0])
    if x is None or t is None or not x.shape or not t.shape:
        return None
    try:
        row, pad = int(x.shape[-1]), int(t.shape[-1])
    except ValueError:
        return None
    bits = BITS.get("bf16" if x.dtype == FLOAT else x.dtype)  # "float": bf16 on the GPU
    if bits is None or bits % 8 or (row * bits // 8) % ALIGN_BYTES \
            or (pad * bits // 8) % ALIGN_BYTES:
        return None
    return x.id, Pad(row, pad)


def _is_matmul(node) -> bool:
    return node is not None and node.kind == "op" and node.target == "matmul" \
        and len(node.inputs) >= 2


def _is_lora_a(function, producers, value: str) -> bool:
    if value.startswith("param:"):
        return value.endswith(".lora_A")
    node = producers.get(value)
    return node is not None and node.kind == "op" and node.target == "concat" and \
        bool(node.inputs) and all(v.startswith("param:") and v.endswith(".lora_A")
                                  for v in node.inputs)


def _request(graph: Graph, function: Function, value: str, pad: Pad, requests: dict,
             depth: int) -> None:
    """Record `value` of `function` and follow it to the buffer that holds it."""
    mine = requests.setdefault(function.name, {})
    if mine.get(value, pad) != pad or depth > 64:
        mine[value] = None  # two projections ask for different pads: neither is laid
        return
    mine[value] = pad
    inputs = [v.id for v in function.inputs]
    if value in inputs:
        position = inputs.index(value)
        for caller in graph.functions:
            for node in caller.nodes:
                if node.kind == "call" and node.target == function.name \
                        and position < len(node.inputs) and node.inputs[position]:
                    _request(graph, caller, node.inputs[position], pad, requests, depth + 1)
        return
    producer = next((n for n in function.nodes if value in n.outputs), None)
    if producer is not None and producer.kind == "op" and producer.target in ROW_VIEWS \
            and _keeps_row(function, producer.inputs[0], pad.row):
        _request(graph, function, producer.inputs[0], pad, requests, depth + 1)


def _keeps_row(function: Function, source: str, row: int) -> bool:
    """`source`'s trailing dims hold whole rows of `row` elements (a view to x keeps them)."""
    info = function.value(source)
    if info is None:
        return False
    try:
        dims = [int(d) for d in info.shape]
    except ValueError:
        return False
    return any(prod(dims[k:]) == row for k in range(len(dims)))


def laid_pads(requests: dict[str, dict[str, Pad]]) -> dict[str, dict[str, Pad]]:
    """The requests without the conflicting ones (None)."""
    return {f: {v: p for v, p in values.items() if p is not None}
            for f, values in requests.items()}


def padded_bytes(numel: int, item: int, pad: Pad) -> int:
    """A buffer of `numel` elements laid as rows of `pad.row` with `pad.pad` spare after each."""
    return numel // pad.row * (pad.row + pad.pad) * item
