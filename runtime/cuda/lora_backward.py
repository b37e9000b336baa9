"""LoRA's d_x sums in the GPU step's backward (runtime/cuda/step_interpreter.py): no add.

The derived backward of an adapted projection `y = x W^T + s (x A^T) B^T` sums two
gradients of x: the frozen weight's `d_x0 = d_y W` (a matmul_backward whose d_W is
unwanted) and the adapter path's `d_x1 = d_t A` (the matmul_backward of `x A^T`), then
`d_x = add(d_x1, d_x0)` (or the other order): a full-size elementwise pass reading both
and writing d_x (4 of them a Llama layer: q/k/v, o, gate/up, down). Here the adapter
path's node writes d_x1 straight into the add's planned bytes, and the frozen weight's
GEMM, deferred to the add, adds its product there in cuBLAS's epilogue (`addmm_`,
beta = 1): d_x0 is never materialized and nothing is added elementwise. Off the arena
d_x1's own tensor takes the sum (it has no other reader).

Found in the IR (no new IR attr): the add's two inputs made by matmul_backward nodes,
read by the add alone and no output of the function; the base one (NT, its d_B
unwanted, B a parameter) the node right before the add (its inputs are then read where
the IR reads them). The redirection is checked when the adapter path's node runs: the
add's bytes must not hold any value read or written until the add (the plan may give y
the bytes of a value dead before the add); where they do, or an operand does not fit,
the nodes run as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.cuda.gemm import mm_into
from runtime.cuda.train_kernels import overlaps


@dataclass(frozen=True)
class DxPair:
    add: object  # the add node
    first: object  # the adapter path's matmul_backward (its output 0: the add's input)
    base: object  # the frozen weight's matmul_backward, deferred to the add
    between: tuple  # the nodes run after `first` and before the add (base among them)


@dataclass
class DxPairs:
    adds: dict = field(default_factory=dict)  # add id -> DxPair
    firsts: dict = field(default_factory=dict)  # first's id -> DxPair
    deferred: set = field(default_factory=set)  # the base nodes (run by their add)


def lora_dx_pairs(function, excluded=frozenset()) -> DxPairs:
    """The d_x sums of backward `function` an addmm can take (module docstring); nodes in
    `excluded` (FP8-covered GEMMs) are left as they are."""
    pairs = DxPairs()
    if not function.gradient_of:
        return pairs
    nodes = list(function.nodes)
    index = {n.id: i for i, n in enumerate(nodes)}
    readers: dict = {}
    for node in nodes:
        for value in node.inputs:
            if value:
                readers[value] = readers.get(value, 0) + 1
    producer = {o: n for n in nodes for o in n.outputs if o}
    outputs = set(function.outputs)

    def private(value: str) -> bool:
        return readers.get(value) == 1 and value not in outputs

    for i, node in enumerate(nodes):
        if node.kind != "op" or node.target != "add" or len(node.inputs) != 2 \
                or len(node.outputs) != 1 or not node.outputs[0] or i == 0:
            continue
        base = nodes[i - 1]
        if not _frozen_dx(base) or base.outputs[0] not in node.inputs:
            continue
        other = node.inputs[1] if node.inputs[0] == base.outputs[0] else node.inputs[0]
        first = producer.get(other)
        if first is None or first is base or first.kind != "op" \
                or first.target != "matmul_backward" or first.outputs[0] != other \
                or not (private(other) and private(base.outputs[0])) \
                or {first.id, base.id, node.id} & set(excluded):
            continue
        between = tuple(nodes[index[first.id] + 1:i])
        if any(n.kind != "op" for n in between):
            continue  # a call's own values (its frame's bytes) are not checked
        pair = DxPair(node, first, base, between)
        pairs.adds[node.id] = pair
        pairs.firsts[first.id] = pair
        pairs.deferred.add(base.id)
    return pairs


def _frozen_dx(node) -> bool:
    """A matmul_backward of `x @ W^T` (W a parameter) that wants d_x alone."""
    return node.kind == "op" and node.target == "matmul_backward" \
        and node.attr("transpose") == "NT" and len(node.inputs) == 3 \
        and node.inputs[2].startswith("param:") and len(node.outputs) == 2 \
        and bool(node.outputs[0]) and not node.outputs[1]


def target_bytes(run, pair: DxPair, frame, forward) -> torch.Tensor | None:
    """The add's planned bytes, where the first node may write its d_x there now: none of
    them is read or written by the first node or the nodes before the add (their inputs
    as they are now, their outputs' planned bytes). None off the arena or where they are."""
    arena = run.arena
    if arena is None:
        return None
    raw = arena.out_bytes(frame, pair.add, pair.add.outputs[0])
    if raw is None:
        return None
    for node in (pair.first, *pair.between):
        for value in node.inputs:
            tensor = _present(value, frame, forward)
            if tensor is not None and overlaps(tensor, raw):
                return None
        if node is pair.base:
            continue  # its output is never made
        for value in node.outputs[1:] if node is pair.first else node.outputs:
            if value and overlaps(planned_bytes(arena, frame, node, value), raw):
                return None
    return raw


def _present(value: str, frame, forward):
    """The value's tensor where it is already made (no restore, no replay: a restored
    value goes to the saved region's spare bytes, not an add's transient ones)."""
    for owner in (frame, forward):
        if owner is not None and value in owner.env:
            return owner.env[value]
    return None


def planned_bytes(arena, frame, node, value: str):
    """The bytes the arena will put `value` in (out_bytes, or its placement's range where
    the value lies inside another's block), or None."""
    raw = arena.out_bytes(frame, node, value)
    if raw is not None:
        return raw
    placement = arena.placements.get(frame.function.name, {}).get(value)
    if placement is None:
        return None
    start = arena._start(frame, placement)
    if start is None:
        return None
    return arena.regions[placement.region][start:start + placement.size_bytes]


def add_into(run, pair: DxPair, frame, forward) -> torch.Tensor | None:
    """d_x = d_x1 + alpha * d_y @ W in d_x1's tensor (the add's bytes on the arena), or
    None where it may not (then nothing is written): d_x1 not where the add's bytes are,
    not contiguous, of another dtype, or overlapping an operand."""
    base, add = pair.base, pair.add
    other = add.inputs[1] if add.inputs[0] == base.outputs[0] else add.inputs[0]
    d_x1 = frame.env.get(other)
    d_y = run._read(base.inputs[0], frame, forward)
    w = run._read(base.inputs[2], frame, forward)
    if not all(isinstance(t, torch.Tensor) for t in (d_x1, d_y, w)) or w.dim() != 2 \
            or not d_x1.is_contiguous() or d_x1.dim() < 2 or d_y.dim() < 2 \
            or tuple(d_x1.shape[:-1]) != tuple(d_y.shape[:-1]) \
            or d_x1.shape[-1] != w.shape[1] or d_y.shape[-1] != w.shape[0] \
            or not (d_x1.dtype == d_y.dtype == w.dtype) \
            or overlaps(d_x1, d_y) or overlaps(d_x1, w):
        return None
    if run.arena is not None:
        raw = run.arena.out_bytes(frame, add, add.outputs[0])
        if raw is None or raw.data_ptr() != d_x1.data_ptr():
            return None
    alpha = float(base.attr("alpha") or 1.0)
    mm_into(d_y.reshape(-1, w.shape[0]), w, d_x1.view(-1, w.shape[1]), alpha, beta=1.0)
    return d_x1


def stacked_param_grads(function) -> frozenset:
    """Values of backward `function` made by a matmul_backward, read by concat_backward
    nodes alone that split them along dim 0 into parameter gradients only (LoRA's stacked
    d_A of a fused projection: its parts are contiguous row blocks)."""
    if not function.gradient_of:
        return frozenset()
    grads = {g for _, g in function.param_grads}
    readers: dict = {}
    for node in function.nodes:
        for value in node.inputs:
            if value:
                readers.setdefault(value, []).append(node)
    found = set()
    for node in function.nodes:
        if node.kind != "op" or node.target != "matmul_backward":
            continue
        for value in node.outputs:
            users = readers.get(value, [])
            if value and value not in function.outputs and users and all(
                    u.kind == "op" and u.target == "concat_backward" and u.attr("dim") == 0
                    and all(not o or o in grads for o in u.outputs) for u in users):
                found.add(value)
    return frozenset(found)


def widened_parts(function, pairs: DxPairs, joins: dict) -> dict:
    """{value: (DxPair, concat)} for each pair whose d_y (its base's input 0) is a concat
    planned in place, or a view of one (`joins`: {part: modulec.plan.joins.Part}; the
    fused projections' d_gate | d_up, and d_q | d_k | d_v viewed as [B, T, N]): d_y, the
    concat and each of its parts, the values whose writing first moves the concat into
    the one-GEMM d_x's scratch (runtime/arena.py `widen`)."""
    from modulec.plan.from_graph import ALIASES

    producer = {o: n for n in function.nodes for o in n.outputs if o}
    concats = {where.concat for where in joins.values()}
    found = {}
    for pair in pairs.adds.values():
        d_y = source = pair.base.inputs[0]
        while source not in concats and source in producer \
                and producer[source].target in ALIASES and producer[source].inputs:
            source = producer[source].inputs[0]
        if source in concats:
            parts = [part for part, where in joins.items() if where.concat == source]
            found.update({value: (pair, source) for value in (d_y, source, *parts)})
    return found
