"""Pipeline parallel (spec §7.6.2, `@partition`) as Schedule IR data: the
`schedule["pipeline"]` section (docs/pipeline.md; docs/build-output.md).

The forward of the entry function is a sequence of *units*: each of its nodes, except a
repeated call (`StackedBlocks(blocks, n)`, `blocks[0:8]()`), which is one unit per
repetition (a layer). A stage is a contiguous range of units. The split comes from the
model's `@partition(stage)` annotations (a unit without one is in the stage of the unit
before it; the first ones in stage 0), or, without annotations, from `--pp P`: the
contiguous split into P stages whose slowest stage is fastest (forward + backward time of
the cost model, modulec.plan.cost).

Stage s sends to stage s + 1, per micro-batch, every tensor made at or before s and read
after s (a tensor skipping a stage is carried through it: sends are between neighbours
only), and receives their gradients back (not for integer tensors). Step inputs are read
by every stage that needs them from the data loader, never sent; parameters never move.
The entry's outputs are read by the last stage, where the loss is: one made earlier (an
auxiliary loss computed before the final norm and head) is carried there, and its
gradient (the loss's seed) back. The section's `outputs` say how the loss takes each: the
logits by cross-entropy, a 0-d floating output as an auxiliary loss (the MoE
load-balancing loss, whose router statistics reach it as the stack's carried tensor).

The schedule is 1F1B (PipeDream-Flush, as Megatron-LM runs it): stage s of P runs
min(P - s - 1, M) warm-up forwards, then pairs of one forward and one backward, then the
remaining backwards (cool-down). A forward of micro-batch m is `recv` (activations from
s - 1), `forward`, `send` (to s + 1); a backward is `recv` (gradients from s + 1),
`backward`, `send` (to s - 1). Compute runs on stream 0, sends and receives on stream 2;
a `recv` completes before the stage's next op starts, a `send` does not hold the stage
(an isend). Gradients add up over the M micro-batches; the optimizer steps once after the
last backward. With `dp` pipelines (data parallel over them), the section's `mesh` says
the sizes and each stage's op list ends in the all-reduces of its gradients over its
data-parallel group (modulec.plan.pipeline_dp). A parameter two stages read (a tied
LM head reading the embedding) or two paths name (`tied_to`) is one `shared` entry: each
of its stages holds a copy, and their gradients are summed over those stages before the
optimizer steps (modulec.plan.pipeline_shared).
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.ir.graph import COMM_STREAM as COMM, COMPUTE_STREAM as COMPUTE
from modulec.plan.cost import function_seconds, node_cost, value_table
from modulec.plan.devices import Device, H100
from modulec.plan.from_graph import _bytes
from modulec.plan.pipeline_dp import add_data_parallel

SCHEDULE = "1f1b"
MICROBATCHES_PER_STAGE = 4  # default M = 4 * P: the ideal bubble (P-1)/(M+P-1) under 20 %


class PipelineError(ValueError):
    """A split that cannot be made (more stages than units, --pp against @partition)."""


@dataclass(frozen=True)
class Unit:
    node: str                 # the entry node
    target: str
    layer: int | None         # repetition of a repeated call (0-based), else None
    block: int | None         # the layer's index in its array (`first` + layer)
    stage: int | None         # from `@partition`, else None
    forward_s: float          # predicted forward time of one micro-batch
    backward_s: float         # and its backward

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s
    reads: tuple              # tensors it reads: (name, ValueInfo)
    writes: tuple             # tensors it makes


@dataclass(frozen=True)
class Pipeline:
    stages: int | None = None   # --pp; None: from the model's @partition annotations
    microbatches: int | None = None  # --microbatches; None: 4 * stages
    dp: int = 1  # data-parallel pipelines (modulec.plan.pipeline_dp)
    zero: int = 0  # 1: the optimizer state of a stage sharded over its DP group by bucket
    tp: int = 1  # each stage a tensor-parallel rank program of tp ranks (the mesh's tp)

    def __post_init__(self):
        if self.dp < 1:
            raise ValueError(f"the data-parallel size must be at least 1, not {self.dp}")
        if self.tp < 1:
            raise ValueError(f"the tensor-parallel size must be at least 1, not {self.tp}")
        if self.zero not in (0, 1):
            raise ValueError(f"a pipeline shards with ZeRO 0 or 1, not {self.zero}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"the pipeline needs at least 1 stage, not {self.stages}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"at least 1 micro-batch, not {self.microbatches}")


def pipeline_zero(zero, dp: int) -> int:
    """The ZeRO stage of a pipeline section for a requested `zero` (--zero: None, 0-3 or
    auto) over `dp` data-parallel pipelines: 1 (each stage's optimizer state sharded over
    its replicas by bucket) for ZeRO-1 over more than one pipeline, else 0 (one pipeline
    has no replicas to shard over; ZeRO 2-3 and auto have no pipeline form: `modulec
    build` writes their `distributed` section beside it, which `modulec train` refuses)."""
    return 1 if zero == 1 and dp > 1 else 0


def has_partition(graph) -> bool:
    return any(_stage_of(n) is not None for n in graph.function(graph.entry).nodes)


def pipeline_section(graph, options: Pipeline, device: Device = H100,
                     training: str = "full", ties: dict | None = None) -> dict:
    """The `pipeline` section of `graph` (built at one micro-batch's shape). `ties`: the
    weight schema's tied parameter paths -> their targets (modulec.plan.pipeline_shared
    .schema_ties), whose tensors the stages share."""
    from modulec.ir.verify_parallel import parameter_shapes
    from modulec.plan.pipeline_shared import shared_parameters

    units = entry_units(graph, device, training)
    stages = _split(units, options.stages)
    count = max(stages) + 1
    micro = options.microbatches or MICROBATCHES_PER_STAGE * count
    outputs = entry_outputs(graph)
    boundaries = [_boundary(units, stages, s, outputs) for s in range(count - 1)]
    section = {"stages": [_stage(graph, units, stages, s) for s in range(count)],
               "microbatches": micro, "schedule": SCHEDULE,
               "split": "partition" if any(u.stage is not None for u in units) else "balanced",
               "streams": {"compute": COMPUTE, "comm": COMM},
               "boundaries": boundaries,
               "outputs": _outputs(graph, units, stages, outputs),
               "ops": [one_f_one_b(s, count, micro) for s in range(count)]}
    section["shared"] = shared_parameters(section["stages"], ties or {},
                                          parameter_shapes(graph))
    zero = pipeline_zero(options.zero, options.dp)
    return add_data_parallel(section, graph, options.dp, zero, options.tp)


# ---------------------------------------------------------------------- units
def entry_units(graph, device: Device = H100, training: str = "full") -> list[Unit]:
    entry = graph.function(graph.entry)
    table = value_table(graph, entry)
    memo: dict = {}
    units, carried = [], {}
    op_seconds = {n.id: node_cost(table, n, training).seconds(device)
                  for n in entry.nodes if n.kind == "op"}
    scale = _entry_backward_scale(graph, op_seconds, device, training, memo)
    for node in entry.nodes:
        if node.kind == "call":
            units += _layers(graph, node, entry, device, training, memo)
        elif node.kind == "op":
            units.append(Unit(node.id, node.target, None, None, _stage_of(node),
                              op_seconds[node.id], op_seconds[node.id] * scale,
                              _named(entry, node.inputs), _named(entry, node.outputs)))
        else:  # an alias: the output is the input, made where the input is
            carried.update(zip(node.outputs, node.inputs))
    return _resolve_aliases(units, carried)


def _layers(graph, node, entry, device, training, memo) -> list[Unit]:
    callee = graph.function(node.target)
    backward = next((f.name for f in graph.functions if f.gradient_of == callee.name), None)
    forward = function_seconds(graph, callee.name, device, training, memo)
    back = function_seconds(graph, backward, device, training, memo) if backward else 0.0
    first = node.attr("first")
    count = int(node.repeat)
    units, reads = [], _named(entry, node.inputs)
    for layer in range(count):
        last = layer == count - 1
        writes = _named(entry, node.outputs) if last else tuple(
            (f"{node.id}[{layer}].{k}", callee.value(o)) for k, o in enumerate(callee.outputs))
        units.append(Unit(node.id, node.target, layer,
                          None if first is None else int(first) + layer, _stage_of(node),
                          forward, back, reads, writes))
        reads = writes
    return units


def _entry_backward_scale(graph, op_seconds, device, training, memo) -> float:
    """The entry backward's own ops (not its calls), as a share of the entry's forward ops:
    each forward op's backward is taken as that share of its forward time."""
    if not graph.backward or not sum(op_seconds.values()):
        return 0.0
    backward = graph.function(graph.backward)
    table = value_table(graph, backward)
    own = sum(node_cost(table, n, training).seconds(device)
              for n in backward.nodes if n.kind == "op")
    return own / sum(op_seconds.values())


def unit_stages(section: dict) -> dict[tuple, int]:
    """Each unit of the section's stages -> its stage, by (entry node id, layer): a
    repeated call's layers one by one (0-based), another node with layer None."""
    stage_of = {}
    for s, row in enumerate(section["stages"]):
        for unit in row["units"]:
            lo, hi = unit.get("layers", (None, None))
            for layer in ([None] if lo is None else range(lo, hi + 1)):
                stage_of[(unit["node"], layer)] = s
    return stage_of


def entry_outputs(graph) -> list[str]:
    """The entry's outputs, in order, each by the value that makes it (an alias's
    input)."""
    entry = graph.function(graph.entry)
    carried = {n.outputs[0]: n.inputs[0] for n in entry.nodes if n.kind == "alias"}
    resolved = []
    for value in entry.outputs:
        while value in carried:
            value = carried[value]
        resolved.append(value)
    return resolved


def _named(function, ids) -> tuple:
    return tuple((i, function.value(i)) for i in ids if i and function.value(i) is not None)


def _resolve_aliases(units: list[Unit], carried: dict) -> list[Unit]:
    if not carried:
        return units
    return [Unit(u.node, u.target, u.layer, u.block, u.stage, u.forward_s, u.backward_s,
                 tuple((carried.get(n, n), v) for n, v in u.reads), u.writes) for u in units]


def _stage_of(node) -> int | None:
    for name, args in node.annotations:
        if name == "partition" and args:
            text = args[0].split("=", 1)[-1].strip()
            try:
                return int(text)
            except ValueError:  # `check` cannot know a named stage's number
                file, line, _ = node.span
                raise PipelineError(f"`@partition({text})` at {file}:{line}: a pipeline "
                                    "stage must be an integer literal") from None
    return None


# ---------------------------------------------------------------------- split
def _split(units: list[Unit], stages: int | None) -> list[int]:
    annotated = any(u.stage is not None for u in units)
    if annotated:
        split = annotated_split(units)
        if stages is not None and stages != max(split) + 1:
            raise PipelineError(f"`--pp {stages}` but the model's @partition annotations "
                                f"make {max(split) + 1} stages")
        return split
    return balanced_split([u.seconds for u in units], stages or 1)


def annotated_split(units: list[Unit]) -> list[int]:
    stages, current = [], 0
    for unit in units:
        current = unit.stage if unit.stage is not None else current
        if stages and current < stages[-1]:
            raise PipelineError(f"node `{unit.node}` is in stage {current} after stage "
                                f"{stages[-1]}: a stage is a contiguous range of the forward")
        stages.append(current)
    if sorted(set(stages)) != list(range(max(stages) + 1)):
        raise PipelineError(f"stages {sorted(set(stages))} are not numbered 0, 1, ... "
                            "without gaps")
    return stages


def balanced_split(seconds: list[float], stages: int) -> list[int]:
    """The stage of each unit: contiguous ranges, the slowest range as fast as can be
    (linear partition by dynamic programming; ties keep earlier stages shorter)."""
    n = len(seconds)
    if stages > n:
        raise PipelineError(f"{stages} pipeline stages, but the forward has only {n} units "
                            "(layers and entry operations) to place")
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the slowest stage when units[:i] form k stages; cut[k][i]: where the
    # last of them starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = worst, j
    split, end = [0] * n, n
    for k in range(stages, 0, -1):
        start = cut[k][end]
        split[start:end] = [k - 1] * (end - start)
        end = start
    return split


# ---------------------------------------------------------------------- stages
def _stage(graph, units, stages, s) -> dict:
    mine = [u for u, st in zip(units, stages) if st == s]
    rows: list[dict] = []
    for unit in mine:
        if rows and rows[-1]["node"] == unit.node and unit.layer is not None:
            rows[-1]["layers"][1] = unit.layer
            continue
        row = {"node": unit.node, "target": unit.target}
        if unit.layer is not None:
            row["layers"] = [unit.layer, unit.layer]
        rows.append(row)
    for row in rows:  # absolute block indices of the array, where the call names one
        if "layers" in row:
            first = next(u.block for u in mine if u.node == row["node"])
            if first is not None:
                row["blocks"] = [first, first + row["layers"][1] - row["layers"][0]]
    return {"stage": s, "units": rows, "params": _stage_params(graph, rows),
            "forward_s": sum(u.forward_s for u in mine),
            "backward_s": sum(u.backward_s for u in mine)}


def _stage_params(graph, rows) -> list[str]:
    """The parameter paths a stage's ranks hold (`blocks[3].attention.qkv_weight`)."""
    entry = graph.function(graph.entry)
    nodes = {n.id: n for n in entry.nodes}
    paths: list[str] = []
    for row in rows:
        node = nodes[row["node"]]
        if node.kind == "op":
            paths += [i[len("param:"):] for i in node.inputs if i.startswith("param:")]
            continue
        name, first = node.attr("instance", ""), node.attr("first")
        lo, hi = row.get("layers", [0, 0])
        for layer in range(lo, hi + 1):
            prefix = name if first is None else f"{name}[{int(first) + layer}]"
            paths += _param_paths(graph, graph.function(node.target), prefix)
    return list(dict.fromkeys(paths))


def _param_paths(graph, function, prefix: str) -> list[str]:
    join = (lambda n: f"{prefix}.{n}" if prefix else n)
    paths = [join(p.id[len("param:"):]) for p in function.params]
    for node in function.nodes:
        if node.kind != "call":
            continue
        name, first = node.attr("instance", ""), node.attr("first")
        for layer in range(int(node.repeat)):
            inner = name if first is None else f"{name}[{int(first) + layer}]"
            paths += _param_paths(graph, graph.function(node.target), join(inner))
    return paths


def _made(units, stages) -> dict:
    """Each value the units make -> (its stage, its ValueInfo)."""
    made = {}
    for unit, st in zip(units, stages):
        for name, info in unit.writes:
            made.setdefault(name, (st, info))
    return made


def _boundary(units, stages, s, outputs=()) -> dict:
    """What crosses from stage s to s + 1: tensors made at or before s, read after s; the
    entry's `outputs` count as read by the last stage (the loss is there)."""
    made = _made(units, stages)
    crossing = {}
    for unit, st in zip(units, stages):
        for name, _ in unit.reads:
            if st > s and name in made and made[name][0] <= s:
                crossing.setdefault(name, made[name][1])
    for name in outputs:
        if name in made and made[name][0] <= s:
            crossing.setdefault(name, made[name][1])
    tensors = [{"value": n, "shape": [int(d) for d in v.shape], "dtype": v.dtype,
                "bytes": _bytes(v), "gradient": not v.dtype.startswith(("int", "uint", "bool"))}
               for n, v in crossing.items()]
    return {"from": s, "to": s + 1, "tensors": tensors,
            "activation_bytes": sum(t["bytes"] for t in tensors),
            "gradient_bytes": sum(t["bytes"] for t in tensors if t["gradient"])}


def _outputs(graph, units, stages, outputs) -> list[dict]:
    """The entry's outputs as the last stage's loss takes them: the first (the logits)
    by cross-entropy, a 0-d floating one as an auxiliary loss (added, gradient seed 1:
    runtime/train/aux_loss.py's rule), any other by nothing; `stage`: where it is made
    (one made before the last stage crosses every boundary after it)."""
    made, entry = _made(units, stages), graph.function(graph.entry)
    rows = []
    for index, (name, value) in enumerate(zip(entry.outputs, outputs)):
        info = entry.value(name)
        auxiliary = not info.shape and not info.dtype.startswith(("int", "uint", "bool"))
        loss = "cross_entropy" if index == 0 else "auxiliary" if auxiliary else "none"
        rows.append({"name": info.name or name, "value": value,
                     "stage": made[value][0] if value in made else len(set(stages)) - 1,
                     "loss": loss})
    return rows


# ---------------------------------------------------------------------- 1F1B
def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[dict]:
    """The ops of one stage, in order (the module docstring)."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("forward", m, "warmup") for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("forward", warmup + i, "steady"), ("backward", i, "steady")]
    order += [("backward", m, "cooldown") for m in range(microbatches - warmup, microbatches)]
    ops: list[dict] = []
    for kind, m, phase in order:
        ops += _compute_ops(kind, m, phase, stage, stages)
    return ops


def _compute_ops(kind: str, m: int, phase: str, stage: int, stages: int) -> list[dict]:
    forward = kind == "forward"
    what = "activations" if forward else "gradients"
    source, target = (stage - 1, stage + 1) if forward else (stage + 1, stage - 1)
    ops = []
    if 0 <= source < stages:
        ops.append({"kind": "recv", "what": what, "peer": source, "microbatch": m,
                    "phase": phase, "stream": COMM})
    ops.append({"kind": kind, "microbatch": m, "phase": phase, "stream": COMPUTE})
    if 0 <= target < stages:
        ops.append({"kind": "send", "what": what, "peer": target, "microbatch": m,
                    "phase": phase, "stream": COMM})
    return ops
