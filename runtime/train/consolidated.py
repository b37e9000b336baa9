"""The consolidated files of a checkpoint (`model.safetensors`, or HF's shards and index,
and `optimizer.safetensors` where the ranks' shards do not replace it), written by rank
0 tensor by tensor from a `source`: the whole parameters are gathered one bucket or one
parameter at a time (the same collectives as training's), converted to the checkpoint's
names and dtype, written at their offsets (runtime.hf_weights.stream) and dropped, so
rank 0 holds O(largest bucket or tensor) of host memory, not O(model).

A source has `shapes()` (path -> whole shape, rank 0's; collective for a pipeline),
`entries()` (a collective every rank runs to its end: rank 0 gets (path, {"masters",
"exp_avg", "exp_avg_sq"}) one parameter at a time, the other ranks nothing to keep),
`moments` (the paths whose entries carry their moments) and `extra` (small tensors for
the optimizer file: an FP8 recipe's amax histories). `drain()` is a rank's part of the
collective when another rank writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from modulec.lower.lora import is_adapter
from runtime.hf_weights.stream import MAX_SHARD_SIZE, Spec, StreamCheckpoint, StreamFile

PARTS = ("masters", "exp_avg", "exp_avg_sq")
MOMENTS = PARTS[1:]


class Source:
    moments: set = frozenset()
    extra: dict = {}
    step = 0  # the optimizer steps taken (optimizer.safetensors' metadata)

    def drain(self) -> None:
        self.shapes()
        for _ in self.entries():
            pass


class LocalSource(Source):
    """A state held whole here (`trainer.state()`: one process, ZeRO-0, or under --tp a
    rank's slices); `shapes` where reading a master would copy it (the GPU's joined
    halves)."""

    def __init__(self, state: dict, moments: bool = True, shapes: dict | None = None):
        self.state, self.given, self.step = state, shapes, int(state.get("step", 0))
        masters = state["masters"]
        self.moments = {p for p in state.get("exp_avg", {}) if p in masters} \
            if moments else set()
        self.extra = {f"fp8.{k}": t for k, t in state.get("fp8", {}).items()}

    def shapes(self) -> dict:
        if self.given is not None:
            return {p: tuple(self.given[p]) for p in self.state["masters"]}
        return {p: tuple(t.shape) for p, t in self.state["masters"].items()}

    def entries(self):
        for path in list(self.state["masters"]):
            parts = {"masters": self.state["masters"][path]}
            if path in self.moments:
                parts |= {part: self.state[part][path] for part in MOMENTS}
            yield path, parts


class ZeroSource(Source):
    """ZeRO buckets (runtime.dist.zero.ZeroRun.full_state): each bucket instance gathered
    over the data-parallel group, then its parameters; `keep` on the ranks that keep what
    they gather (data-parallel rank 0); `extra_masters` (path -> whole tensor): the
    parameters in no bucket (frozen), after them."""

    def __init__(self, zero, moments: bool, keep: bool, extra_masters: dict, step: int):
        self.zero, self.keep, self.others, self.step = zero, keep, extra_masters, step
        self.moments = set(zero.paths) if moments else set()
        self.with_moments = moments

    def shapes(self) -> dict:
        shapes = {}
        for bucket in self.zero.buckets:
            for i in range(bucket.count):
                for p in bucket.spec["params"]:
                    shapes[self.zero._path(bucket, i, p["name"])] = tuple(p["shape"])
        return shapes | {p: tuple(t.shape) for p, t in self.others.items()}

    def entries(self):
        for path, master, m, v in self.zero.full_state(self.with_moments):
            if self.keep:
                yield path, {"masters": master} | (
                    {"exp_avg": m, "exp_avg_sq": v} if self.with_moments else {})
        if self.keep:
            yield from ((p, {"masters": t}) for p, t in self.others.items())


class TensorParallelSource(Source):
    """A tensor-parallel rank's `inner` source (its slices) joined over `group` (`size`
    ranks, this one `index`) into whole tensors, one parameter at a time (an all_gather
    of each sharded part); the TP group's first rank yields them. `sharded`: path -> its
    shard (runtime.tensor_parallel.sharded_paths)."""

    def __init__(self, inner: Source, sharded: dict, group, size: int, index: int):
        self.inner, self.sharded, self.group = inner, sharded, group
        self.size, self.index = size, index
        self.moments, self.extra, self.step = inner.moments, inner.extra, inner.step

    def shapes(self) -> dict:
        return {p: whole_shape(s, self.sharded.get(p)) for p, s in self.inner.shapes().items()}

    def entries(self):
        for path, parts in self.inner.entries():
            if path in self.sharded:
                parts = {k: joined(t, self.sharded[path], self.group, self.size)
                         for k, t in parts.items()}
            if self.index == 0:
                yield path, parts


def whole_shape(shape, shard: dict | None) -> tuple:
    """The whole tensor's shape from a slice's (the shard's parts are the whole sizes)."""
    if shard is None:
        return tuple(shape)
    shape = list(shape)
    shape[shard["dim"]] = sum(shard["parts"])
    return tuple(shape)


def joined(part: Tensor, shard: dict, group, size: int) -> Tensor:
    """The whole tensor from every TP rank's slice `part` (a collective over `group`, on
    the group's device: NCCL takes device tensors), on the host."""
    from runtime.tensor_parallel import unshard_tensors

    device = collective_device(group)
    mine = part.detach().to(device).contiguous()
    slices = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(slices, mine, group=group)
    return unshard_tensors([s.cpu() for s in slices], shard)


def collective_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensor_parallel(source: Source, model, parallel, rank: int) -> Source:
    """A tensor-parallel rank's source (without --pp) joined over its TP group."""
    from runtime.tensor_parallel import sharded_paths

    sharded = sharded_paths(model.source.program(planned=False))
    return TensorParallelSource(source, sharded, parallel.tp_group, parallel.tp,
                                rank % parallel.tp)


# ---------------------------------------------------------------------- the write
def write_consolidated(source: Source, folder: Path, *, schema: list, layout: dict,
                       dtype: torch.dtype, optimizer: str | None,
                       optimizer_format: str, max_shard_size: int = MAX_SHARD_SIZE,
                       opener=StreamFile) -> dict[str, Tensor]:
    """Rank 0's write of `model.safetensors` (the base parameters, LoRA's adapters left
    out) and, with `optimizer` (its file name), the fp32 masters and moments, from one
    pass over `source`. Returns the adapters' whole fp32 masters (small: save_lora's)."""
    from runtime.hf_weights.export import StreamExport

    shapes = source.shapes()
    plan = StreamExport(schema, {p: s for p, s in shapes.items() if not is_adapter(p)},
                        layout, dtype)
    files, adapters = [], {}
    try:
        files.append(StreamCheckpoint(folder, plan.specs, max_shard_size, opener))
        if optimizer is not None:
            metadata = {"step": str(int(source.step)), "format": optimizer_format}
            files.append(opener(folder / optimizer, optimizer_specs(source, shapes),
                                metadata))
        for path, parts in source.entries():
            master = parts["masters"].detach().float().cpu()
            if is_adapter(path):
                adapters[path] = parts["masters"].detach().cpu()
            else:
                for name, tensor in plan.convert(path, master):
                    files[0].write(name, tensor)
            if optimizer is not None:
                _write_optimizer_entry(files[1], path, master, parts)
        for name, tensor in source.extra.items() if optimizer is not None else ():
            files[1].write(name, tensor.detach().cpu().contiguous())
        for file in files:
            file.close()
    except BaseException:
        for file in files:
            file.abort()
        raise
    return adapters


def _write_optimizer_entry(file, path: str, master: Tensor, parts: dict) -> None:
    file.write(f"master.{path}", master)
    for part in MOMENTS:
        if part in parts:
            file.write(f"{part}.{path}", parts[part].detach().float().cpu().contiguous())


def optimizer_specs(source: Source, shapes: dict) -> list[Spec]:
    """optimizer.safetensors' tensors: `master.<path>` of every parameter, the moments of
    those that have them, all fp32; then the extra ones as they are."""
    specs = [Spec(f"master.{p}", s, torch.float32) for p, s in shapes.items()]
    specs += [Spec(f"{part}.{p}", shapes[p], torch.float32)
              for part in MOMENTS for p in shapes if p in source.moments]
    return specs + [Spec(n, tuple(t.shape), t.dtype) for n, t in source.extra.items()]
