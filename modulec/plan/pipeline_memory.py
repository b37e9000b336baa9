"""Per-GPU memory of each pipeline stage (`modulec plan --pp P [--dp N --zero S]`).

A stage's ranks hold the fixed state of its own parameters as a GPU stage holds it
(stage_fixed_bytes of the section's buckets cut to the stage's layers: runtime/train/
pipeline_precision.py's bf16 copies of fp32 masters, AdamW's moments, whose buckets the
pipelines' ZeRO-1 shards over the replicas, and the step's gradients) and, under 1F1B, the saved activations of up to min(P - s, M) micro-batches at
once (stage 0 the most: a forward of every stage ahead is in flight before its first
backward). A micro-batch's saved bytes per layer come from the schedule's activation
layout (each function's record stride), the entry's own values from its record, each
in the stage of the node that makes it; plus the step's largest transient arena.
"""

from __future__ import annotations

from modulec.plan.distributed import DataParallel, bucket_paths, data_parallel_section

# bytes a GPU stage holds per trained element (runtime/train/pipeline_precision.py): its
# bf16 compute copy, its fp32 master, the step's fp32 gradient sum, one micro-batch's bf16
# gradients before they are added in, and AdamW's two fp32 moments (under the pipelines'
# ZeRO-1 only for the buckets the replica owns)
COPY, MASTER, GRADIENT_SUM, MICRO_GRADIENTS, MOMENTS = 2, 4, 4, 2, 8


def stage_memory(graph, schedule: dict, transient: int) -> list[dict]:
    pipeline = schedule["pipeline"]
    # the pipelines' own ZeRO-1 (whole buckets a replica) counted as ZeRO-1's even shards
    sharded = DataParallel(pipeline["mesh"]["dp"], pipeline.get("zero", 0)) \
        if "mesh" in pipeline else DataParallel(1, 0)
    section = schedule.get("distributed") or data_parallel_section(graph, sharded)
    saved = _saved_per_microbatch(graph, schedule.get("layout"), pipeline)
    count, micro = len(pipeline["stages"]), pipeline["microbatches"]
    rows = []
    for stage in pipeline["stages"]:
        s = stage["stage"]
        fixed = stage_fixed_bytes(_cut(section, set(stage["params"])))
        in_flight = min(count - s, micro)
        activations = saved[s] * in_flight + transient
        rows.append({"stage": s, "fixed_bytes": fixed["total"], "fixed_parts": fixed,
                     "saved_per_microbatch_bytes": saved[s], "in_flight": in_flight,
                     "activation_bytes": activations,
                     "per_gpu_bytes": fixed["total"] + activations})
    return rows


def stage_fixed_bytes(section: dict) -> dict[str, int]:
    """What one rank of a stage holds for the trained parameters of `section`'s buckets
    (bytes, by part; `total`). The weights, masters and moments live for the whole run;
    the gradient parts during a step."""
    parts = {"weights": 0, "masters": 0, "optimizer_state": 0, "gradient_sums": 0,
             "micro_batch_gradients": 0}
    replicas = section["mesh"]["dp"]
    for bucket in section["buckets"]:
        # the parameters' own elements (a stage holds each as a tensor: no bucket padding)
        n = sum(row["numel"] for row in bucket["params"]) * bucket["instances"]
        owned = n if section["zero"] == 0 else -(-n // replicas)  # the replica's share
        parts["weights"] += COPY * n
        parts["masters"] += MASTER * n
        parts["optimizer_state"] += MOMENTS * owned
        parts["gradient_sums"] += GRADIENT_SUM * n
        parts["micro_batch_gradients"] += MICRO_GRADIENTS * n
    parts["total"] = sum(parts.values())
    return parts


def _cut(section: dict, params: set) -> dict:
    """The section with each bucket cut to the instances whose parameters the stage holds
    (a stage's layers are contiguous, so the kept instances are too)."""
    buckets = []
    for bucket in section["buckets"]:
        kept = [i for i in range(bucket["instances"])
                if all(p in params for p in bucket_paths(bucket, i))]
        if kept:
            buckets.append(dict(bucket, first=bucket["first"] + kept[0], instances=len(kept)))
    return dict(section, buckets=buckets)


def _saved_per_microbatch(graph, layout, pipeline) -> list[int]:
    saved = [0] * len(pipeline["stages"])
    if not layout:
        return saved
    records = {r["function"]: r for r in layout["functions"]}
    per_call = {}
    for stage in pipeline["stages"]:
        for unit in stage["units"]:
            if "layers" in unit:
                target = unit["target"]
                if target not in per_call:
                    per_call[target] = _per_repetition(graph, target, records)
                lo, hi = unit["layers"]
                saved[stage["stage"]] += per_call[target] * (hi - lo + 1)
    entry = records.get(graph.entry)
    if entry is not None:
        where = _stage_of_values(graph, pipeline)
        for value in entry["values"]:
            if "view_of" not in value:
                saved[where.get(value["value"], 0)] += value["bytes"]
    return saved


def _per_repetition(graph, name: str, records: dict) -> int:
    """Saved bytes of one run of `name`, its callees included: each function's record
    stride times its runs per run of `name`."""
    own = records.get(name)
    runs = own["instances"] if own else 1
    total, seen, todo = 0, set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        record = records.get(current)
        if record is not None:
            total += record["saved"]["stride"] * record["instances"]
        todo += [n.target for n in graph.function(current).nodes if n.kind == "call"]
    return total // max(runs, 1)


def _stage_of_values(graph, pipeline) -> dict:
    stage_of_node = {u["node"]: s["stage"] for s in pipeline["stages"] for u in s["units"]}
    return {o: stage_of_node.get(n.id, 0) for n in graph.function(graph.entry).nodes
            for o in n.outputs}
