"""Data parallel over pipeline stages (DP x PP) as Schedule IR data: the `mesh` of the
`pipeline` section and, with dp > 1, each stage's gradient buckets and the all-reduces
that average them over the stage's data-parallel group (docs/pipeline.md, "Data parallel
over pipelines"; docs/build-output.md).

Rank r = ((dp_index x PP) + pp_index) x TP + tp_index: the ranks of one data-parallel
index form a pipeline (one PP group each), and the ranks of one stage across the
pipelines hold the same parameters (one DP group each). With tp > 1 (`--pp P --tp M`)
each stage's program is a tensor-parallel rank program: the M ranks of one stage are one
TP group, a pipeline is the P ranks of one tp_index, and a DP group is one (stage,
tp_index); the buckets hold that rank's slices (the graph's shapes). Every pipeline runs the whole
1F1B op list on its own rows; after a stage's last op (its last backward and the send of
its gradients) each of its buckets is one `all_reduce` over the stage's DP group that
leaves the mean there, so every replica of a stage steps AdamW on the same gradients.

Only trained parameters are in buckets, each once and by its owner's name (a tied
path's `shared` entry's `param`: modulec.plan.pipeline_shared): a frozen one (`@frozen`,
a LoRA program's base weights: no gradient) is neither reduced nor, under ZeRO-1,
broadcast. A bucket is the parameters of one layer (`blocks[3]`, the first path
component) or one entry parameter (`embedding`), flat in the stage's parameter order,
listed in backward order (the last layer first: the order a backward makes them in, for
a runtime that reduces as soon as a layer is done). The all-reduces that sum a stage's
`shared` entries over their stages (with dp 1 too) follow its buckets' and come before
ZeRO-1's update.

ZeRO-1 (`zero: 1`) shards the optimizer state over the stage's DP group by bucket: each
bucket has an `owner` (a data-parallel index; the buckets dealt largest first to the
least loaded replica), only the owner keeps its AdamW moments and steps it. After the
all-reduces the op list says so: `optimizer_step` (each rank steps the buckets it owns),
then one `broadcast` of each bucket's updated weights from its owner to the group. As
torch's ZeroRedundancyOptimizer partitions by parameter, whole buckets keep a parameter's
update in one rank (its `@trainable` settings, its clipping) at the cost of balance.
Without `zero` 1 the optimizer steps every parameter after the op list.
"""

from __future__ import annotations

from modulec.ir.graph import COMM_STREAM as COMM, COMPUTE_STREAM as COMPUTE
from modulec.plan.distributed import GRAD_BYTES, _numel

GROUP = "dp"  # the collectives' process group: the stage's data-parallel group
REDUCE = "avg"  # the group's mean (a sum, divided by the group's size)


def mesh(dp: int, pp: int, tp: int = 1) -> dict:
    return {"dp": dp, "pp": pp, "tp": tp}


def add_data_parallel(section: dict, graph, dp: int, zero: int = 0, tp: int = 1) -> dict:
    """`section` with its `mesh` (`tp`: each stage a TP rank program of that many ranks,
    its buckets that rank's slices) and ZeRO stage, and for dp > 1 each stage's
    `grad_buckets` and its ops ending in one all_reduce per bucket (ZeRO-1: then the
    optimizer step and one broadcast per bucket from its owner)."""
    section["mesh"] = mesh(dp, len(section["stages"]), tp)
    section["zero"] = zero
    from modulec.ir.verify_parallel import frozen_paths, parameter_shapes
    from modulec.plan.pipeline_shared import shared_ops

    shapes, frozen = parameter_shapes(graph), frozen_paths(graph)
    for stage, ops in zip(section["stages"], section["ops"]):
        if dp > 1:
            stage["grad_buckets"] = buckets = gradient_buckets(
                trained_params(section, stage, frozen), shapes)
            ops += reduce_ops(buckets)
        ops += shared_ops(section, stage["stage"], frozen)  # the shared copies' sums
        if dp > 1 and zero == 1:
            deal_owners(buckets, dp)
            ops += update_ops(buckets)
    return section


def trained_params(section: dict, stage: dict, frozen) -> list[str]:
    """The parameters a stage's optimizer steps: each path it reads by its owner's name
    (a tied path: its `shared` entry's `param`), once, not a frozen one (LoRA: the
    adapters)."""
    from modulec.plan.pipeline_shared import owners

    owner = owners(section)
    named = dict.fromkeys(owner.get(p, p) for p in stage["params"])
    return [p for p in named if p not in frozen]


def deal_owners(buckets: list[dict], dp: int) -> None:
    """Each bucket's owner: largest first to the replica holding the fewest elements
    (ties: the lowest index)."""
    load = [0] * dp
    for bucket in sorted(buckets, key=lambda b: -b["numel"]):
        owner = min(range(dp), key=lambda d: (load[d], d))
        bucket["owner"] = owner
        load[owner] += bucket["numel"]


def update_ops(buckets: list[dict]) -> list[dict]:
    return [{"kind": "optimizer_step", "phase": "update", "stream": COMPUTE}] + [
        {"kind": "broadcast", "what": "weights", "bucket": index, "root": bucket["owner"],
         "group": GROUP, "phase": "update", "stream": COMM}
        for index, bucket in enumerate(buckets)]


def bucket_name(path: str) -> str:
    """The bucket a parameter path is in: its first component (`blocks[3]`, `embedding`,
    `final_norm`)."""
    return path.split(".", 1)[0]


def gradient_buckets(params: list[str], shapes: dict) -> list[dict]:
    """The stage's parameters in buckets, backward order; each parameter at its offset in
    its bucket's flat vector."""
    grouped: dict[str, list[str]] = {}
    for path in params:
        grouped.setdefault(bucket_name(path), []).append(path)
    buckets = []
    for name, paths in reversed(grouped.items()):
        rows, offset = [], 0
        for path in paths:
            shape = [int(d) for d in shapes[path]]
            numel = _numel(shape)
            rows.append({"path": path, "shape": shape, "offset": offset, "numel": numel})
            offset += numel
        buckets.append({"name": name, "params": rows, "numel": offset,
                        "bytes": offset * GRAD_BYTES})
    return buckets


def reduce_ops(buckets: list[dict]) -> list[dict]:
    return [{"kind": "all_reduce", "what": "gradients", "bucket": index, "group": GROUP,
             "reduce": REDUCE, "phase": "reduce", "stream": COMM}
            for index in range(len(buckets))]


def all_reduce_seconds(nbytes: int, ranks: int, link_bytes_per_s: float,
                       latency_s: float) -> float:
    """A ring all-reduce: each rank moves 2 (n - 1) / n of the buffer, 2 (n - 1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / link_bytes_per_s


def broadcast_seconds(nbytes: int, ranks: int, link_bytes_per_s: float,
                      latency_s: float) -> float:
    """A pipelined (chunked ring) broadcast: about the buffer once over the link."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency_s + nbytes / link_bytes_per_s

