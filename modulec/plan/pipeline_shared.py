"""Parameters shared between pipeline stages as Schedule IR data: the `shared` list of the
`pipeline` section and the all-reduces that sum their gradients (docs/pipeline.md,
"Shared and tied parameters"; Megatron-LM's embedding group).

A parameter's tensor is shared when two stages read it (Llama's or Gemma's tied LM head
reads the embedding table itself: stage 0's embedding and the last stage's head) or when
two parameter paths name it (GPT-2's `lm_head: tied_to(wte)`: the weight schema's
`tied` entries; the target owns the tensor). One entry per such tensor:

    {"param": "wte", "paths": ["wte", "lm_head"], "stages": [0, 1],
     "shape": [50257, 768], "numel": ..., "bytes": ...}

`param` is the owner (the tied target: the name a one-process trainer gives its value,
gradient and optimizer state, and the name checkpoints write), `paths` every parameter
path that reads its tensor, `stages` the stages whose `params` list any of them. Every
stage in `stages` holds its own copy of `param`, loaded or drawn as one process does;
the gradients a stage makes for any of the paths add up to its gradient of `param`.

A trained entry (not `@frozen`) read by two stages or more gets, on each of its stages,
one `all_reduce` op (`group` "shared", `reduce` "sum", `shared`: the entry's index)
after the data-parallel all-reduces and before ZeRO-1's optimizer step, in entry order:
the sum over exactly those stages (one group per entry, per pipeline replica and TP
index), so every copy takes the same AdamW step. Global gradient-norm clipping counts
each entry once, on the first of its stages.
"""

from __future__ import annotations

from modulec.ir.graph import COMM_STREAM as COMM
from modulec.plan.distributed import GRAD_BYTES, _numel

GROUP = "shared"  # the collective's process group: the stages holding the entry
REDUCE = "sum"


def schema_ties(weight_schema: list) -> dict[str, str]:
    """A document's entry-level ties: tied parameter path -> its target (`tied_to`). A tie
    inside repeated layers (its path a template) is not one the section records."""
    return {e["param"]: e["target"] for e in weight_schema
            if e.get("kind") == "tied" and not e.get("stacks") and e.get("target")}


def shared_parameters(stages: list[dict], ties: dict[str, str], shapes: dict) -> list[dict]:
    """The section's `shared` entries of `stages` (each with its `params`): every tensor
    two stages read or two paths name, in the order stages first list it."""
    owner = {path: ties.get(path, path) for stage in stages for path in stage["params"]}
    readers: dict[str, list[int]] = {}
    paths: dict[str, list[str]] = {}
    for stage in stages:
        for path in stage["params"]:
            param = owner[path]
            readers.setdefault(param, [])
            if stage["stage"] not in readers[param]:
                readers[param].append(stage["stage"])
            paths.setdefault(param, [param])
            if path not in paths[param]:
                paths[param].append(path)
    entries = []
    for param, held in readers.items():
        if len(held) < 2 and len(paths[param]) < 2:
            continue
        shape = [int(d) for d in shapes[param]]
        entries.append({"param": param, "paths": paths[param], "stages": sorted(held),
                        "shape": shape, "numel": _numel(shape),
                        "bytes": _numel(shape) * GRAD_BYTES})
    return entries


def owners(section: dict) -> dict[str, str]:
    """Each parameter path of the section's `shared` entries -> the entry's `param`."""
    return {path: entry["param"] for entry in section.get("shared", ())
            for path in entry["paths"]}


def reduced(entry: dict, frozen) -> bool:
    """Whether the entry's copies' gradients are summed: trained, on two stages or more."""
    return len(entry["stages"]) > 1 and entry["param"] not in frozen


def shared_ops(section: dict, stage: int, frozen) -> list[dict]:
    """Stage `stage`'s all-reduces of its shared entries' gradients, in entry order."""
    return [{"kind": "all_reduce", "what": "gradients", "shared": index, "group": GROUP,
             "reduce": REDUCE, "phase": "reduce", "stream": COMM}
            for index, entry in enumerate(section.get("shared", ()))
            if stage in entry["stages"] and reduced(entry, frozen)]


def is_shared_op(op: dict) -> bool:
    return op.get("group") == GROUP
