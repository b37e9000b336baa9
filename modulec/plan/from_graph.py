"""Memory plan of a training step from hierarchical Graph IR.

The step runs the entry function's forward, then its backward. Each function is planned
once, however often it runs (an 80-layer stack costs one block's work): its own
intermediate values are buffers in the transient region, views alias their source,
unary elementwise ops may work in place, and a call reserves its callee's planned arena
for the duration of that op. Values a backward reads are saved activations, kept from
the forward into the backward of every invocation: a saved view keeps its source's
storage, and an argument a callee's backward reads (the callee's saved input) is saved
by the caller (by the callee, as the output feeding the next repetition, when the call
repeats). A called function's results that are buffers of its own (not views, not saved)
are written straight into its caller's bytes for the call's outputs (`handed`): they take
no bytes of its frame and need no copy; a repeated call's caller holds a second buffer
per such result, the repetitions writing the two in turn (the last one: the call's
output), since each reads the previous one's result. A concat's parts are planned in its
output (modulec.plan.joins); a LoRA-adapted projection's input is laid with spare
columns after each row (modulec.plan.pads). Parameters, their gradients and the optimizer state (fp32
master + two AdamW moments) are counted per invocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

from modulec.ir.graph import Function, Graph, Node, async_reads
from modulec.plan.memory import (
    GRADIENTS, OPTIMIZER_STATE, SAVED, TRANSIENT, WEIGHTS, Buffer, Op, plan_memory,
)
from modulec.plan.memory.model import round_up
from modulec.plan.in_place import IN_PLACE_OUTPUTS, in_place_nodes
from modulec.plan.joins import joined_parts
from modulec.plan.layouts import OUTPUT_ORDER, free_contiguous
from modulec.plan.pads import laid_pads, padded_bytes, requested_pads

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int32": 4,
         "int8": 1, "float": 2}  # "float": the compute dtype, bf16
HALF_BYTE = ("fp4_e2m1", "int4")
VIEWS = ("view", "transpose", "permute", "split")
# backward ops whose result is a view of their input gradient (a reshape, a transpose, the
# identity of contiguous, concat's parts: a split): they alias it, as the forward views
# alias their source
BACKWARD_VIEWS = ("view_backward", "transpose_backward", "permute_backward",
                  "contiguous_backward", "concat_backward")
ALIASES = VIEWS + BACKWARD_VIEWS
# ops whose kernel returns one tensor for two of its outputs: (output, the output it is)
ONE_TENSOR = {"fused_residual_rmsnorm_backward": ((1, 0),),  # d_input is d_residual
              "fused_residual_layernorm_backward": ((1, 0),)}
IN_PLACE = ("silu", "relu", "relu2", "gelu", "sigmoid", "exp", "neg", "exp_neg", "scale")
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weight, AdamW m and v


class ShapeUnknown(ValueError):
    """A value whose size is not a number: sizes of free dims are missing (`--shape`)."""


@dataclass
class RegionTotals:
    arena: int = 0
    lower_bound: int = 0
    naive: int = 0
    greedy_by_size: int = 0
    exact_size_reuse: int = 0


@dataclass
class StepPlan:
    regions: dict[str, RegionTotals] = field(default_factory=dict)
    invocations: dict[str, int] = field(default_factory=dict)
    functions: dict[str, dict] = field(default_factory=dict)  # per function: its plan summary
    placements: dict[str, dict] = field(default_factory=dict)  # function -> value -> Placement
    joins: dict[str, dict] = field(default_factory=dict)  # function -> part -> joins.Part
    # function -> {its output value: position}: results written into the caller's bytes
    handed: dict[str, dict] = field(default_factory=dict)
    # function -> {position: position}: a handed result that is another one (one tensor
    # for two results, ONE_TENSOR): a call naming both holds one buffer for the two
    twins: dict[str, dict] = field(default_factory=dict)
    # function -> {value: pads.Pad}: buffers laid with spare columns after each row, and
    # the values on the way to them (views, a callee's inputs: modulec.plan.pads)
    pads: dict[str, dict] = field(default_factory=dict)

    def summary(self) -> dict:
        regions = [{"region": name, "arena_bytes": r.arena, "lower_bound_bytes": r.lower_bound,
                    "naive_bytes": r.naive, "greedy_by_size_bytes": r.greedy_by_size,
                    "exact_size_reuse_bytes": r.exact_size_reuse}
                   for name, r in self.regions.items()]
        total = lambda key: sum(r[key] for r in regions)  # noqa: E731
        return {"regions": regions, "arena_bytes": total("arena_bytes"),
                "lower_bound_bytes": total("lower_bound_bytes"),
                "naive_bytes": total("naive_bytes"),
                "greedy_by_size_bytes": total("greedy_by_size_bytes"),
                "exact_size_reuse_bytes": total("exact_size_reuse_bytes"),
                "invocations": dict(sorted(self.invocations.items()))}


def plan_step(graph: Graph) -> StepPlan:
    step = StepPlan()
    step.invocations = _invocations(graph)
    step.pads = laid_pads(requested_pads(graph))
    arenas: dict[str, tuple[int, ...]] = {}
    for function in _callees_first(graph):
        arenas[function.name] = _plan_function(graph, function, arenas, step)
    entries = [graph.entry] + ([graph.backward] if graph.backward else [])
    by_metric = {m: max(arenas[e][i] for e in entries) for i, m in enumerate(METRICS)}
    by_metric["naive"] = sum(arenas[e][METRICS.index("naive")] for e in entries)
    transient = RegionTotals(by_metric["arena"], by_metric["lower_bound"], by_metric["naive"],
                             by_metric["greedy_by_size"], by_metric["exact_size_reuse"])
    step.regions[TRANSIENT] = transient
    _fixed_regions(graph, step)
    return step


# ====================================================================== one function
METRICS = ("arena", "lower_bound", "naive", "greedy_by_size", "exact_size_reuse")


def _plan_function(graph: Graph, function: Function, arenas, step: StepPlan):
    """The function's transient bytes by each metric: a call reserves its callee's bytes by
    the same metric (naive: the callee's naive bytes, once per repetition)."""
    results = []
    for metric in METRICS:
        plan = _planned(graph, function, arenas, metric, step.handed, step.joins, step.twins,
                        step.pads)
        region = plan.regions.get(TRANSIENT) if plan is not None else None
        results.append(_metric(region, metric))
        if metric == "arena" and plan is not None:
            step.functions[function.name] = plan.summary()
            step.placements[function.name] = plan.placements
            _add_saved(step, plan.regions.get(SAVED),
                       step.invocations.get(_forward_name(function), 1))
    return tuple(results)


def _planned(graph, function, arenas, metric: str, handed: dict, joins: dict | None = None,
             twins: dict | None = None, pads: dict | None = None):
    """`handed` (function -> its results written into the caller's bytes) and `twins`
    (function -> its handed results that are another one) have every callee's already;
    `function`'s own are added, and its concats planned in place to `joins` (function ->
    part -> modulec.plan.joins.Part). `pads` (function -> value -> Pad): a requested
    buffer that cannot be laid wide (`_lay_wide`) is dropped from it."""
    twins = {} if twins is None else twins
    saved = saved_values(graph, function)
    own = {v.id: v for v in function.values}
    free = free_contiguous(function)
    # outputs in another value's bytes: written over their input, contiguous already, or
    # one tensor for two outputs (ONE_TENSOR)
    over = written_over(graph, function) | {
        n.outputs[0]: n.inputs[0] for n in function.nodes if n.id in free} | {
        n.outputs[o]: n.outputs[i] for n in function.nodes if n.kind == "op"
        for o, i in ONE_TENSOR.get(n.target, ()) if n.outputs[o] and n.outputs[i]} | \
        _call_twins(function, twins)
    ops, buffers, made = [], {}, {}
    in_flight = async_reads(function)
    for index, node in enumerate(function.nodes):
        outputs = [o for o in node.outputs if o in own and not _is_param_grad(function, o)]
        for position, value in _sources_first(outputs, over):
            if over.get(value) in buffers:  # a view of its input
                source = buffers[over[value]]
                buffers[value] = Buffer(value, source.size_bytes, TRANSIENT,
                                        alias_of=source.id)
            else:
                buffers[value] = _buffer(node, index, value, position, own, buffers, saved,
                                         len(function.nodes))
            made[value] = index
        # a wait reads what its async op reads and writes: their bytes stay theirs (no op
        # between the two may reuse them) until the compute stream has joined it
        inputs = [i for i in node.inputs + in_flight.get(node.id, ()) if i in buffers]
        if node.kind == "call":
            outputs = outputs + [_call_block(node, arenas, metric, buffers)] + \
                _destinations(graph, node, handed, buffers, twins)
        ops.append(Op(index, node.id, tuple(inputs), tuple(outputs),
                      "view" if node.id in free else _kind(node), node.target in IN_PLACE))
    _lay_wide(function, buffers, made, over, (pads or {}).get(function.name))
    _save_view_sources(buffers, saved, made, len(function.nodes))
    _keep_outputs(function, buffers, len(function.nodes), ops)
    _join_concats(function, buffers, made, joins)
    handed[function.name], twins[function.name] = _handed(graph, function, buffers)
    ops = _without(ops, handed[function.name])
    buffers = [b for b in buffers.values() if b.id not in handed[function.name]]
    return plan_memory(ops, buffers) if ops else None


def _lay_wide(function: Function, buffers: dict, made: dict, over: dict,
              pads: dict | None) -> None:
    """The buffers `pads` asks for (modulec.plan.pads) laid with spare columns after each
    row, where they are buffers of their own an op made in row order: not a view, not
    written over an input, not a function's result (its caller's bytes), not an op's
    output in another memory order (layouts.OUTPUT_ORDER). Others are dropped from
    `pads`; the views and inputs recorded there stay (a runtime checks the strides)."""
    if not pads:
        return
    for value in sorted(pads):
        if value not in made or function.nodes[made[value]].target in ALIASES:
            continue
        node, buffer = function.nodes[made[value]], buffers[value]
        if node.kind != "op" or value in over or buffer.alias_of is not None \
                or value in function.outputs or node.target in OUTPUT_ORDER:
            del pads[value]
            continue
        info = function.value(value)
        buffers[value] = replace(buffer, size_bytes=padded_bytes(
            _elements(info), _dtype_bytes(info.dtype), pads[value]))


def _join_concats(function: Function, buffers: dict, made: dict, joins: dict | None) -> None:
    """The parts of a concat planned in place (modulec.plan.joins) as views of its output."""
    ops_made = {v for v, i in made.items() if function.nodes[i].kind == "op"}
    own = {v for v, b in buffers.items() if v in ops_made and b.alias_of is None
           and b.region == TRANSIENT and b.pinned_lifetime is None}
    parts = joined_parts(function, own, lambda v: buffers[v].size_bytes)
    for value, part in parts.items():
        buffers[value] = Buffer(value, buffers[value].size_bytes, TRANSIENT,
                                alias_of=part.concat, offset_in_source=part.byte_offset)
    if joins is not None:
        joins[function.name] = parts


def _handed(graph: Graph, function: Function, buffers: dict) -> tuple[dict, dict]:
    """({output: position} of `function`'s results its caller's bytes hold, {position:
    position} of those that are another one). Handed: buffers of its own (not a view,
    not written over an input, not saved, no view's source but its twins), each one output
    once, of a function some call runs (the entries' results are the step's). A twin: an
    output that is a whole-buffer view of a handed output (ONE_TENSOR's second output)."""
    if function.name in (graph.entry, graph.backward):
        return {}, {}
    named = [o for o in function.outputs if o]
    position = {value: k for k, value in enumerate(function.outputs)
                if value and named.count(value) == 1 and value in buffers}
    twin_of = {v: buffers[v].alias_of for v in position if buffers[v].alias_of in position
               and buffers[buffers[v].alias_of].alias_of is None
               and not buffers[v].offset_in_source
               and buffers[v].size_bytes == buffers[buffers[v].alias_of].size_bytes}
    viewed = {b.alias_of for b in buffers.values() if b.alias_of is not None
              and b.id not in twin_of}
    handed = {value: k for value, k in position.items() if buffers[value].alias_of is None
              and buffers[value].region == TRANSIENT and value not in viewed}
    twins = {v: u for v, u in twin_of.items() if u in handed and v not in viewed}
    handed |= {v: position[v] for v in twins}
    return handed, {position[v]: position[u] for v, u in twins.items()}


def shared_twins(node: Node, twins: dict) -> dict[int, int]:
    """{position: its source's position} of call `node`'s twin results (`StepPlan.twins`)
    it names both of: one buffer of the caller holds the two."""
    return {k: u for k, u in twins.get(node.target, {}).items()
            if node.outputs[k] and node.outputs[u]}


def _call_twins(function: Function, twins: dict) -> dict:
    """{call output: the call output it is} for the shared twins of `function`'s calls."""
    return {node.outputs[k]: node.outputs[u] for node in function.nodes
            if node.kind == "call" for k, u in shared_twins(node, twins).items()}


def _sources_first(outputs: list, over: dict) -> list:
    """(position, output) with an output that is another output of the same node after it
    (its buffer is made first)."""
    return sorted(enumerate(outputs), key=lambda item: over.get(item[1]) in outputs)


def _without(ops: list, handed: dict) -> list:
    """The ops, reading and writing nothing of the values that live in the caller's bytes."""
    keep = lambda values: tuple(v for v in values if v not in handed)  # noqa: E731
    return [replace(op, inputs=keep(op.inputs), outputs=keep(op.outputs)) for op in ops]


def _destinations(graph: Graph, node: Node, handed: dict, buffers: dict,
                  twins: dict) -> list[str]:
    """The caller's extra buffers a call writes its results into: a result the callee
    hands over for an output the call does not name (`call:<node>:out<k>`), and, when the
    call repeats, the second buffer of each result the callee does not save
    (`call:<node>:turn<k>`; the repetitions alternate, the last writes the output), but
    for a twin the call names with its source (`shared_twins`: it is in the source's)."""
    callee = graph.function(node.target)
    given, kept = handed.get(node.target, {}), saved_values(graph, callee)
    shared = shared_twins(node, twins)
    extra = []
    for k, value in enumerate(callee.outputs):
        size = _bytes(callee.value(value)) if value else 0
        if value in given and not node.outputs[k]:
            extra.append(Buffer(unnamed_of(node.id, k), size, TRANSIENT))
        if int(node.repeat) > 1 and value and value not in kept and k not in shared:
            extra.append(Buffer(turn_of(node.id, k), size, TRANSIENT))
    buffers.update({b.id: b for b in extra})
    return [b.id for b in extra]


def turn_of(node_id: str, position: int) -> str:
    """The caller's second buffer for result `position` of repeated call `node_id`."""
    return f"call:{node_id}:turn{position}"


def unnamed_of(node_id: str, position: int) -> str:
    """The caller's buffer for handed result `position` the call does not name."""
    return f"call:{node_id}:out{position}"


def written_over(graph: Graph, function: Function) -> dict:
    """{output: the input it is written over} of `function`'s in-place nodes
    (modulec.plan.in_place)."""
    nodes = in_place_nodes(graph, function)
    return {node.outputs[o]: node.inputs[i] for node in function.nodes if node.id in nodes
            for o, i in IN_PLACE_OUTPUTS[node.target]}


def _save_view_sources(buffers: dict, saved: set[str], made: dict, count: int) -> None:
    """A saved view keeps the storage it views: its source (the root of a chain of views)
    is saved from where it is made to the end."""
    for value in sorted(saved & set(buffers)):
        root = buffers[value]
        while root.alias_of is not None and root.alias_of in buffers:
            root = buffers[root.alias_of]
        if root.id != value and root.region == TRANSIENT and root.id in made:
            buffers[root.id] = Buffer(root.id, root.size_bytes, SAVED,
                                      pinned_lifetime=(made[root.id], count - 1))


def _call_block(node: Node, arenas, metric: str, buffers: dict) -> str:
    block = f"call:{node.id}"
    size = arenas.get(node.target, (0,) * len(METRICS))[METRICS.index(metric)]
    if metric == "naive":
        size *= int(node.repeat)
    buffers[block] = Buffer(block, size, TRANSIENT)
    return block


def _metric(region, metric: str) -> int:
    if region is None:
        return 0
    if metric in ("arena", "lower_bound", "naive"):
        return getattr(region, f"{metric}_bytes")
    return region.baselines.get(metric, region.arena_bytes)


def _buffer(node: Node, index: int, value: str, position: int, own, buffers, saved,
            end) -> Buffer:
    """`index`: the node's position in its function (ids need not be positions: the fuse
    pass removes nodes)."""
    size = _bytes(own[value])
    source = node.inputs[0] if node.inputs else ""
    if node.target in ALIASES and source in buffers:
        offset = min(_part_offset(node, position, own), max(buffers[source].size_bytes - size, 0))
        return Buffer(value, min(size, buffers[source].size_bytes), TRANSIENT,
                      alias_of=source, offset_in_source=offset)
    if value in saved:
        return Buffer(value, size, SAVED, pinned_lifetime=(index, end - 1))
    return Buffer(value, size, TRANSIENT)


def _part_offset(node: Node, position: int, own) -> int:
    """Where the `position`-th part of a split starts, read as contiguous parts."""
    if node.target != "split":
        return 0
    return sum(_bytes(own[o]) for o in node.outputs[:position] if o in own)


def _keep_outputs(function: Function, buffers: dict, count: int, ops) -> None:
    """A function's outputs belong to its caller: they live from the op that makes them to
    the function's end (an output that is a view keeps the buffer it views)."""
    produced = {value: op.index for op in ops for value in op.outputs}
    for value in function.outputs:
        buffer = buffers.get(value)
        while buffer is not None and buffer.alias_of is not None:
            value, buffer = buffer.alias_of, buffers.get(buffer.alias_of)
        if buffer is not None and buffer.region == TRANSIENT:
            start = produced.get(value, 0)
            buffers[value] = Buffer(value, buffer.size_bytes, TRANSIENT,
                                    pinned_lifetime=(start, count - 1))


def _kind(node: Node) -> str:
    if node.target in ALIASES:
        return "view"
    return "elementwise" if node.target in IN_PLACE else "other"


def _is_param_grad(function: Function, value: str) -> bool:
    return any(g == value for _, g in function.param_grads)


def _saved_by_backward(graph: Graph, function: Function) -> set[str]:
    backward = next((f for f in graph.functions if f.gradient_of == function.name), None)
    return set(backward.saved) if backward is not None else set()


def saved_values(graph: Graph, function: Function) -> set[str]:
    """The values of `function` (its own, not its inputs) some backward reads: its own
    backward's, arguments of calls whose callee saves that input, and, for a function
    called repeatedly, outputs that feed the next repetition's saved inputs."""
    own = {v.id for v in function.values}
    saved = _saved_by_backward(graph, function) & own
    for node in function.nodes:
        # a repeated call too: its first repetition reads the caller's argument
        if node.kind == "call":
            kept = saved_input_positions(graph, node.target)
            saved |= {a for i, a in enumerate(node.inputs) if i in kept and a in own}
    if _called_repeatedly(graph, function.name):
        kept = saved_input_positions(graph, function.name)
        saved |= {o for i, o in enumerate(function.outputs) if i in kept and o in own}
    return saved


def saved_input_positions(graph: Graph, name: str) -> set[int]:
    """Positions of the inputs of function `name` its backward (or a callee's) reads."""
    function = graph.function(name)
    needed = _saved_by_backward(graph, function)
    for node in function.nodes:
        if node.kind == "call":
            kept = saved_input_positions(graph, node.target)
            needed |= {a for i, a in enumerate(node.inputs) if i in kept}
    return {i for i, value in enumerate(function.inputs) if value.id in needed}


def _called_repeatedly(graph: Graph, name: str) -> bool:
    return any(n.kind == "call" and n.target == name and int(n.repeat) > 1
               for f in graph.functions for n in f.nodes)


def _forward_name(function: Function) -> str:
    return function.gradient_of or function.name


def _add_saved(step: StepPlan, region, invocations: int) -> None:
    if region is None:
        return
    totals = step.regions.setdefault(SAVED, RegionTotals())
    totals.arena += region.arena_bytes * invocations
    totals.lower_bound += region.lower_bound_bytes * invocations
    totals.naive += region.naive_bytes * invocations
    totals.greedy_by_size += region.baselines.get("greedy_by_size", region.arena_bytes) * invocations
    totals.exact_size_reuse += region.baselines.get("exact_size_reuse", region.arena_bytes) \
        * invocations


# ====================================================================== the step
def _invocations(graph: Graph) -> dict[str, int]:
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for node in graph.function(name).nodes:
            if node.kind == "call":
                visit(node.target, times * int(node.repeat))

    visit(graph.entry, 1)
    if graph.backward:
        visit(graph.backward, 1)
    return counts


def _callees_first(graph: Graph) -> list[Function]:
    order, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for node in graph.function(name).nodes:
            if node.kind == "call":
                visit(node.target)
        order.append(graph.function(name))

    for entry in (graph.entry, graph.backward):
        if entry:
            visit(entry)
    return order


def _fixed_regions(graph: Graph, step: StepPlan) -> None:
    weights = gradients = elements = 0
    for function in graph.functions:
        if function.gradient_of:
            continue
        times = step.invocations.get(function.name, 0)
        for param in function.params:
            # a submodule's parameter read as `ln1.weight` is counted here: the submodule
            # itself is not called, so no function of its own holds it
            count = _elements(param)
            weights += times * round_up(count * _dtype_bytes(param.dtype), 256)
            if param.id not in function.no_gradient:
                gradients += times * round_up(count * _dtype_bytes(param.dtype), 256)
                elements += times * count
    for name, total in ((WEIGHTS, weights), (GRADIENTS, gradients),
                        (OPTIMIZER_STATE, elements * OPTIMIZER_BYTES_PER_PARAM)):
        step.regions[name] = RegionTotals(total, total, total, total, total)


def _elements(value) -> int:
    try:
        return prod(int(d) for d in value.shape)
    except ValueError:
        raise ShapeUnknown(f"`{value.name or value.id}` has shape [{', '.join(value.shape)}]; "
                           "give the free dims sizes with --shape") from None


def _bytes(value) -> int:
    count = _elements(value)
    if value.dtype in HALF_BYTE:
        return -(-count // 2)
    return count * _dtype_bytes(value.dtype)


def _dtype_bytes(dtype: str) -> int:
    return BYTES.get(dtype, 2)
