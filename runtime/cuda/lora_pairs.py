"""Where the GPU step's interpreter (runtime/cuda/step_interpreter.py) runs LoRA's delta
as part of another op: in a function, each `y = add(base, d)` whose `d = matmul(t, B, NT)`
(the `lora` pass's `%lora` values, modulec/lower/lora.py) may run as one addmm, base's
own matmul deferred to the add where its input lives long enough, and the node making t
where t may be written into x's spare columns (runtime/cuda/lora_kcat.py). Analysis of
the IR alone: no tensors, no kernels."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraPairs:
    adds: dict = field(default_factory=dict)  # add node id -> (its delta's matmul, inplace)
    deferred: set = field(default_factory=set)  # the matmuls the adds run (delta's, base's)
    # add node id -> base's matmul, deferred to the add: run into y's planned bytes
    bases: dict = field(default_factory=dict)
    # the node making t (x A^T) of a deferred base's pair -> that base's matmul (x W^T),
    # where no other pair's base reads x: t may be written into x's spare columns
    t_makers: dict = field(default_factory=dict)


def lora_addmm_pairs(function, saved=frozenset(), replayed=frozenset()) -> LoraPairs:
    """The `lora` pass's delta additions in `function` (modulec/lower/lora.py: values
    `%lora<n>`): `y = add(base, d)` whose `d = matmul(t, B, NT, alpha)` (B 2-D) is read by
    that add alone, is no output and no backward's saved value. `inplace` where `base` (a
    matmul's `%lora` output) has no other reader either; then base's matmul is deferred to
    the add too (`bases`) where its input x lives to the function's end (saved for the
    backward, or the function's input: no value the plan made after x's last reader can
    be in x's bytes when the add reads it). Nodes a planned replay runs again
    (`replayed`) are left as they are."""
    readers: dict = {}
    for node in function.nodes:
        for value in node.inputs:
            if value:
                readers[value] = readers.get(value, 0) + 1
    producer = {o: n for n in function.nodes for o in n.outputs if o}
    outputs = set(function.outputs)
    pinned = set(saved) | {v.id for v in function.inputs}
    pairs = LoraPairs()

    def private(value: str) -> bool:
        return (value.startswith("%lora") and readers.get(value) == 1
                and value not in outputs and value not in saved)

    for node in function.nodes:
        if node.kind != "op" or node.target != "add" or len(node.inputs) != 2 \
                or len(node.outputs) != 1 or node.id in replayed:
            continue
        base, d = node.inputs
        matmul = producer.get(d)
        if matmul is None or matmul.kind != "op" or matmul.target != "matmul" \
                or matmul.attr("transpose") != "NT" or matmul.id in replayed \
                or not private(d) or not base.startswith("%lora"):
            continue
        source = producer.get(base)
        inplace = private(base) and source is not None and source.kind == "op" \
            and source.target == "matmul"
        pairs.adds[node.id] = (matmul, inplace)
        pairs.deferred.add(matmul.id)
        if inplace and source.id not in replayed and len(source.inputs) == 2 \
                and source.inputs[0] in pinned and source.inputs[1].startswith("param:"):
            pairs.bases[node.id] = source
            pairs.deferred.add(source.id)
    _find_t_makers(pairs, producer, replayed)
    return pairs


def _find_t_makers(pairs: LoraPairs, producer: dict, replayed) -> None:
    """`pairs.t_makers`: each deferred base's t = matmul(x', A, NT) (x' is x, or dropout's
    output: only x's bytes matter), where x is no other base's input."""
    inputs = [source.inputs[0] for source in pairs.bases.values()]
    for add_id, source in pairs.bases.items():
        maker = producer.get(pairs.adds[add_id][0].inputs[0])
        if maker is not None and maker.kind == "op" and maker.target == "matmul" \
                and maker.attr("transpose") == "NT" and maker.id not in replayed \
                and inputs.count(source.inputs[0]) == 1:
            pairs.t_makers[maker.id] = source
