"""`modulec ir verify` for the Schedule IR's `distributed` and `pipeline` sections
(docs/build-output.md): what a runtime on several GPUs relies on, checked against the
document's graph. Every problem is a message, never a traceback.

distributed: the mesh, ZeRO stage, streams and alignment are well-formed; each bucket's
parameters exist in the graph, in every instance, with the bucket's shapes, at aligned
offsets that do not overlap and lie inside the bucket; the bucket's size is a multiple of
dp x align and its shard is size / dp; no parameter is in two buckets; every op has a
known trigger, kind and stream and the fields its kind needs; under ZeRO-3 every entry
bucket lists its gather windows; a `gradient_slot` (a slot shared by entry buckets) is
on entry buckets only; walking one step (per bucket: step_begin, forward_begin
per instance, for an entry bucket also the first and last repeated layer's, then last
instance first backward_begin and gradients_ready, then step_end), every `wait_event`
finds its event recorded before (a wait for a shared slot's `previous` user is resolved
at run time: the runtime waits only for a bucket that used the slot earlier in the step;
with a shared slot that wait, on `reduced`, comes before gradients_ready's copy_in).

pipeline: the mesh's pp is the stage count, its tp the tensor_parallel section's size
(1 without: each stage is that TP rank program); the data-parallel buckets and ops
(modulec.ir.verify_pipeline_dp); the parameters the stages share and their all-reduces
(modulec.ir.verify_pipeline_shared); the stages cover the entry's forward in order, each
a contiguous range; each stage runs the forward and then the backward of every micro-batch
once; sends and
receives go between neighbours, carry activations forward and gradients back, on the
comm stream, and match one for one in order; the schedule runs to the end (no deadlock).
"""

from __future__ import annotations

from modulec.ir.graph import Graph
from modulec.ir.verify_pipeline_dp import UPDATE_KINDS as DP_UPDATE_KINDS  # pipelines

TRIGGERS = ("step_begin", "forward_begin", "backward_begin", "gradients_ready", "step_end")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "copy_in")
DP_KINDS = COLLECTIVES + ("adamw_shard", "record_event", "wait_event", "allocate", "release")
WINDOWS = ("start", "end", "step")  # modulec.plan.distributed
WHAT = ("gradients", "weights")
PP_KINDS = ("forward", "backward", "send", "recv") + DP_UPDATE_KINDS


def verify_parallel(schedule: dict, graph: Graph) -> list[str]:
    problems = []
    if "distributed" in schedule:
        problems += [f"schedule.distributed: {m}"
                     for m in _guarded(verify_distributed, schedule["distributed"], graph)]
    if "pipeline" in schedule:
        tp = schedule.get("tensor_parallel")
        size = tp.get("size", 1) if isinstance(tp, dict) else 1
        problems += [f"schedule.pipeline: {m}"
                     for m in _guarded(verify_pipeline, schedule["pipeline"], graph, size)]
    return problems


def _guarded(check, section, graph, *more) -> list[str]:
    try:
        return check(section, graph, *more)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return [f"malformed: {type(exc).__name__}: {exc}"]


# ====================================================================== distributed
def verify_distributed(section, graph: Graph) -> list[str]:
    problems = _dp_header(section)
    if problems:
        return problems
    shapes = parameter_shapes(graph)
    owner: dict = {}
    for index, bucket in enumerate(section["buckets"]):
        problems += [f"bucket {index} `{bucket.get('name', '?')}`: {m}"
                     for m in _bucket(bucket, section, shapes, owner)]
    streams = set(section["streams"].values())
    for index, op in enumerate(section["ops"]):
        problems += [f"op {index} ({op.get('on')} {op.get('kind')}): {m}"
                     for m in _dp_op(op, streams)]
    if not problems:
        problems += _events(section) + _slot_wait(section)
    return problems


def _slot_wait(section) -> list[str]:
    """Buckets sharing a gradient slot: before gradients_ready's copy_in, the compute
    stream waits for the reduction (`reduced`) of the slot's previous user (`previous:
    gradient_slot`); without it a copy overwrites a slot still being reduced."""
    if not any("gradient_slot" in b for b in section["buckets"]):
        return []
    ready = [op for op in section["ops"] if op["on"] == "gradients_ready"]
    copy = next((k for k, op in enumerate(ready) if op["kind"] == "copy_in"), len(ready))
    if any(op.get("previous") == "gradient_slot" and op.get("event") == "reduced" and
           op["stream"] == section["streams"]["compute"] and op.get("only") != "layered" and
           "window" not in op and "instance" not in op for op in ready[:copy]):
        return []
    return ["buckets share a gradient slot, but no wait_event `reduced` with `previous: "
            "gradient_slot` on the compute stream comes before gradients_ready's copy_in"]


def _dp_header(section) -> list[str]:
    if not isinstance(section, dict):
        return ["expected an object"]
    missing = [k for k in ("mesh", "zero", "streams", "align", "buckets", "ops")
               if k not in section]
    if missing:
        return [f"missing keys: {', '.join(missing)}"]
    problems = []
    mesh = section["mesh"]
    if not isinstance(mesh, dict) or set(mesh) != {"dp", "tp", "pp"} or not all(
            _positive(v) for v in mesh.values()):
        problems.append(f"`mesh` must be {{dp, tp, pp}} of positive integers, not {mesh!r}")
    if section["zero"] not in (0, 1, 2, 3):
        problems.append(f"`zero` must be 0, 1, 2 or 3, not {section['zero']!r}")
    if not _positive(section["align"]):
        problems.append(f"`align` must be a positive integer, not {section['align']!r}")
    streams = section["streams"]
    if not isinstance(streams, dict) or set(streams) != {"compute", "comm"} or \
            len(set(streams.values())) != 2:
        problems.append(f"`streams` must name two different streams compute and comm, not "
                        f"{streams!r}")
    if not isinstance(section["buckets"], list) or not isinstance(section["ops"], list):
        problems.append("`buckets` and `ops` must be lists")
    return problems


def _bucket(bucket, section, shapes: dict, owner: dict) -> list[str]:
    dp, align = section["mesh"]["dp"], section["align"]
    count, first = bucket["instances"], bucket["first"]
    problems = []
    if not _positive(count) or not isinstance(first, int) or first < 0:
        return [f"`instances` {count!r} and `first` {first!r} must be integers (>= 1, >= 0)"]
    if bucket["numel"] % (dp * align):
        problems.append(f"numel {bucket['numel']} is not a multiple of dp x align = "
                        f"{dp * align}")
    if bucket["shard"] * dp != bucket["numel"]:
        problems.append(f"shard {bucket['shard']} x dp {dp} != numel {bucket['numel']}")
    end = 0
    for param in bucket["params"]:
        name, offset, numel = param["name"], param["offset"], param["numel"]
        if offset % align:
            problems.append(f"`{name}` at offset {offset}, not a multiple of {align}")
        if offset < end:
            problems.append(f"`{name}` at offset {offset} overlaps the parameter before it "
                            f"(which ends at {end})")
        if numel != _product(param["shape"]):
            problems.append(f"`{name}`: numel {numel} for shape {param['shape']}")
        end = offset + numel
        for instance in range(count):
            problems += _param_exists(bucket, first + instance, param, shapes, owner)
    if end > bucket["numel"]:
        problems.append(f"the parameters end at {end}, past numel {bucket['numel']}")
    slot = bucket.get("gradient_slot")
    if slot is not None and (not isinstance(slot, str) or "{i}" in bucket["path"] or
                             count != 1):
        problems.append(f"`gradient_slot` {slot!r}: a name, on an entry bucket only")
    windows = bucket.get("windows")
    if section["zero"] == 3 and "{i}" not in bucket["path"] and (
            not isinstance(windows, list) or not windows or
            not set(windows) <= set(WINDOWS)):
        problems.append(f"an entry bucket's `windows` must list some of "
                        f"{', '.join(WINDOWS)}, not {windows!r}")
    return problems


def _param_exists(bucket, index: int, param, shapes: dict, owner: dict) -> list[str]:
    template = bucket["path"].replace("{i}", str(index))
    path = f"{template}.{param['name']}" if template else param["name"]
    if path not in shapes:
        return [f"`{path}` is not a parameter of the graph"]
    if list(shapes[path]) != list(param["shape"]):
        return [f"`{path}` has shape {list(shapes[path])} in the graph, "
                f"{list(param['shape'])} in the bucket"]
    if path in owner:
        return [f"`{path}` is also in bucket `{owner[path]}`"]
    owner[path] = bucket["name"]
    return []


def _dp_op(op, streams: set) -> list[str]:
    if not isinstance(op, dict):
        return ["expected an object"]
    problems = []
    if op.get("on") not in TRIGGERS:
        problems.append(f"unknown trigger `{op.get('on')}` (known: {', '.join(TRIGGERS)})")
    if op.get("kind") not in DP_KINDS:
        problems.append(f"unknown kind `{op.get('kind')}` (known: {', '.join(DP_KINDS)})")
    if op.get("stream") not in streams:
        problems.append(f"stream {op.get('stream')!r} is neither the compute nor the comm "
                        "stream")
    if op.get("kind") in ("record_event", "wait_event") and not isinstance(op.get("event"),
                                                                            str):
        problems.append("an event op needs `event`")
    if op.get("kind") in COLLECTIVES and op.get("what") not in WHAT:
        problems.append(f"`what` must be gradients or weights, not {op.get('what')!r}")
    if op.get("only") not in (None, "layered", "entry"):
        problems.append(f"`only` must be layered or entry, not {op.get('only')!r}")
    if op.get("kind") in ("allocate", "release") and op.get("only") != "entry":
        problems.append(f"`{op.get('kind')}` is for entry buckets (only: entry)")
    if op.get("window", "step") not in WINDOWS:
        problems.append(f"`window` must be one of {', '.join(WINDOWS)}, not "
                        f"{op.get('window')!r}")
    if op.get("at") is not None and (op.get("at") not in ("first", "last") or
                                     op.get("on") != "forward_begin" or
                                     op.get("only") != "entry"):
        problems.append("`at` (first or last) is for an entry bucket's forward_begin ops")
    if op.get("previous") is not None and (op.get("previous") != "gradient_slot" or
                                           op.get("kind") != "wait_event"):
        problems.append("`previous` (gradient_slot) is for a wait_event: the event of the "
                        "bucket that used the shared gradient slot last")
    if not isinstance(op.get("instance", 0), int):
        problems.append(f"`instance` must be an integer, not {op.get('instance')!r}")
    return problems


def _events(section) -> list[str]:
    """Walk one step per bucket; every wait must follow the record of its event."""
    by_trigger: dict = {t: [op for op in section["ops"] if op["on"] == t] for t in TRIGGERS}
    any_layered = any("{i}" in b["path"] for b in section["buckets"])
    problems: list[str] = []
    for bucket in section["buckets"]:
        layered = "{i}" in bucket["path"]
        count = bucket["instances"]
        recorded: set = set()
        walk = [("step_begin", 0, None)] + [("forward_begin", i, None) for i in range(count)]
        if not layered and any_layered:  # the first and the last layer's forward_begin
            walk += [("forward_begin", 0, "first"), ("forward_begin", 0, "last")]
        for i in reversed(range(count)):
            walk += [("backward_begin", i, None), ("gradients_ready", i, None)]
        walk.append(("step_end", 0, None))
        for trigger, i, at in walk:
            for op in by_trigger[trigger]:
                if not _applies(op, bucket, layered) or op.get("at") != at or \
                        op.get("previous") is not None:  # another bucket's event: at run time
                    continue
                target = i + op.get("instance", 0)
                if not 0 <= target < count:
                    continue
                key = (op.get("event"), target)
                if op["kind"] == "record_event":
                    recorded.add(key)
                elif op["kind"] == "wait_event" and key not in recorded:
                    problems.append(f"bucket `{bucket['name']}`: at {trigger} of instance {i}, "
                                    f"wait_event `{key[0]}` of instance {target} was never "
                                    "recorded before")
    return list(dict.fromkeys(problems))


def _applies(op: dict, bucket: dict, layered: bool) -> bool:
    """Whether `op` runs for `bucket` (its `only` and `window`)."""
    if op.get("only") == ("entry" if layered else "layered"):
        return False
    return op.get("window") is None or op["window"] in bucket.get("windows", ())


def parameter_shapes(graph: Graph) -> dict:
    """Every parameter path of the model with its shape (ints where sized)."""
    return {path: [int(d) if str(d).isdigit() else d for d in p.shape]
            for path, p, _ in parameters(graph)}


def frozen_paths(graph: Graph) -> set[str]:
    """The parameter paths with no gradient (`no_gradient` of their function: `@frozen`,
    a LoRA program's base weights): in no gradient bucket."""
    return {path for path, p, function in parameters(graph) if p.id in function.no_gradient}


def parameters(graph: Graph) -> list[tuple]:
    """(path, parameter value, its function) of every parameter of the model."""
    found: list = []

    def visit(function, prefix: str, depth: int) -> None:
        if depth > 64:
            return
        for p in function.params:
            name = p.id[len("param:"):]
            found.append((f"{prefix}.{name}" if prefix else name, p, function))
        for node in function.nodes:
            if node.kind != "call":
                continue
            name, first = node.attr("instance", ""), node.attr("first")
            repeat = node.repeat if isinstance(node.repeat, int) else 1
            for layer in range(repeat):
                inner = name if first is None else f"{name}[{int(first) + layer}]"
                visit(graph.function(node.target),
                      f"{prefix}.{inner}" if prefix and inner else prefix or inner, depth + 1)

    visit(graph.function(graph.entry), "", 0)
    return found


# ====================================================================== pipeline
def verify_pipeline(section, graph: Graph, tp: int = 1) -> list[str]:
    """`tp`: the document's tensor-parallel size (its `tensor_parallel` section's; 1
    without), which the mesh must say: each stage is that rank program."""
    if not isinstance(section, dict):
        return ["expected an object"]
    missing = [k for k in ("stages", "microbatches", "boundaries", "ops", "streams", "mesh")
               if k not in section]
    if missing:
        return [f"missing keys: {', '.join(missing)}"]
    count, micro = len(section["stages"]), section["microbatches"]
    if not count or not _positive(micro):
        return [f"{count} stages and {micro!r} micro-batches: both must be at least 1"]
    problems = _pp_mesh(section["mesh"], count, tp)
    if problems:
        return problems
    problems = _coverage(section["stages"], graph)
    if not problems:
        from modulec.ir.verify_pipeline_dp import verify_reductions

        from modulec.ir.verify_pipeline_shared import verify_shared

        shapes, frozen = parameter_shapes(graph), frozen_paths(graph)
        problems += verify_shared(section, shapes, frozen) or \
            verify_reductions(section, shapes, frozen)
    if len(section["ops"]) != count:
        problems.append(f"{len(section['ops'])} op lists for {count} stages")
    if len(section["boundaries"]) != count - 1 or any(
            (b["from"], b["to"]) != (s, s + 1) for s, b in enumerate(section["boundaries"])):
        problems.append("`boundaries` must list stage s -> s + 1 for each s, in order")
    for stage, ops in enumerate(section["ops"]):
        problems += [f"stage {stage}: {m}" for m in _stage_ops(stage, ops, count, micro,
                                                                 section["streams"])]
    if not problems:
        from modulec.ir.verify_pipeline_outputs import verify_outputs

        problems += verify_outputs(section, graph) or _matched(section["ops"]) or \
            _runs(section)
    return problems


def _pp_mesh(mesh, count: int, tp: int = 1) -> list[str]:
    if not isinstance(mesh, dict) or set(mesh) != {"dp", "tp", "pp"} or not all(
            _positive(v) for v in mesh.values()):
        return [f"`mesh` must be {{dp, tp, pp}} of positive integers, not {mesh!r}"]
    if mesh["pp"] != count:
        return [f"`mesh` says pp {mesh['pp']}, but the section has {count} stages"]
    if mesh["tp"] != tp:
        built = f"a tensor_parallel section of size {tp}" if tp > 1 else \
            "no tensor_parallel section (tp 1)"
        return [f"`mesh` says tp {mesh['tp']}, but the document's stages are built with "
                f"{built}"]
    return []


def _coverage(stages, graph: Graph) -> list[str]:
    """The stages' units, in order, are the entry's forward nodes, each repeated call's
    layers 0..repeat-1 in order."""
    expected = []
    for node in graph.function(graph.entry).nodes:
        if node.kind == "call":
            expected += [(node.id, layer) for layer in range(int(node.repeat))]
        elif node.kind == "op":
            expected.append((node.id, None))
    found, problems = [], []
    for index, stage in enumerate(stages):
        if stage.get("stage") != index:
            problems.append(f"stage {index} is numbered {stage.get('stage')!r}")
        for unit in stage["units"]:
            if "layers" in unit:
                lo, hi = unit["layers"]
                found += [(unit["node"], layer) for layer in range(lo, hi + 1)]
            else:
                found.append((unit["node"], None))
    if found != expected:
        problems.append("the stages' units are not the entry's forward nodes in order, each "
                        "once (a stage must be a contiguous range of layers)")
    return problems


def _stage_ops(stage: int, ops, count: int, micro: int, streams: dict) -> list[str]:
    problems, done = [], {"forward": set(), "backward": set()}
    for index, op in enumerate(ops):
        kind, m = op.get("kind"), op.get("microbatch")
        where = f"op {index} ({kind} {m})"
        if kind in DP_UPDATE_KINDS:  # checked with the stage's buckets (verify_pipeline_dp)
            continue
        if kind not in PP_KINDS:
            problems.append(f"{where}: unknown kind (known: {', '.join(PP_KINDS)})")
            continue
        if not isinstance(m, int) or not 0 <= m < micro:
            problems.append(f"{where}: micro-batch outside 0..{micro - 1}")
            continue
        stream = streams["compute" if kind in ("forward", "backward") else "comm"]
        if op.get("stream") != stream:
            problems.append(f"{where}: stream {op.get('stream')!r}, expected {stream}")
        if kind in done:
            if m in done[kind]:
                problems.append(f"{where}: runs twice")
            if kind == "backward" and m not in done["forward"]:
                problems.append(f"{where}: the backward before its forward")
            done[kind].add(m)
        else:
            problems += [f"{where}: {p}" for p in _p2p(stage, op, count)]
    for kind, seen in done.items():
        if seen != set(range(micro)):
            problems.append(f"the {kind} of micro-batches {sorted(set(range(micro)) - seen)} "
                            "never runs")
    return problems


def _p2p(stage: int, op, count: int) -> list[str]:
    forward = op.get("what") == "activations"
    if op.get("what") not in ("activations", "gradients"):
        return [f"`what` must be activations or gradients, not {op.get('what')!r}"]
    ahead = (op["kind"] == "send") == forward  # activations go up, gradients come down
    peer = stage + 1 if ahead else stage - 1
    if op.get("peer") != peer or not 0 <= peer < count:
        return [f"peer {op.get('peer')!r}: {op['what']} are {op['kind']} "
                f"{'to' if op['kind'] == 'send' else 'from'} stage {peer}"]
    return []


def _matched(stage_ops) -> list[str]:
    """Each link's sends and receives, micro-batch by micro-batch, in the same order."""
    sent: dict = {}
    received: dict = {}
    for stage, ops in enumerate(stage_ops):
        for op in ops:
            if op["kind"] == "send":
                sent.setdefault((stage, op["peer"], op["what"]), []).append(op["microbatch"])
            elif op["kind"] == "recv":
                received.setdefault((op["peer"], stage, op["what"]), []).append(
                    op["microbatch"])
    return [f"{what} from stage {a} to {b}: sent {sent.get((a, b, what), [])}, received "
            f"{received.get((a, b, what), [])}"
            for a, b, what in sorted(set(sent) | set(received))
            if sent.get((a, b, what)) != received.get((a, b, what))]


def _runs(section) -> list[str]:
    from modulec.plan.pipeline_sim import Deadlock, simulate

    try:
        simulate(section)
    except Deadlock as exc:
        return [str(exc)]
    return []


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _product(shape) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total
