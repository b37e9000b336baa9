"""`modulec ir verify` for data parallel over a pipeline's stages (the `pipeline`
section's mesh dp > 1; modulec/plan/pipeline_dp.py): each stage's gradient buckets hold
its trained parameters once (by their owners' names: a tied path's `shared` entry's
`param`; not a frozen one: `@frozen`, a LoRA program's base), with
the graph's shapes, packed in order; its op list ends, after its last compute op, in
one all_reduce per bucket (gradients, dp group, avg, comm stream); under ZeRO-1 every
bucket has an owner among the dp replicas, and the all-reduces are followed by one
optimizer_step and one broadcast per bucket from its owner. With dp 1: no buckets, no
such ops, ZeRO 0. The `shared` entries' all-reduces (group shared) are checked apart
(modulec.ir.verify_pipeline_shared).
"""

from __future__ import annotations

from math import prod

UPDATE_KINDS = ("all_reduce", "optimizer_step", "broadcast")


def verify_reductions(section, shapes: dict, frozen: set = frozenset()) -> list[str]:
    """`frozen`: the parameter paths without a gradient (modulec.ir.verify_parallel
    .frozen_paths), in no bucket."""
    dp, zero = section["mesh"]["dp"], section.get("zero", 0)
    if zero not in (0, 1) or (zero == 1 and dp == 1):
        return [f"`zero` {zero!r}: a pipeline shards with ZeRO 0, or 1 over dp > 1"]
    from modulec.plan.pipeline_dp import trained_params
    from modulec.plan.pipeline_shared import is_shared_op

    problems = []
    for stage, ops in zip(section["stages"], section["ops"]):
        where = f"stage {stage['stage']}"
        buckets = stage.get("grad_buckets")
        ops = [op for op in ops if not is_shared_op(op)]  # modulec.ir.verify_pipeline_shared
        if dp == 1:
            if buckets is not None or any(op.get("kind") in UPDATE_KINDS for op in ops):
                problems.append(f"{where}: gradient buckets or all_reduce ops with mesh dp 1")
            continue
        if not isinstance(buckets, list):
            problems.append(f"{where}: mesh dp {dp} needs `grad_buckets`")
            continue
        trained = trained_params(section, stage, frozen)  # a tied path: its owner's
        problems += [f"{where}: {m}" for m in _buckets(buckets, trained, shapes, dp, zero)]
        problems += [f"{where}: {m}" for m in _ops(ops, buckets, section["streams"], zero)]
    return problems


def _buckets(buckets: list, params: list, shapes: dict, dp: int, zero: int) -> list[str]:
    problems, seen = [], []
    for index, bucket in enumerate(buckets):
        offset = 0
        for row in bucket["params"]:
            path = row["path"]
            if shapes.get(path) != row["shape"]:
                problems.append(f"bucket {index}: `{path}` has shape {row['shape']}, the "
                                f"graph's is {shapes.get(path)}")
            if row["offset"] != offset or row["numel"] != prod(row["shape"]):
                problems.append(f"bucket {index}: `{path}` at +{row['offset']}:"
                                f"{row['numel']}, expected +{offset}:{prod(row['shape'])}")
            offset += row["numel"]
            seen.append(path)
        if bucket["numel"] != offset:
            problems.append(f"bucket {index}: numel {bucket['numel']}, its parameters "
                            f"hold {offset}")
        owner = bucket.get("owner")
        if zero == 1 and not (isinstance(owner, int) and 0 <= owner < dp):
            problems.append(f"bucket {index}: ZeRO-1 needs an owner in 0..{dp - 1}, not "
                            f"{owner!r}")
        elif zero == 0 and owner is not None:
            problems.append(f"bucket {index}: an owner without ZeRO-1")
    if sorted(seen) != sorted(params):
        problems.append("the gradient buckets do not hold the stage's trained parameters "
                        "(those with a gradient), each once")
    return problems


def _ops(ops: list, buckets: list, streams: dict, zero: int) -> list[str]:
    """After the last compute op: the all-reduces, then (ZeRO-1) the optimizer step and
    the broadcasts, each bucket once."""
    last = max((i for i, op in enumerate(ops) if op.get("kind") in ("forward", "backward")),
               default=-1)
    tail = [op for op in ops[last + 1:] if op.get("kind") in UPDATE_KINDS]
    if [op for op in ops[:last + 1] if op.get("kind") in UPDATE_KINDS]:
        return ["an all_reduce, optimizer_step or broadcast before the stage's last "
                "backward"]
    kinds = [op["kind"] for op in tail]
    want = ["all_reduce"] * len(buckets) + (
        ["optimizer_step"] + ["broadcast"] * len(buckets) if zero == 1 else [])
    if kinds != want:
        return [f"the ops after the last backward are {_counted(kinds)}, expected "
                f"{_counted(want)}"]
    problems = []
    for op in tail:
        kind = op["kind"]
        if kind == "optimizer_step":
            if op.get("stream") != streams["compute"]:
                problems.append(f"optimizer_step on stream {op.get('stream')!r}, expected "
                                f"{streams['compute']}")
            continue
        fields = (op.get("what"), op.get("group"), op.get("stream"))
        expected = ("gradients" if kind == "all_reduce" else "weights", "dp", streams["comm"])
        if fields != expected or (kind == "all_reduce" and op.get("reduce") != "avg"):
            problems.append(f"{kind} of bucket {op.get('bucket')!r}: expected what "
                            f"{expected[0]}, group dp, stream {expected[2]}"
                            + (", reduce avg" if kind == "all_reduce" else ""))
        if kind == "broadcast" and 0 <= _index(op, buckets) and \
                op.get("root") != buckets[op["bucket"]].get("owner"):
            problems.append(f"broadcast of bucket {op['bucket']} from {op.get('root')!r}, "
                            f"its owner is {buckets[op['bucket']].get('owner')!r}")
    for kind in ("all_reduce", "broadcast"):
        found = [op.get("bucket") for op in tail if op["kind"] == kind]
        if found and sorted(found) != list(range(len(buckets))):
            problems.append(f"{kind} ops for buckets {found}, expected each of "
                            f"0..{len(buckets) - 1} once")
    return problems


def _index(op: dict, buckets: list) -> int:
    index = op.get("bucket")
    return index if isinstance(index, int) and 0 <= index < len(buckets) else -1


def _counted(kinds: list) -> str:
    runs: list = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return ", ".join(f"{n} {k}" for k, n in runs) or "none"

