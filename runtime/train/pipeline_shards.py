"""Per-rank shard checkpoints of a pipeline run (`--pp P`): what runtime.train.shards
writes for data and tensor parallel, for a pipeline stage. Every rank writes its stage's
state exactly as held (`masters.<path>`, the fp32 masters on the GPU; `exp_avg.<path>`,
`exp_avg_sq.<path>`; under --tp its slices) into the same atomic `checkpoint-<step>/`
folder, through shards.py's ShardSave (temp files, the barrier, rank 0's publish), with
a layout that adds the pipeline's place (`pp`, `stage`) and a digest of the IR's pipeline
section (its stages' parameters and buckets, the shared list, the mesh).

Replicas of a stage (data-parallel pipelines) hold the same masters; each path is kept by
one replica only (`keeper`): under the section's ZeRO-1 the replica that owns its bucket
(which alone holds its moments), else replica 0. A resume on the same layout reads each
rank's own shard and hands each path from its keeper to the stage's other replicas (a
broadcast of tensors over the data-parallel group, in path order), the values copied into
the tensors the trainer holds. The shards hold the whole optimizer state, so the
consolidated `optimizer.safetensors` is not written (`joined_state` reads a resume on
another layout from the shards: each path from its keeper's file, under --tp its TP
ranks' slices joined by the `sharded` table of the index); rank 0 writes
`model.safetensors` from the masters streamed to it (`PipelineSource`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

PARTS = ("masters", "exp_avg", "exp_avg_sq")


def layout(trainer, context) -> dict:
    """What a pipeline rank's shard is only valid for (runtime.train.shards.own_shard
    compares every key)."""
    mesh, section = trainer.mesh, trainer.section
    weights = trainer.precision.weights(trainer.model.params)
    what = {"stages": [{k: s.get(k) for k in ("stage", "params", "grad_buckets")}
                       for s in section["stages"]],
            "shared": section["shared"], "mesh": section["mesh"],
            "zero": section.get("zero", 0),
            "shapes": {p: list(weights[p].shape) for p in trainer.names}}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    return {"world": context.world, "rank": context.rank, "pp": mesh.pp,
            "stage": mesh.stage, "dp": mesh.dp, "dp_rank": mesh.dp_index,
            "zero": section.get("zero", 0) if mesh.dp > 1 else None, "tp": mesh.tp,
            "tp_rank": mesh.tp_index, "layout": digest.hexdigest()[:16]}


def keepers(trainer) -> dict[str, int]:
    """Each of the stage's paths -> the replica whose shard keeps it: its bucket's owner
    under ZeRO-1, else replica 0."""
    owner = {}
    if trainer.section.get("zero", 0) == 1:
        for bucket in trainer.section["stages"][trainer.mesh.stage].get("grad_buckets", []):
            owner |= {row["path"]: bucket["owner"] for row in bucket["params"]}
    return {p: owner.get(p, 0) for p in trainer.names}


def held_state(trainer) -> dict[str, dict[str, Tensor]]:
    """The paths this replica keeps: their masters (fp32 on the GPU) and moments, as held
    (CPU copies taken by runtime.train.shards.rank_tensors)."""
    weights = trainer.precision.weights(trainer.model.params)
    kept = [p for p, d in keepers(trainer).items() if d == trainer.mesh.dp_index]
    a = trainer.adamw
    return {"masters": {p: weights[p] for p in kept},
            "exp_avg": {p: a.exp_avg[p] for p in kept if p in a.exp_avg},
            "exp_avg_sq": {p: a.exp_avg_sq[p] for p in kept if p in a.exp_avg_sq}}


@torch.no_grad()
def load_held(trainer, state: dict) -> None:
    """A shard's state back into the trainer made for the same layout: each path from its
    keeper (a broadcast over the stage's replicas where there are several), copied into
    the master and compute copy the trainer holds (StagePrecision.load), the moments into
    their tensors where they exist (a captured step reads them); then the step count (the
    device's too)."""
    mesh, a = trainer.mesh, trainer.adamw
    weights = trainer.precision.weights(trainer.model.params)  # loads copy into these
    for path, keeper in sorted(keepers(trainer).items()):
        here = keeper == mesh.dp_index
        like = weights[path]
        master = _handed(trainer, state["masters"].get(path) if here else None, like,
                         keeper)
        trainer.precision.load(trainer.model.params, path, master)
        if path in trainer.frozen:
            continue
        for part in ("exp_avg", "exp_avg_sq"):
            if trainer.owned is not None:  # ZeRO-1: the owner alone holds (and kept) them
                value = state[part].get(path) if here else None
            else:  # every replica holds them: the keeper's (zeros where it had none)
                value = _handed(trainer, state[part].get(path, torch.zeros_like(like))
                                if here else None, like, keeper)
            if value is not None:
                _put(getattr(a, part), path, value, like)
    a.step = int(state["step"])
    if trainer.device_adamw is not None:
        trainer.device_adamw.sync()


def _put(held: dict, path: str, value: Tensor, like: Tensor) -> None:
    """A moment copied into the tensor held for `path` (a captured step reads it), or
    held anew where there is none yet (a resume before the first step)."""
    if path in held and held[path].shape == value.shape:
        held[path].copy_(value)
    else:
        held[path] = value.to(like.device, like.dtype).clone()


def _handed(trainer, value: Tensor | None, like: Tensor, keeper: int) -> Tensor:
    """`value` (the keeper's) on every replica of the stage: a broadcast over the
    data-parallel group on the trainer's device (NCCL takes device tensors only)."""
    mesh = trainer.mesh
    if mesh.dp == 1:
        return value
    buffer = value.to(trainer.device, like.dtype).contiguous() if value is not None else \
        torch.empty(like.shape, dtype=like.dtype, device=trainer.device)
    dist.broadcast(buffer, src=mesh.replica_rank(keeper), group=mesh.dp_group)
    return buffer


def joined_state(folder: Path, indexes: list[dict]) -> dict:
    """The consolidated optimizer state (masters, exp_avg, exp_avg_sq by path, step) from
    every pipeline rank's shard: each path from its keeper's shard, under --tp the slices
    of the keeper's TP ranks joined (the index's `sharded`); a shared parameter's stages
    hold equal copies (the first stage's is kept)."""
    state = {part: {} for part in PARTS} | {"step": int(indexes[0]["step"])}
    groups: dict = {}
    for index in indexes:
        groups.setdefault((index.get("stage", 0), index.get("dp_rank", 0)), []).append(index)
    for key in sorted(groups):
        _join_group(folder, sorted(groups[key], key=lambda i: i.get("tp_rank", 0)), state)
    return state


def _join_group(folder: Path, ranks: list[dict], state: dict) -> None:
    """One stage replica's TP ranks' shards (tp_rank order) into `state`."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from runtime.tensor_parallel import unshard_tensors

    sharded = ranks[0].get("sharded", {})
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(folder / i["file"]), framework="pt"))
                   for i in ranks]
        for key in handles[0].keys():
            part, _, path = key.partition(".")
            if part not in PARTS or path in state[part]:
                continue
            value = unshard_tensors([h.get_tensor(key) for h in handles], sharded[path]) \
                if path in sharded else handles[0].get_tensor(key)
            state[part][path] = value.float()


class PipelineSource:
    """Every stage's masters for rank 0's consolidated write (runtime/train/
    consolidated.py), beside the shards (which hold the optimizer state): the first
    pipeline's ranks take part, the replicas hold the same masters. Under --tp each of a
    stage's parameters is first joined over its TP group (an all_gather of the slices);
    each stage's first TP rank sends its parameters one at a time on the trainer's device
    to rank 0, after a small pickled header (paths, whole shapes, dtypes). A shared
    parameter's copies are equal: the first stage's is kept."""

    moments: set = frozenset()
    extra: dict = {}

    def __init__(self, trainer):
        self.trainer, self.mesh, self.headers = trainer, trainer.mesh, None

    def shapes(self) -> dict:
        from runtime.train.consolidated import whole_shape

        mesh, trainer = self.mesh, self.trainer
        if mesh.dp_index or mesh.tp_index:
            return {}
        weights = trainer.precision.weights(trainer.model.params)
        header = [(p, list(whole_shape(weights[p].shape, trainer.sharded.get(p))),
                   str(weights[p].dtype).removeprefix("torch.")) for p in trainer.names]
        self.headers = [None] * mesh.pp if mesh.stage == 0 else None
        dist.gather_object(header, self.headers, dst=mesh.rank_of(0), group=mesh.pp_group)
        if mesh.stage:
            return {}
        shapes = {}
        for rows in self.headers:
            for path, shape, _ in rows:
                shapes.setdefault(path, tuple(shape))
        return shapes

    def entries(self):
        mesh = self.mesh
        if mesh.dp_index:  # the replicas hold the same masters
            return
        first = mesh.rank_of(0)
        for path, value in self._own():
            if mesh.stage:
                dist.send(value.to(self.trainer.device).contiguous(), dst=first,
                          group=mesh.pp_group)
            else:
                yield path, {"masters": value.cpu()}
        if mesh.stage or mesh.tp_index:
            return
        seen = {path for path, _, _ in self.headers[0]}
        for stage, rows in enumerate(self.headers[1:], 1):
            for path, shape, dtype in rows:
                buffer = torch.empty(shape, dtype=getattr(torch, dtype),
                                     device=self.trainer.device)
                dist.recv(buffer, src=mesh.rank_of(stage), group=mesh.pp_group)
                if path not in seen:
                    seen.add(path)
                    yield path, {"masters": buffer.cpu()}
                del buffer

    def _own(self):
        """This stage's masters, whole (joined over the TP group: every TP rank runs
        it), on its first TP rank; the others get none."""
        from runtime.train.consolidated import joined

        trainer, mesh = self.trainer, self.mesh
        weights = trainer.precision.weights(trainer.model.params)
        for path in trainer.names:
            value = weights[path].detach()
            if path in trainer.sharded:
                value = joined(value, trainer.sharded[path], mesh.tp_group, mesh.tp)
            if not mesh.tp_index:
                yield path, value

    def drain(self) -> None:
        self.shapes()
        for _ in self.entries():
            pass
