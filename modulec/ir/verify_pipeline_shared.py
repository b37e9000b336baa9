"""`modulec ir verify` for the parameters a pipeline's stages share (the `pipeline`
section's `shared` entries; modulec/plan/pipeline_shared.py): each entry's `param` is a
parameter of the graph with the entry's shape, listed first in its `paths`, which are
parameters of that shape too and in no other entry; its `stages` are exactly the stages
whose `params` read one of its paths, at least two unless two paths name it; a parameter
path two stages hold is in an entry. Each stage's op list has, after its last compute op
and its data-parallel all-reduces and before an `optimizer_step`, one `all_reduce`
(gradients, group shared, reduce sum, comm stream) per trained entry it holds that is read
by two stages or more, in entry order, and no other.
"""

from __future__ import annotations

from modulec.plan.pipeline_shared import is_shared_op, reduced


def verify_shared(section: dict, shapes: dict, frozen=frozenset()) -> list[str]:
    entries = section.get("shared")
    if not isinstance(entries, list):
        return ["`shared` must be a list (rebuild with this modulec: a parameter two "
                "stages read is one of its entries)"]
    problems = []
    claimed: dict[str, int] = {}
    for index, entry in enumerate(entries):
        problems += [f"shared {index}: {m}"
                     for m in _entry(entry, section["stages"], shapes, claimed, index)]
    held: dict[str, list[int]] = {}
    for stage in section["stages"]:
        for path in dict.fromkeys(stage["params"]):
            held.setdefault(path, []).append(stage["stage"])
    for path, stages in held.items():
        if len(stages) > 1 and path not in claimed:
            problems.append(f"`{path}` is held by stages {stages} but is in no `shared` "
                            "entry")
    if problems:
        return problems
    for stage, ops in zip(section["stages"], section["ops"]):
        problems += [f"stage {stage['stage']}: {m}"
                     for m in _ops(stage["stage"], ops, entries, section["streams"], frozen)]
    return problems


def _entry(entry, stages: list, shapes: dict, claimed: dict, index: int) -> list[str]:
    param, paths = entry["param"], list(entry["paths"])
    if param not in shapes:
        return [f"`{param}` is not a parameter of the graph"]
    problems = []
    if entry["shape"] != [int(d) for d in shapes[param]]:
        problems.append(f"shape {entry['shape']}, the graph's `{param}` is {shapes[param]}")
    if not paths or paths[0] != param:
        problems.append(f"`paths` must list `{param}` first, not {paths}")
    for path in paths:
        if shapes.get(path) != shapes[param]:
            problems.append(f"`{path}` has shape {shapes.get(path)}, `{param}` {shapes[param]}")
        if path in claimed:
            problems.append(f"`{path}` is in entry {claimed[path]} too")
        claimed[path] = index
    readers = [s["stage"] for s in stages if set(paths) & set(s["params"])]
    if entry["stages"] != readers:
        problems.append(f"`stages` {entry['stages']}, but stages {readers} read "
                        f"{', '.join(paths)}")
    if len(readers) < 2 and len(paths) < 2:
        problems.append(f"`{param}` is read by one stage under one name: nothing is shared")
    return problems


def _ops(stage: int, ops: list, entries: list, streams: dict, frozen) -> list[str]:
    want = [i for i, e in enumerate(entries) if stage in e["stages"] and reduced(e, frozen)]
    found = [(i, op) for i, op in enumerate(ops) if is_shared_op(op)]
    if [op.get("shared") for _, op in found] != want:
        return [f"shared all-reduces {[op.get('shared') for _, op in found]}, expected "
                f"{want} (each trained entry of two stages or more it holds, in order)"]
    problems = []
    compute = [i for i, op in enumerate(ops) if op.get("kind") in ("forward", "backward")]
    buckets = [i for i, op in enumerate(ops) if op.get("kind") == "all_reduce"
               and not is_shared_op(op)]
    update = [i for i, op in enumerate(ops) if op.get("kind") in ("optimizer_step",
                                                                   "broadcast")]
    for at, op in found:
        fields = (op.get("kind"), op.get("what"), op.get("reduce"), op.get("stream"))
        if fields != ("all_reduce", "gradients", "sum", streams["comm"]):
            problems.append(f"shared {op['shared']}: expected an all_reduce of gradients, "
                            f"reduce sum, stream {streams['comm']}, not {fields}")
        if at < max(compute + buckets, default=-1) or at > min(update, default=len(ops)):
            problems.append(f"shared {op['shared']}: its all_reduce must follow the last "
                            "backward and the buckets' all-reduces and come before the "
                            "optimizer step")
    return problems
