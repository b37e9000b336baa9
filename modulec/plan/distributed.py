"""Data parallel with ZeRO sharding as Schedule IR data: the `schedule["distributed"]`
section a runtime executes as written (spec §7.6, §9.7.2; docs/distributed.md).

Every rank runs the whole graph on its own micro-batch. A trained parameter belongs to
one *bucket instance*: all parameters of one repetition of a repeated call (`blocks[3]`)
form one, and each parameter of the entry (embedding, final norm, LM head) is one of its
own, since their gradients become final at different times. A bucket instance is one flat
vector: each parameter at an offset aligned to `ALIGN` elements, the whole padded to a
multiple of `dp * ALIGN` so that rank r's *shard* is the contiguous slice
`[r * shard, (r + 1) * shard)`. Every instance of a bucket shares its layout.

What each ZeRO stage holds per rank (4 bytes of split master + compute copy, 8 of moments):

| zero | compute weights | master low half + moments | gradients reduced by |
| --- | --- | --- | --- |
| 0 | whole | whole | all_reduce, every rank updates everything |
| 1 | whole | its shard | all_reduce, each rank updates its shard, all_gather |
| 2 | whole | its shard | reduce_scatter, update the shard, all_gather |
| 3 | its shard; whole weights gathered just before use (below) | its shard | reduce_scatter, update the shard |

Under ZeRO-3 a repeated layer's whole weights are gathered into one of two slots (i % 2)
just before its forward and its backward. The other buckets (an *entry* bucket: a
parameter of the entry, or a function called once by name) are gathered into a buffer
made for the purpose and dropped again, in the *windows* listed in the bucket's
`windows` (from where the forward and the backward read its parameters; a tied path's
reads count for its target):

| window | read | gathered at | dropped at |
| --- | --- | --- | --- |
| start | before the first repeated layer (the embedding) | the forward's start | the first layer's forward_begin |
| end | after the last repeated layer, or in the backward (final norm, LM head) | the last layer's forward_begin | its gradients_ready |
| step | between repeated layers, or no repeated layer at all | the forward's start | its gradients_ready |

A tied embedding and head is read in both: `start` and `end`. Between its windows (and
between steps) the rank holds the shard alone, so the buffers are no fixed state.

A reduce_scatter writes the rank's sum into its own part of the gradient slot (in place,
as NCCL and gloo allow): no bucket has a separate shard buffer.

A repeated bucket has two gradient slots (instances i and i + 2 share one), an entry bucket
one of its own, unless it names a `gradient_slot` shared with another entry bucket: one
whose gradients are final at the backward's start (LM head) and one final at its end
(embedding) reuse one slot, the size of the larger (_share_gradient_slots); a copy into a
shared slot waits for the reduction of the bucket that used it last in the step (the
`wait_event` with `previous: gradient_slot`).

No stage holds more than two bucket instances' gradients at a time: a layer's gradients
are reduced as soon as its backward made them (the runtime's update-in-backward), so
stages 1 and 2 differ in traffic, not memory.

The ops (`ops`) run at *triggers* of a bucket instance i (`gradients_ready`: all its
gradients are final; `forward_begin` / `backward_begin`: its function's run starts, for
an entry bucket the entry's; `step_begin` / `step_end`), each on its stream (0 compute,
2 communication) in list order. `instance` is relative to i (an op for i + offset
outside the bucket's instances is skipped); an event is named with its bucket instance
(`grads:blocks[3]`). `step_begin` and `step_end` run once per bucket, with i its first
instance. Ops marked `only: layered` apply to the buckets of repeated layers alone,
`only: entry` to the others; an op with a `window` applies to the buckets that list it;
an op with `at: first` (`last`) runs on `forward_begin` of the first (last) repeated
layer instance of the forward instead of the bucket's own. `allocate` makes an entry
bucket's whole buffer (the compute views of its parameters point into it) and `release`
drops it (the views no longer hold weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.ir.graph import COMM_STREAM as COMM, COMPUTE_STREAM as COMPUTE, function_runs

ALIGN = 128  # elements: each parameter and shard starts at a 256-byte boundary in bf16
ZERO_STAGES = (0, 1, 2, 3)
AUTO = "auto"  # `--zero auto`: the budget planner chooses (modulec.lower.build_plan.choose_zero)
# bytes per element of what a rank holds (split fp32 master = bf16 compute copy + int16
# low half; fp32 moments) and of a gradient in flight (bf16)
COMPUTE_BYTES, LOW_BYTES, MOMENT_BYTES, GRAD_BYTES = 2, 2, 8, 2


@dataclass(frozen=True)
class DataParallel:
    dp: int
    zero: int = 2

    def __post_init__(self):
        if self.dp < 1:
            raise ValueError(f"the data-parallel size must be at least 1, not {self.dp}")
        if self.zero not in ZERO_STAGES and self.zero != AUTO:
            raise ValueError(f"the ZeRO stage must be 0, 1, 2, 3 or auto, not {self.zero}")


def data_parallel_section(graph, options: DataParallel, trained=None,
                          ties: dict | None = None) -> dict:
    """The `distributed` section for `graph` on `options.dp` ranks. `trained`: the paths
    of the parameters the step trains (None: every one); the others (frozen, tied) are in
    no bucket and stay whole on every rank. `ties`: a tied parameter's path -> its
    target's (`tied_to`; its reads are the target's)."""
    buckets = [b for b in _buckets(graph, options.dp, trained) if b["params"]]
    reads = _entry_reads(graph, ties or {}) if any(map(is_layered, buckets)) else {}
    if options.zero == 3:
        _gather_windows(buckets, reads)
    shared = _share_gradient_slots(buckets, reads)
    return {"mesh": {"dp": options.dp, "tp": 1, "pp": 1}, "zero": options.zero,
            "streams": {"compute": COMPUTE, "comm": COMM}, "align": ALIGN,
            "buckets": buckets, "ops": stage_ops(options.zero, shared)}


# ---------------------------------------------------------------------- buckets
def _buckets(graph, dp: int, trained) -> list[dict]:
    entry = graph.function(graph.entry)
    buckets = [_bucket(p.id[len("param:"):], "", 1, 0, [(p.id[len("param:"):], _shape(p))],
                       dp, trained) for p in entry.params]
    for node in entry.nodes:
        if node.kind != "call":
            continue
        name, first = node.attr("instance"), node.attr("first")
        callee = graph.function(node.target)
        params = list(_params(graph, callee))
        if first is None:  # called once, by name: its parameters are one bucket
            buckets.append(_bucket(name, name, 1, 0, params, dp, trained))
            continue
        count, first = int(node.repeat), int(first)
        if any(b["name"] == name for b in buckets):  # a second slice: blocks[8:16]()
            name = f"{name}[{first}:{first + count}]"
        buckets.append(_bucket(name, node.attr("instance") + "[{i}]", count, first,
                               params, dp, trained))
    return buckets


def _bucket(name: str, path: str, count: int, first: int, params: list, dp: int,
            trained) -> dict:
    """Parameters of one bucket (paths relative to `path`, `{i}` the instance), laid out
    flat; only those trained in every instance."""
    kept = [(n, s) for n, s in params
            if trained is None or all(_path(path, first + i, n) in trained
                                      for i in range(count))]
    rows, offset = [], 0
    for pname, shape in kept:
        numel = _numel(shape)
        rows.append({"name": pname, "shape": list(shape), "offset": offset, "numel": numel})
        offset += _round_up(numel, ALIGN)
    numel = _round_up(max(offset, 1), dp * ALIGN)
    return {"name": name, "path": path, "first": first, "instances": count,
            "params": rows, "numel": numel, "shard": numel // dp}


def _params(graph, function):
    """(path relative to `function`, shape) of every parameter of it and what it calls."""
    for run, prefix in function_runs(graph, function):
        for p in run.params:
            yield _join(prefix, p.id[len("param:"):]), _shape(p)


def parameter_paths(graph) -> list[str]:
    """Every parameter path of the model (`blocks[3].attention.qkv_weight`)."""
    return [path for path, _ in _params(graph, graph.function(graph.entry))]


def bucket_key(bucket: dict, instance: int) -> str:
    """The name of one instance (0-based) of `bucket`: its layer's path (`blocks[3]`), or
    the bucket's name for an entry parameter's."""
    template = bucket["path"]
    return template.replace("{i}", str(bucket["first"] + instance)) if template \
        else bucket["name"]


def bucket_paths(bucket: dict, instance: int) -> list[str]:
    """The parameter paths of one instance (0-based) of `bucket`."""
    return [_path(bucket["path"], bucket["first"] + instance, p["name"])
            for p in bucket["params"]]


def _path(template: str, index: int, name: str) -> str:
    return _join(template.replace("{i}", str(index)), name)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _shape(value) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in value.shape)
    except ValueError:
        raise ValueError(f"data parallel needs every parameter size: {value.id} has shape "
                         f"[{', '.join(value.shape)}]") from None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ---------------------------------------------------------------------- ops
def _op(on: str, kind: str, stream: int, **more) -> dict:
    return {"on": on, "kind": kind, "stream": stream, **more}


def stage_ops(zero: int, shared: bool = False) -> list[dict]:
    """The collective ops of a ZeRO stage, per trigger (the module docstring's table).
    Gradient slots alternate between instances (i and i + 2 share one: the backward runs
    the layers last first), so a copy in waits for the reduction two instances back;
    `shared`: entry buckets share a slot (`gradient_slot`), and a copy into it waits for
    the reduction of the bucket that used it last in this step."""
    reduce = "all_reduce" if zero in (0, 1) else "reduce_scatter"
    after = [_op("gradients_ready", "wait_event", COMPUTE, event="reduced",
                 previous="gradient_slot")] if shared else []
    ready = after + [
             _op("gradients_ready", "wait_event", COMPUTE, event="reduced", instance=2),
             _op("gradients_ready", "copy_in", COMPUTE, what="gradients"),
             _op("gradients_ready", "record_event", COMPUTE, event="grads"),
             _op("gradients_ready", "wait_event", COMM, event="grads"),
             _op("gradients_ready", reduce, COMM, what="gradients"),
             _op("gradients_ready", "adamw_shard", COMM, whole=zero == 0),
             _op("gradients_ready", "record_event", COMM, event="reduced")]
    if zero in (1, 2):
        ready.insert(-1, _op("gradients_ready", "all_gather", COMM, what="weights"))
    start = [_op("step_begin", "record_event", COMPUTE, event="step_start", instance=0),
             _op("step_begin", "wait_event", COMM, event="step_start", instance=0)]
    end = [_op("step_end", "record_event", COMM, event="step_done"),
           _op("step_end", "wait_event", COMPUTE, event="step_done")]
    if zero == 3:  # an entry bucket's buffer is dropped once its gradients are final
        ready = _release("gradients_ready", "end") + _release("gradients_ready", "step") + \
            ready
        return start + _gather_ops() + _entry_ops() + ready + end
    return start + ready + end


def _gather_ops() -> list[dict]:
    """ZeRO-3: a repeated layer's weights, gathered into slot i % 2 before its forward and
    its backward, the next one's prefetched as it starts (once the compute stream is past
    the instance that last used that slot)."""
    def layered(on: str, kind: str, stream: int, **more) -> dict:
        return _op(on, kind, stream, only="layered", **more)

    def prefetch(on: str, step: int) -> list[dict]:
        return [layered(on, "record_event", COMPUTE, event="released", instance=-step),
                layered(on, "wait_event", COMM, event="released", instance=-step),
                layered(on, "all_gather", COMM, what="weights", instance=step, into="slot"),
                layered(on, "record_event", COMM, event="gathered", instance=step)]

    begin = [layered("step_begin", "all_gather", COMM, what="weights", instance=0,
                     into="slot"),
             layered("step_begin", "record_event", COMM, event="gathered", instance=0)]
    forward = [layered("forward_begin", "wait_event", COMPUTE, event="gathered")] + \
        prefetch("forward_begin", 1)
    backward = [layered("backward_begin", "wait_event", COMPUTE, event="gathered")] + \
        prefetch("backward_begin", -1)
    return begin + forward + backward


def _entry_ops() -> list[dict]:
    """ZeRO-3: an entry bucket's windows (the module docstring's table). A gather makes
    the buffer on the compute stream, so the comm stream writes it only once the compute
    stream is past what last used those bytes; the compute stream reads it once written."""
    return (_gather("start", "forward_begin") + _gather("step", "forward_begin") +
            _release("forward_begin", "start", at="first") +
            _gather("end", "forward_begin", at="last"))


def _entry(on: str, kind: str, stream: int, window: str, at: str | None, **more) -> dict:
    return _op(on, kind, stream, only="entry", window=window,
               **({} if at is None else {"at": at}), **more)


def _gather(window: str, on: str, at: str | None = None) -> list[dict]:
    return [_entry(on, "allocate", COMPUTE, window, at, what="weights"),
            _entry(on, "record_event", COMPUTE, window, at, event="allocated"),
            _entry(on, "wait_event", COMM, window, at, event="allocated"),
            _entry(on, "all_gather", COMM, window, at, what="weights", into="buffer"),
            _entry(on, "record_event", COMM, window, at, event="gathered"),
            _entry(on, "wait_event", COMPUTE, window, at, event="gathered")]


def _release(on: str, window: str, at: str | None = None) -> list[dict]:
    return [_entry(on, "release", COMPUTE, window, at, what="weights")]


# ---------------------------------------------------------------------- windows
WINDOWS = ("start", "end", "step")


def _gather_windows(buckets: list[dict], reads: dict) -> None:
    """ZeRO-3: each entry bucket's `windows`, from where its parameters are read
    (`reads`: _entry_reads, empty without repeated layers)."""
    layered = any(is_layered(b) for b in buckets)
    for bucket in buckets:
        if not is_layered(bucket):
            bucket["windows"] = _windows(_bucket_reads(bucket, reads), layered)


def _bucket_reads(bucket: dict, reads: dict) -> set:
    return set().union(*(reads.get(p, set()) for p in bucket_paths(bucket, 0)))


def _share_gradient_slots(buckets: list[dict], reads: dict) -> bool:
    """Entry buckets whose gradients are final at the backward's start (read after the
    last repeated layer only: final norm, LM head) and those final at its end (read before
    the first one only: the embedding) are paired, largest with largest, to share one
    gradient slot (`gradient_slot`, the pair's name; its size the larger's): the early
    one's reduction is long done when the late one's gradients arrive. Returns whether
    any bucket shares."""
    early, late = [], []
    for bucket in buckets:
        if is_layered(bucket):
            continue
        found = _bucket_reads(bucket, reads)
        if found == {"end"}:
            early.append(bucket)
        elif found == {"start"} or found == {"start", "end"}:  # a tied embedding and head
            late.append(bucket)
    by_size = lambda b: (-b["numel"], b["name"])  # noqa: E731
    for first, then in zip(sorted(early, key=by_size), sorted(late, key=by_size)):
        first["gradient_slot"] = then["gradient_slot"] = f"{first['name']}+{then['name']}"
    return bool(early and late)


def _windows(found: set, layered: bool) -> list[str]:
    if not layered or not found or "middle" in found:
        return ["step"]
    return [w for w in ("start", "end") if w in found]


def _entry_reads(graph, ties: dict) -> dict[str, set]:
    """Parameter path -> where the entry reads it: `start` (before the first repeated
    call of the forward), `middle`, `end` (after the last one, or in the backward)."""
    entry = graph.function(graph.entry)
    repeated = [k for k, n in enumerate(entry.nodes)
                if n.kind == "call" and n.attr("first") is not None]
    reads: dict[str, set] = {}

    def mark(paths, where: str) -> None:
        for path in paths:
            reads.setdefault(ties.get(path, path), set()).add(where)

    for k, node in enumerate(entry.nodes):
        where = "start" if not repeated or k < repeated[0] else \
            "end" if k > repeated[-1] else "middle"
        mark(_node_reads(graph, node), where)
        if node.kind == "call" and node.attr("first") is None and graph.backward:
            mark(_node_reads(graph, node), "end")  # its backward may read them
    if graph.backward:
        for node in graph.function(graph.backward).nodes:
            if node.kind != "call":
                mark(_node_reads(graph, node), "end")
    return reads


def _node_reads(graph, node) -> list[str]:
    """The entry parameter paths an entry node reads (a call by name: its callee's)."""
    if node.kind != "call":
        return [v[len("param:"):] for v in node.inputs if v and v.startswith("param:")]
    if node.attr("first") is not None:
        return []  # a repeated layer reads its own, gathered into slots
    name = node.attr("instance") or ""
    return [_join(name, p) for p, _ in _params(graph, graph.function(node.target))]


def is_layered(bucket: dict) -> bool:
    """A repeated layer's bucket (its path has `{i}`); the others are entry buckets."""
    return "{i}" in bucket["path"]


# ---------------------------------------------------------------------- memory
def rank_fixed_bytes(section: dict) -> dict[str, int]:
    """What one rank holds for the trained parameters of `section` (bytes, by part):
    compute weights (whole, or with ZeRO-3 the shards plus two gather slots per repeated
    bucket), the split masters' low halves and moments (sharded from ZeRO-1), and the
    gradient slots (a reduce_scatter's output is the rank's part of its slot; a shared
    slot counted once). An entry bucket's ZeRO-3 buffer is no part of it
    (entry_buffer_bytes)."""
    dp, zero = section["mesh"]["dp"], section["zero"]
    parts = {"weights": 0, "optimizer_state": 0, "gradient_buffers": 0, "gather_slots": 0}
    for b in section["buckets"]:
        n, shard, count = b["numel"], b["shard"], b["instances"]
        parts["weights"] += COMPUTE_BYTES * (shard if zero == 3 else n) * count
        parts["optimizer_state"] += (LOW_BYTES + MOMENT_BYTES) * (n if zero == 0 else shard) \
            * count
        if "gradient_slot" not in b:
            parts["gradient_buffers"] += GRAD_BYTES * min(2, count) * n  # i, i + 2 share one
        if zero == 3 and is_layered(b):
            parts["gather_slots"] += COMPUTE_BYTES * 2 * n
    parts["gradient_buffers"] += GRAD_BYTES * sum(shared_slot_numels(section).values())
    parts["total"] = sum(parts.values())
    parts["dp"] = dp
    return parts


def shared_slot_numels(section: dict) -> dict[str, int]:
    """Each shared gradient slot's elements: its largest bucket's."""
    numels: dict[str, int] = {}
    for b in section["buckets"]:
        if "gradient_slot" in b:
            numels[b["gradient_slot"]] = max(numels.get(b["gradient_slot"], 0), b["numel"])
    return numels


def entry_buffer_bytes(section: dict) -> int:
    """ZeRO-3: the entry buckets' whole buffers held at the step's peak (the end of the
    forward, the start of the backward): those of windows `end` and `step`."""
    if section["zero"] != 3:
        return 0
    return sum(COMPUTE_BYTES * b["numel"] for b in section["buckets"]
               if not is_layered(b) and {"end", "step"} & set(b.get("windows", ())))


def planner_fixed_bytes(graph, section: dict) -> dict[str, int]:
    """The fixed state the budget planner counts on one rank of `section`, in place of its
    one-GPU estimate (fp32 weights, gradients and moments of every parameter): what the
    rank holds for the trained parameters (rank_fixed_bytes), the ZeRO-3 entry buffers held
    at the peak (entry_buffer_bytes) and a bf16 compute copy of every other one (frozen,
    LoRA's base)."""
    parts = rank_fixed_bytes(section)
    trained = {p for b in section["buckets"] for i in range(b["instances"])
               for p in bucket_paths(b, i)}
    untrained = sum(_numel(shape) for path, shape in
                    _params(graph, graph.function(graph.entry)) if path not in trained)
    fixed = {part: parts[part] for part in
             ("weights", "optimizer_state", "gradient_buffers", "gather_slots")}
    fixed["entry_buffers"] = entry_buffer_bytes(section)
    fixed["untrained_weights"] = COMPUTE_BYTES * untrained
    return fixed
