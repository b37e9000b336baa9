"""Cost model: FLOPs and bytes moved per Graph IR node, and its time on a device.

- matmul, batched_matmul, grouped_gemm: 2 * (elements of the first operand) * N, N the
  output's last dim: each element of A meets N of B whatever the mode, so a weight
  gradient (`TN`: d_out^T x over every leading dim) counts all its rows. `<op>_backward`
  computes d_A and d_B: twice the forward, once when the weight gets no gradient (frozen,
  or LoRA training: base weights frozen) or one of the two is unwanted (`_`: either half
  of a matmul backward split by modulec.lower.tp_overlap). Its time is in whole waves of
  output tiles (devices.Device.gemm_seconds), each GEMM's rows x columns over its depth:
  the forward's M x N over K, d_A's M x K over N, d_B's K x N over M.
- flash_attention: 4 * B * H * T * S * D (QK^T and PV), halved when causal, S capped by
  a sliding window; the backward is 2.5 times the forward (FlashAttention-2's ratio). Its
  rate is the device's at D=128 and >= 2048 keys a query, scaled by `attention_scale`.
- everything else is memory-bound: the bytes it reads and writes (inputs + outputs);
  embedding reads only the rows it gathers. Views (view, transpose, permute, split) and
  their backwards move nothing, nor does a concat whose parts are made for it alone (the
  planner joins it in place: modulec/plan/joins.py).

A node's time is the roofline max(flops / achievable FLOP/s of its kind of kernel (matmul,
attention, attention backward: devices.Device.rate), bytes / achievable HBM bandwidth of
its op (devices.Device.bandwidth)), a GEMM's compute in whole waves; a call costs its
callee's total, `repeat` times. The constants' sources: devices.py and docs/decisions.md,
"Cost model calibration". Training modes: `full` (all
weights train) and `lora` (base weights frozen: no weight gradients; the adapters' own
FLOPs, under 1 % at rank 16, are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.ir.graph import Function, Graph, Node
from modulec.plan.devices import Device
from modulec.plan.from_graph import _bytes, _elements
from modulec.plan.in_place import readers_of
from modulec.plan.joins import CONCATS

MATMULS = ("matmul", "batched_matmul", "grouped_gemm")
VIEW_OPS = ("view", "transpose", "permute", "split")
FREE = VIEW_OPS + tuple(f"{v}_backward" for v in VIEW_OPS if v != "split")
ATTENTION_BACKWARD = 2.5
# attention's rate against D=128, >= 2048 keys: D / (D + 36) for the softmax's per-score
# work beside the D-long dot products, S / (S + 640) for a query tile's fixed work (load
# Q, rescale, write O and LSE) over the S keys it sees; S capped at 2048, the longest
# measured. Fitted to the step profiles: D=64, S=1024 (TinyLlama: 352 / 272 TFLOP/s,
# 0.356 / 0.275 of 989) and D=128, S=1024 (Llama-3-8B LoRA: 429 / 322).
SOFTMAX_DIMS, TILE_KEYS, MEASURED_KEYS, REFERENCE_DIM = 36, 640, 2048, 128
TRAINING_MODES = ("full", "lora")


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    kind: str = "matmul"  # the kind of kernel the FLOPs run on (devices.Device.rate)
    op: str = ""          # the op, for its own memory bandwidth (devices.Device.bandwidth)
    scale: float = 1.0    # its FLOP rate against its kind's (attention_scale)
    gemms: tuple = ()     # (rows, columns, depth) of each GEMM kernel: timed in waves

    def seconds(self, device: Device) -> float:
        if self.gemms:
            compute = sum(device.gemm_seconds(*g) for g in self.gemms)
        else:
            compute = self.flops / (device.rate(self.kind) * self.scale) if self.flops else 0.0
        return max(compute, self.bytes / device.bandwidth(self.op))


@dataclass(frozen=True)
class Values:
    table: dict
    no_gradient: frozenset
    joined: frozenset = frozenset()  # ids of the concats planned in place

    def value(self, value_id: str):
        return self.table.get(value_id)


def value_table(graph: Graph, function: Function) -> Values:
    """What `function`'s nodes read: its values, and a backward's forward values too."""
    table = {}
    if function.gradient_of:
        forward = graph.function(function.gradient_of)
        table.update((v.id, v) for v in forward.values + forward.params + forward.inputs)
    table.update((v.id, v) for v in function.values + function.params + function.inputs)
    return Values(table, frozenset(function.no_gradient), _joined(function))


def _joined(function: Function) -> frozenset:
    """The concats the planner joins in place: each part made by an op of `function`, read
    by the concat alone, not saved, not a result (modulec/plan/joins.py's rule)."""
    readers = readers_of(function)
    kept = set(function.saved) | set(function.outputs)
    made = {o for n in function.nodes if n.kind == "op" for o in n.outputs if o} - kept
    return frozenset(
        n.id for n in function.nodes
        if n.kind == "op" and n.target in CONCATS and len(set(n.inputs)) == len(n.inputs) > 1
        and all(p in made and readers.get(p) == [n.id] for p in n.inputs))


def node_cost(function: "Values", node: Node, training: str = "full") -> Cost:
    """The cost of one primitive node (not of a call: see `function_seconds`);
    `function` is a `value_table`."""
    base = node.target.removesuffix("_backward")
    backward = node.target.endswith("_backward")
    if node.target in FREE or node.id in function.joined:
        return Cost()
    if base in MATMULS:
        return _matmul(function, node, backward, training)
    if base == "flash_attention":
        return _attention(function, node, backward)
    if base == "embedding":
        return _embedding(function, node, backward, training)
    return Cost(0.0, _moved(function, node), op=node.target)


def _matmul(function: Values, node: Node, backward: bool, training: str) -> Cost:
    first = 1 if backward else 0  # a backward reads (d_out, A, B): A is its second input
    a = function.value(node.inputs[first])
    out = function.value(node.inputs[0] if backward else node.outputs[0])
    columns = int(out.shape[-1]) if out.shape else 1
    flops = 2.0 * _elements(a) * columns
    rows = max(1, _elements(out) // columns)
    depth = flops / (2.0 * rows * columns)
    moved = _moved(function, node)
    if not backward:
        return Cost(flops, moved, gemms=((rows, columns, depth),))
    weight = node.inputs[first + 1] if len(node.inputs) > first + 1 else ""
    frozen = training == "lora" or weight in function.no_gradient
    d_a = (rows, round(depth), columns)
    # a gradient the node leaves unwanted (`_`) costs nothing: a frozen weight's d_B, or
    # either half of a matmul backward split around a collective (modulec.lower.tp_overlap)
    wanted = [bool(o) for o in node.outputs] + [True, True]
    gemms = ((d_a,) if wanted[0] else ()) + \
        ((round(depth), columns, rows),) * (wanted[1] and not frozen)
    return Cost(flops * len(gemms), moved, gemms=gemms)


def _attention(function: Values, node: Node, backward: bool) -> Cost:
    first = 1 if backward else 0
    q, k = (function.value(node.inputs[first + i]) for i in range(2))
    batch, heads, queries, dim = (int(d) for d in q.shape[-4:])
    keys = int(k.shape[-2])
    window = node.attr("window_size")
    causal = bool(node.attr("causal", False))
    if window:
        keys = min(keys, int(window))
    elif causal:
        keys = keys / 2
    flops = 4.0 * batch * heads * queries * keys * dim
    scale = attention_scale(dim, keys)
    if backward:
        return Cost(flops * ATTENTION_BACKWARD, _moved(function, node), "attention_backward",
                    scale=scale)
    return Cost(flops, _moved(function, node), "attention", scale=scale)


def attention_scale(dim: int, keys: float) -> float:
    """Attention's FLOP rate at head dim `dim` with `keys` keys a query (on average)
    against the device's (D=128, >= 2048 keys): see SOFTMAX_DIMS."""
    seen = min(float(keys), MEASURED_KEYS)
    return (dim / (dim + SOFTMAX_DIMS) / (REFERENCE_DIM / (REFERENCE_DIM + SOFTMAX_DIMS))
            * seen / (seen + TILE_KEYS) / (MEASURED_KEYS / (MEASURED_KEYS + TILE_KEYS)))


def _embedding(function: Values, node: Node, backward: bool, training: str) -> Cost:
    if backward and training == "lora":
        return Cost()
    rows = function.value(node.inputs[0] if backward else node.outputs[0])
    return Cost(0.0, 2.0 * _bytes(rows))


def _moved(function: Values, node: Node) -> float:
    """Bytes read and written: each distinct input and output once (parameters included:
    a norm's weight is small; a matmul's weight is read once)."""
    total = 0
    for value_id in dict.fromkeys(node.inputs + node.outputs):
        value = function.value(value_id) if value_id else None
        if value is not None:
            total += _bytes(value)
    return float(total)


def function_seconds(graph: Graph, name: str, device: Device, training: str = "full",
                     memo: dict | None = None) -> float:
    """Predicted time of one invocation of function `name`: its nodes, calls included."""
    memo = {} if memo is None else memo
    if name not in memo:
        function = graph.function(name)
        values = value_table(graph, function)
        total = 0.0
        for node in function.nodes:
            if node.kind == "call":
                total += int(node.repeat) * function_seconds(graph, node.target, device,
                                                             training, memo)
            elif node.kind == "op":
                total += node_cost(values, node, training).seconds(device)
        memo[name] = total
    return memo[name]


def step_seconds(graph: Graph, device: Device, training: str = "full") -> dict:
    """Predicted forward, backward and total compute time of one training step."""
    memo: dict = {}
    forward = function_seconds(graph, graph.entry, device, training, memo)
    backward = function_seconds(graph, graph.backward, device, training, memo) \
        if graph.backward else 0.0
    return {"forward_s": forward, "backward_s": backward, "step_s": forward + backward}
