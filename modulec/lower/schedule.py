"""Schedule IR (§9.7.2): each function's operations in execution order with the kernels they
run (from each primitive's `impl:`), the stream each runs on, and, when every dim has a
size, the buffers their outputs live in (region, offset, bytes: the memory plan of
modulec.plan) and the activation layout (modulec.lower.layout). With planner decisions
(modulec.lower.decided) the backward carries recompute segments and the swap ops with
their sync points; docs/build-output.md describes the format."""

from __future__ import annotations

from modulec.ir.graph import COMM_STREAM, COMPUTE_STREAM, WAIT, Graph, Node, is_async
from modulec.ops.registry import op_table
from modulec.syntax import ast as A


def schedule_data(graph: Graph, plan=None, decided=None) -> dict:
    """`plan` (the memory plan, modulec.plan.from_graph.StepPlan) adds each op's output
    buffers as [value, region, offset, bytes] and the layout; without sizes for every dim
    there is no plan, and ops carry no buffers. `decided` inserts the planner's ops."""
    from modulec.lower.decided import inserted_ops
    from modulec.lower.layout import activation_layout, host_offsets

    placements = plan.placements if plan is not None else {}
    handed = plan.handed if plan is not None else {}
    pads = getattr(plan, "pads", None) or {}
    layout = activation_layout(graph, plan, decided) if plan is not None else None
    extra = inserted_ops(decided, placements, host_offsets(layout)) \
        if decided is not None and layout is not None else {}
    data = {"functions": {f.name: _ops(f, placements.get(f.name, {}) | _results(
                              f, handed.get(f.name, {})), extra, pads.get(f.name, {}))
                          for f in graph.functions},
            "order": [graph.entry] + ([graph.backward] if graph.backward else [])}
    return data | ({"layout": layout} if layout is not None else {})


class _Result:
    """A result the callee writes into its caller's bytes for the call's output `offset`
    (modulec.plan.from_graph `handed`): region `result`."""

    region = "result"

    def __init__(self, position: int, size_bytes: int):
        self.offset, self.size_bytes = position, size_bytes


def _results(function, handed: dict) -> dict:
    from modulec.plan.from_graph import _bytes

    return {value: _Result(k, _bytes(function.value(value))) for value, k in handed.items()}


def _ops(function, placed: dict, extra: dict, pads: dict) -> list[dict]:
    ops = []
    for node in function.nodes:
        ops += extra.get((function.name, node.id, "before"), [])
        ops.append(_op(node, placed, pads))
        ops += extra.get((function.name, node.id, "after"), [])
    return ops


def _op(node: Node, placed: dict, pads: dict) -> dict:
    """`rows`: {output: [elements, stride]} of the outputs the plan lays with spare
    columns after each row (modulec.plan.pads)."""
    op = {"node": node.id, "kernel": kernel_of(node), "repeat": node.repeat,
          "phase": node.phase, "stream": COMM_STREAM if is_async(node) else COMPUTE_STREAM}
    buffers = [_buffer_ref(value, placed[value]) for value in node.outputs if value in placed]
    rows = {value: [pads[value].row, pads[value].row + pads[value].pad]
            for value in node.outputs if value in pads and value in placed
            and getattr(placed[value], "block", value) == value}
    group = node.attr("fusion_group")  # one kernel launch for the group (modulec.lower.fusion)
    return op | ({"buffers": buffers} if buffers else {}) | ({"rows": rows} if rows else {}) \
        | ({"fusion_group": group} if group else {})


def _buffer_ref(value: str, placement) -> list:
    """[value, region, offset, bytes], and the value owning the storage where that is
    another (a view, an output written over an input, a part of a concat planned in place)."""
    ref = [value, placement.region, placement.offset, placement.size_bytes]
    block = getattr(placement, "block", value)
    return ref + [block] if block != value else ref


def kernel_of(node: Node) -> str:
    if node.kind == "call":
        return f"call:{node.target}"
    if node.kind == WAIT:  # the compute stream waits for the op's event
        return f"wait:{node.target}"
    backward = node.target.endswith("_backward")
    rule = op_table().get(node.target[:-9] if backward else node.target)
    impl = _impl(rule.definition.decl) if rule else None
    if impl is None:
        return node.target
    if impl.text is not None:
        return impl.text
    wanted = "backward" if backward else "forward"
    return next((e.text for e in impl.entries if e.name == wanted), node.target)


def _impl(decl: A.Decl) -> A.ImplBlock | None:
    return next((i for i in decl.body if isinstance(i, A.ImplBlock)), None)


def print_schedule(data: dict) -> str:
    """The canonical text form (modulec.lower.schedule_text)."""
    from modulec.lower.schedule_text import print_schedule as text

    return text(data)
