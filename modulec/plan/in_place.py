"""Ops that write their outputs over their inputs' buffers (the planner notes' in-place
sharing), decided once per forward function so that the budget planner's timeline
(modulec.plan.timeline) and the GPU step (runtime/cuda/step.py) agree.

`IN_PLACE_OUTPUTS` is the per-op capability: which output may overwrite which input (the
kernel reads each element before writing the same element, so the rotation of RoPE can
run in place). A node runs in place when every such input is dead after it: read by that
node alone, neither saved for a backward nor an output of the function, and reached
through views only (view, transpose, permute, split) from a buffer an op of the same
function made, whose other readers see only other parts of it (a split's other parts).

So the attention's RoPE rotates q and k inside the fused QKV projection output: q_rot,
k_rot and v are then three views of one buffer, which the backward keeps anyway for v
(36 MiB a layer less on the TinyLlama shape, and no copy). The buffer holds rotated
values afterwards, so a replay of its producer would not give them back: the planner
never recomputes a buffer written in place (modulec.plan.budget).
"""

from __future__ import annotations

from modulec.ir.graph import Function, Graph

# op -> ((output, input), ...). Not qk_norm_rope: its backward reads the pre-norm q and k,
# so they are saved and never dead after it.
IN_PLACE_OUTPUTS = {"rope": ((0, 0), (1, 1))}
VIEWS = ("view", "transpose", "permute", "split")


def in_place_nodes(graph: Graph, function: Function) -> frozenset:
    """Ids of the nodes of forward `function` that run in place (callers cache it: the
    analysis walks the function)."""
    from modulec.plan.from_graph import saved_values

    if function.gradient_of:
        return frozenset()
    pinned = saved_values(graph, function) | set(function.outputs)
    pinned |= {v.id for v in function.inputs}
    readers = readers_of(function)
    producers = {o: n for n in function.nodes for o in n.outputs if o}
    return frozenset(
        node.id for node in function.nodes
        if node.kind == "op" and node.target in IN_PLACE_OUTPUTS
        and all(_dead_after(node.inputs[i], node, pinned, readers, producers)
                for _, i in IN_PLACE_OUTPUTS[node.target]))


def readers_of(function: Function) -> dict:
    """value -> ids of the nodes that read it, in order (each node once)."""
    readers: dict = {}
    for node in function.nodes:
        for value in dict.fromkeys(v for v in node.inputs if v):
            readers.setdefault(value, []).append(node.id)
    return readers


def _dead_after(value: str, node, pinned: set, readers: dict, producers: dict) -> bool:
    """`value` and every buffer it views are read by nothing after `node` (a split's
    other parts aside)."""
    reader = node.id
    while True:
        if not value or value in pinned or readers.get(value, []) != [reader]:
            return False
        producer = producers.get(value)
        if producer is None or producer.kind != "op":
            return False
        if producer.target not in VIEWS:
            return True  # the buffer an op of this function made
        value, reader = producer.inputs[0], producer.id
