"""Schedule IR (§9.7.2): each function's operations in execution order with the kernels they
run (from each primitive's `impl:`) and, when every dim has a size, the buffers their
outputs live in (region, offset, bytes: the memory plan of modulec.plan). Streams, sync
points and recompute/swap segments are not placed yet (issue 4)."""

from __future__ import annotations

from modulec.ir.graph import Graph, Node
from modulec.ops.registry import op_table
from modulec.syntax import ast as A


def schedule_data(graph: Graph, placements: dict | None = None) -> dict:
    """`placements` (function -> value -> Placement, from the memory plan) adds each op's
    output buffers as [value, region, offset, bytes]; without sizes for every dim there is
    no plan, and ops carry no buffers."""
    placements = placements or {}
    return {"functions": {f.name: [_op(n, placements.get(f.name, {})) for n in f.nodes]
                          for f in graph.functions},
            "order": [graph.entry] + ([graph.backward] if graph.backward else [])}


def _op(node: Node, placed: dict) -> dict:
    op = {"node": node.id, "kernel": kernel_of(node), "repeat": node.repeat,
          "phase": node.phase}
    buffers = [_buffer_ref(value, placed[value]) for value in node.outputs if value in placed]
    group = node.attr("fusion_group")  # one kernel launch for the group (modulec.lower.fusion)
    return op | ({"buffers": buffers} if buffers else {}) | ({"fusion_group": group}
                                                             if group else {})


def _buffer_ref(value: str, placement) -> list:
    return [value, placement.region, placement.offset, placement.size_bytes]


def kernel_of(node: Node) -> str:
    if node.kind == "call":
        return f"call:{node.target}"
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
    """The canonical text form of a schedule: functions in execution order first, then the
    rest by name; one line per op (`%id  phase  kernel  ×repeat`)."""
    functions = data["functions"]
    names = list(data["order"]) + sorted(set(functions) - set(data["order"]))
    return "".join(_print_function(name, functions[name]) for name in names)


def _print_function(name: str, ops: list[dict]) -> str:
    lines = [f"schedule @{name} ({len(ops)} op{'s' if len(ops) != 1 else ''}) {{"]
    lines += [f"  %{op['node'][1:]:<5} {op['phase']:<9} {op['kernel']}{_times(op['repeat'])}"
              + _buffers_text(op.get("buffers", ()))
              + (f"  [{op['fusion_group']}]" if "fusion_group" in op else "") for op in ops]
    return "\n".join(lines + ["}", ""]) + "\n"


def _times(repeat) -> str:
    return "" if str(repeat) == "1" else f"  ×{repeat}"


def _buffers_text(buffers) -> str:
    return "".join(f"  {value}@{region}+{offset}:{size}" for value, region, offset, size in buffers)
