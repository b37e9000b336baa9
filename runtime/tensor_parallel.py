"""Tensor parallel in the reference runtime: which parameters a rank holds a slice of,
and the slicing (a rank's shard of a whole tensor, and the whole tensor from every rank's
shard), as the IR's `tensor_parallel` section and the weight schema's `shard` say.

A shard `{"dim": d, "parts": [p0, p1, ...], "size": M}` splits dim d into its parts
(q, k, v rows; the gate and up halves) and each part into M equal blocks: rank r holds
block r of every part, in part order (modulec.lower.tensor_parallel). The collectives
themselves are the kernels of runtime.kernels.comm.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from runtime.interpreter import _join, child_path
from runtime.program import tp_section, tp_size


def shard_tensor(whole: Tensor, shard: dict, rank: int) -> Tensor:
    """Rank `rank`'s slice of `whole`."""
    dim, size = shard["dim"], shard["size"]
    pieces, start = [], 0
    for part in shard["parts"]:
        block = part // size
        pieces.append(whole.narrow(dim, start + rank * block, block))
        start += part
    return torch.cat(pieces, dim=dim).contiguous()


def unshard_tensors(slices: list[Tensor], shard: dict) -> Tensor:
    """The whole tensor from every rank's slice (rank order)."""
    dim, size = shard["dim"], shard["size"]
    pieces, start = [], 0
    for part in shard["parts"]:
        block = part // size
        pieces += [s.narrow(dim, start, block) for s in slices]
        start += block
    return torch.cat(pieces, dim=dim)


def sharded_paths(program) -> dict[str, dict]:
    """Concrete parameter path (`blocks[1].attention.qkv_weight`) -> its shard, for a
    program built with `--tp` ({} without)."""
    section = tp_section(program.document)
    if not section:
        return {}
    graph, found = program.graph, {}

    def walk(function, path: str, indices: tuple) -> None:
        for name, shard in section["shards"].get(function.name, {}).items():
            found[_join(path, name)] = shard
        for node in function.nodes:
            if node.kind == "call":
                callee = graph.function(node.target)
                for layer in range(int(node.repeat)):
                    inner_path, inner = child_path(callee, path, indices, node, layer)
                    walk(callee, inner_path, inner)

    walk(graph.function(graph.entry), "", ())
    return found


def shard_params(whole: dict[str, Tensor], program, rank: int) -> dict[str, Tensor]:
    """This rank's parameters from the whole ones (the others are shared as they are); a
    tensor under two paths (a tied head and its table) gives one slice, still shared."""
    shards, slices = sharded_paths(program), {}

    def sliced(path: str, value: Tensor) -> Tensor:
        if id(value) not in slices:
            slices[id(value)] = shard_tensor(value, shards[path], rank)
        return slices[id(value)]
    return {path: sliced(path, value) if path in shards else value
            for path, value in whole.items()}


def unshard_params(per_rank: list[dict[str, Tensor]], program) -> dict[str, Tensor]:
    """The whole parameters (or gradients) from every rank's, rank order; a replicated
    one is rank 0's."""
    shards = sharded_paths(program)
    return {path: unshard_tensors([r[path] for r in per_rank], shards[path])
            if path in shards else value for path, value in per_rank[0].items()}


def local_schema(schema: list) -> list:
    """The weight schema of one rank's parameters (HF export of its slices): a sharded
    entry's dim is 1/M of the checkpoint's."""
    out = []
    for entry in schema:
        shard = entry.get("shard")
        if shard:
            shape = list(entry["shape"])
            shape[shard["dim"]] //= shard["size"]
            entry = dict(entry, shape=shape)
        out.append(entry)
    return out


def local_layout(layout: dict, schema: list) -> dict:
    """The part sizes of fused parameters (HF export) on one rank: a sharded entry's
    parts are 1/M of the whole (each part is split evenly)."""
    sizes = {e["param"]: e["shard"]["size"] for e in schema if e.get("shard")}
    return {key: [s // sizes[_entry(key, sizes)] for s in parts] if _entry(key, sizes) else parts
            for key, parts in layout.items()}


def whole_layout(layout: dict, schema: list) -> dict:
    """The part sizes of fused parameters for the whole tensors (a checkpoint written from
    every rank's slices joined): `local_layout` undone."""
    sizes = {e["param"]: e["shard"]["size"] for e in schema if e.get("shard")}
    return {key: [s * sizes[_entry(key, sizes)] for s in parts] if _entry(key, sizes) else parts
            for key, parts in layout.items()}


def _entry(key: str, sizes: dict) -> str | None:
    if key in sizes:
        return key
    pattern = re.sub(r"\[\d+\]", "[*]", key)
    return next((e for e in sizes if re.sub(r"\[\{\w+\}\]", "[*]", e) == pattern), None)


def vocab_outputs(program) -> list[str]:
    """The outputs split over the vocabulary (the logits of a `@shard(vocab)` LM head):
    each rank holds its block of the last dim ([] without `--tp`, or with a replicated
    head)."""
    return list(tp_section(program.document).get("vocab_outputs", ()))


def logits_loss(program, output: str):
    """The trainers' mean cross-entropy for `output`: fn(logits, labels, chunk_rows,
    ignore_index=, denominator=) -> (loss, d_logits), vocab-parallel when the logits are
    split over the vocabulary (runtime.kernels.vocab_parallel), else
    runtime.cuda.lm_head.logits_cross_entropy."""
    from runtime.cuda.lm_head import logits_cross_entropy

    if output not in vocab_outputs(program):
        return logits_cross_entropy
    from runtime.kernels.vocab_parallel import mean_cross_entropy

    size = tp_size(program.document)
    return lambda logits, labels, chunk_rows=None, ignore_index=-100, denominator=None: \
        mean_cross_entropy(logits, labels, size, ignore_index=ignore_index,
                           chunk_rows=chunk_rows, denominator=denominator)
