"""Cost model: FLOPs and bytes moved per Graph IR node, and its time on a device.

- matmul, batched_matmul, grouped_gemm: 2 * (elements of the output) * K, K the
  contraction dim of the first operand (its last dim, or the one before in `T` mode), so
  leading dims count as rows. `<op>_backward` computes d_A and d_B: twice the forward,
  once when the weight gets no gradient (frozen, or LoRA training: base weights frozen).
- flash_attention: 4 * B * H * T * S * D (QK^T and PV), halved when causal, S capped by
  a sliding window; the backward is 2.5 times the forward (FlashAttention-2's ratio).
- everything else is memory-bound: the bytes it reads and writes (inputs + outputs);
  embedding reads only the rows it gathers. Views (view, transpose, permute, split) and
  their backwards move nothing.

A node's time is the roofline max(flops / achievable FLOP/s of its kind of kernel (matmul,
attention, attention backward: devices.Device.rate), bytes / achievable HBM bandwidth);
a call costs its callee's total, `repeat` times. Training modes: `full` (all
weights train) and `lora` (base weights frozen: no weight gradients; the adapters' own
FLOPs, under 1 % at rank 16, are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.ir.graph import Function, Graph, Node
from modulec.plan.devices import Device
from modulec.plan.from_graph import _bytes, _elements

MATMULS = ("matmul", "batched_matmul", "grouped_gemm")
VIEW_OPS = ("view", "transpose", "permute", "split")
FREE = VIEW_OPS + tuple(f"{v}_backward" for v in VIEW_OPS if v != "split")
ATTENTION_BACKWARD = 2.5
TRAINING_MODES = ("full", "lora")


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    kind: str = "matmul"  # the kind of kernel the FLOPs run on (devices.Device.rate)

    def seconds(self, device: Device) -> float:
        compute = self.flops / device.rate(self.kind) if self.flops else 0.0
        return max(compute, self.bytes / device.bytes_per_s)


@dataclass(frozen=True)
class Values:
    table: dict
    no_gradient: frozenset

    def value(self, value_id: str):
        return self.table.get(value_id)


def value_table(graph: Graph, function: Function) -> Values:
    """What `function`'s nodes read: its values, and a backward's forward values too."""
    table = {}
    if function.gradient_of:
        forward = graph.function(function.gradient_of)
        table.update((v.id, v) for v in forward.values + forward.params + forward.inputs)
    table.update((v.id, v) for v in function.values + function.params + function.inputs)
    return Values(table, frozenset(function.no_gradient))


def node_cost(function: "Values", node: Node, training: str = "full") -> Cost:
    """The cost of one primitive node (not of a call: see `function_seconds`);
    `function` is a `value_table`."""
    base = node.target.removesuffix("_backward")
    backward = node.target.endswith("_backward")
    if node.target in FREE:
        return Cost()
    if base in MATMULS:
        return _matmul(function, node, backward, training)
    if base == "flash_attention":
        return _attention(function, node, backward)
    if base == "embedding":
        return _embedding(function, node, backward, training)
    return Cost(0.0, _moved(function, node))


def _matmul(function: Values, node: Node, backward: bool, training: str) -> Cost:
    first = 1 if backward else 0  # a backward reads (d_out, A, B): A is its second input
    a = function.value(node.inputs[first])
    out = function.value(node.inputs[0] if backward else node.outputs[0])
    mode = str(node.attr("transpose", "NN") or "NN")
    k = int(a.shape[-2] if mode[0] == "T" else a.shape[-1])
    flops = 2.0 * _elements(out) * k
    moved = _moved(function, node)
    if not backward:
        return Cost(flops, moved)
    weight = node.inputs[first + 1] if len(node.inputs) > first + 1 else ""
    frozen = training == "lora" or weight in function.no_gradient
    return Cost(flops * (1 if frozen else 2), moved)


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
    if backward:
        return Cost(flops * ATTENTION_BACKWARD, _moved(function, node), "attention_backward")
    return Cost(flops, _moved(function, node), "attention")


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
