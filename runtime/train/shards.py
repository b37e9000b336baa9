"""Per-rank shard checkpoints: beside the consolidated checkpoint (runtime.train.checkpoint,
which rank 0 writes from the gathered state), every rank of a run whose ranks hold parts
of the state (data parallel with ZeRO >= 1, or tensor parallel) writes what it holds into
the same `checkpoint-<step>/` folder:

- `shard-rank<r>.safetensors`: with ZeRO, per bucket instance (`zero.<key>.<part>`) this
  rank's part of the master (`hi`: the fp32 master, or on the GPU its bf16 compute half,
  and `lo` its int16 low half), `exp_avg` and `exp_avg_sq`, exactly as held; without
  ZeRO (tensor parallel alone) `<part>.<path>` of its slices; `rng.cpu` / `rng.cuda`;
- `shard-rank<r>.json`: the run's layout (world size, rank, data-parallel size and rank,
  ZeRO stage, tensor-parallel size and rank, a digest of the bucket layout), the step
  and the data position (samples taken).

Under ZeRO alone (no tensor parallel, nothing frozen) the shards replace the consolidated
`optimizer.safetensors` (rank 0 gathers and writes the masters only, for
`model.safetensors`, one bucket at a time: runtime/train/consolidated.py): an 8B model's
optimizer state is 96 GB, which would otherwise be on disk twice. Elsewhere (tensor
parallel without --pp, a LoRA run's frozen base) rank 0 streams the consolidated
optimizer file in the same pass as the weights. Each index then carries the bucket layout, and a resume on another layout joins
the shards back into whole tensors (`whole_state`); bucket offsets do not depend on the
number of ranks, only the padding does.

Each file goes through a temp file + fsync + rename into rank 0's temporary folder, which
rank 0 publishes only after every rank's shard is in (a barrier): the shards are part of
the same atomic checkpoint. A resume on the same layout (every rank finds its own shard
and the layouts match) loads the shards with no gathering; any other resume (another
world size, stage or tensor-parallel size) reads the consolidated files. Every rank must
agree, so the choice is made together (one all_gather of the ranks' verdicts).

A pipeline (`--pp`) uses the same save and resume with its own layout and state
(runtime/train/pipeline_shards.py: the trainer's `shard_state` / `load_shard`); its
shards replace `optimizer.safetensors` too (under --tp with each path's slices and how
they join), joined by path on another layout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.hf_weights.stream import atomic_text, atomic_write

FORMAT = "modulec-shard/1"
PARTS = ("masters", "exp_avg", "exp_avg_sq")


def shard_name(rank: int) -> str:
    return f"shard-rank{rank:05d}"


def wants_shards(parallel) -> bool:
    """Whether ranks hold parts of the state (ZeRO >= 1 over several data-parallel ranks,
    or tensor-parallel slices); ZeRO-0 ranks hold it all: the consolidated copy is it."""
    return parallel is not None and ((parallel.dp > 1 and parallel.zero >= 1)
                                     or parallel.tp > 1)


# ---------------------------------------------------------------------- the rank's state
def zero_of(trainer):
    """The trainer's runtime.dist.zero.ZeroRun (CPU or GPU), None without one."""
    zero = getattr(trainer, "zero", None)
    return zero if zero is not None else getattr(getattr(trainer, "step", None), "zero", None)


def step_of(trainer) -> int:
    step = getattr(trainer, "step", None)
    if step is not None and hasattr(step, "step_count"):
        return int(step.step_count.item())
    return int(trainer.adamw.step)


def rank_tensors(trainer) -> dict[str, Tensor]:
    """What this rank holds, by key, on the CPU (copies)."""
    zero = zero_of(trainer)
    if zero is not None:
        tensors = zero_tensors(zero)
    else:  # tensor parallel alone: the rank's slices, whole; a pipeline stage's own
        held = getattr(trainer, "shard_state", None)
        state = held() if held is not None else trainer.state()
        tensors = {f"{part}.{p}": t.detach().cpu().clone().contiguous()
                   for part in PARTS for p, t in state[part].items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def zero_tensors(zero) -> dict[str, Tensor]:
    tensors = {}
    for bucket in zero.buckets:
        for i in range(bucket.count):
            key = f"zero.{bucket.key(i)}"
            held = {"hi": bucket.hi[i], "lo": bucket.lo[i], "exp_avg": bucket.exp_avg[i],
                    "exp_avg_sq": bucket.exp_avg_sq[i]}
            tensors |= {f"{key}.{part}": t.detach().cpu().clone().contiguous()
                        for part, t in held.items() if t is not None}
    return tensors


def load_rank_tensors(trainer, tensors: dict[str, Tensor], step: int) -> None:
    """Put a shard back (the trainer was made for the same layout)."""
    zero = zero_of(trainer)
    if zero is not None:
        load_zero_tensors(zero, tensors)
        _set_step(trainer, step)
    else:
        state = {part: {k[len(part) + 1:]: t for k, t in tensors.items()
                        if k.startswith(part + ".")} for part in PARTS}
        getattr(trainer, "load_shard", trainer.load_state)(state | {"step": step})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def load_zero_tensors(zero, tensors: dict[str, Tensor]) -> None:
    """Each bucket instance's parts copied in place (views and captured graphs keep their
    storage); below ZeRO-3 the whole compute weights are then all-gathered from the
    shards, as after an update (a collective over the data-parallel group, in bucket
    order on every rank)."""
    from runtime.dist.collectives import all_gather_into

    with torch.no_grad():
        for bucket in zero.buckets:
            for i in range(bucket.count):
                key = f"zero.{bucket.key(i)}"
                for part, into in (("hi", bucket.hi[i]), ("lo", bucket.lo[i]),
                                   ("exp_avg", bucket.exp_avg[i]),
                                   ("exp_avg_sq", bucket.exp_avg_sq[i])):
                    if into is not None:
                        into.copy_(tensors[f"{key}.{part}"])
                if not bucket.sharded and zero.zero >= 1 and zero.dp > 1:
                    all_gather_into(bucket.weights[i], bucket.hi[i], zero.group)


def _set_step(trainer, step: int) -> None:
    inner = getattr(trainer, "step", None)
    if inner is not None and hasattr(inner, "step_count"):
        inner.step_count.fill_(float(step))
        trainer.steps_run = 0  # the next step runs eagerly, then captures again
    else:
        trainer.adamw.step = step


# ---------------------------------------------------------------------- layout
def layout(trainer, parallel, context) -> dict:
    """What a shard is only valid for: the run's shape and the rank's place in it."""
    zero = zero_of(trainer)
    if zero is not None:
        buckets = [{k: v for k, v in b.items() if k != "gradient_slot"}  # no shard layout
                   for b in zero.section["buckets"]]
        what = json.dumps({"buckets": buckets, "mesh": zero.section["mesh"]}, sort_keys=True)
    else:
        what = json.dumps({"params": _shapes(trainer)}, sort_keys=True)
    return {"world": context.world, "rank": context.rank, "dp": parallel.dp,
            "dp_rank": parallel.dp_rank, "zero": parallel.zero if parallel.dp > 1 else None,
            "tp": parallel.tp, "tp_rank": context.rank % parallel.tp,
            "layout": hashlib.sha256(what.encode()).hexdigest()[:16]}


def _shapes(trainer) -> dict:
    step = getattr(trainer, "step", None)
    if step is not None and hasattr(step, "shapes"):  # the GPU step
        return {p: list(s) for p, s in sorted(step.shapes().items())}
    return {p: list(trainer.model.params[p].shape) for p in trainer.names}


def describe(shape: dict | None) -> str:
    if not shape:
        return "one process"
    text = f"{shape['world']} ranks" + (f", --pp {shape['pp']}" if "pp" in shape else "")
    if shape.get("zero") is not None:
        text += f", ZeRO {shape['zero']}"
    return text + (f", --tp {shape['tp']}" if shape.get("tp", 1) > 1 else "")


# ---------------------------------------------------------------------- writing
def write_shard(folder: Path, trainer, shape: dict, data: dict) -> None:
    """This rank's shard files into `folder` (rank 0's temporary checkpoint folder)."""
    from safetensors.torch import save_file

    name = shard_name(shape["rank"])
    tensors = rank_tensors(trainer)
    step = step_of(trainer)
    atomic_write(folder / f"{name}.safetensors",
                 lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT,
                                                               "step": str(step)}))
    index = shape | {"format": FORMAT, "step": step, "data": data,
                     "file": f"{name}.safetensors",
                     "bytes": (folder / f"{name}.safetensors").stat().st_size}
    zero = zero_of(trainer)
    if zero is not None:  # what whole_state needs to join the shards on another layout
        index["buckets"] = zero.section["buckets"]
    if "pp" in shape and shape["tp"] > 1:  # a pipeline stage's slices: how they join
        index["sharded"] = {p: trainer.sharded[p] for p in trainer.names
                            if p in trainer.sharded}
    text = json.dumps(index, indent=2) + "\n"
    atomic_text(folder / f"{name}.json", text)


class ShardSave:
    """One save's coordination: rank 0 makes the temporary folder and tells the others
    its name; every rank writes its shard there; rank 0 publishes after all are in."""

    def __init__(self, trainer, shape: dict, data: dict):
        self.trainer, self.shape, self.data = trainer, shape, data
        self.replaces_optimizer = replaces_optimizer(trainer, shape)

    def leader(self, temp: Path) -> None:
        """Rank 0, inside save_checkpoint before the consolidated files are written."""
        dist.broadcast_object_list([str(temp)], src=0)
        write_shard(temp, self.trainer, self.shape, self.data)
        dist.barrier()  # every shard is in

    def follower(self, between=None) -> None:
        """Any other rank: write into rank 0's folder, run `between` (its part of the
        gathers rank 0 writes the consolidated files from), then wait until it is
        published."""
        box = [None]
        dist.broadcast_object_list(box, src=0)
        write_shard(Path(box[0]), self.trainer, self.shape, self.data)
        dist.barrier()  # every shard is in
        if between is not None:
            between()
        dist.barrier()  # rank 0 published the checkpoint

    def published(self) -> None:
        dist.barrier()


def replaces_optimizer(trainer, shape: dict) -> bool:
    """Whether the shards hold the whole optimizer state: ZeRO over every trained
    parameter, no tensor parallel and nothing frozen (LoRA's base masters are in no
    shard)."""
    if "pp" in shape:  # a pipeline's shards: every path in its keeper's (under --tp its
        return True  # TP ranks' slices, joined by the index's `sharded`)
    zero = zero_of(trainer)
    if zero is None or shape.get("tp", 1) > 1 or getattr(trainer, "frozen", None):
        return False
    return all(p in zero.paths for p in getattr(trainer, "names", ()))


# ---------------------------------------------------------------------- resuming
def own_shard(folder: Path, shape: dict | None) -> tuple[dict | None, str]:
    """(this rank's shard index, "") when its shard fits this run, else (None, why not)."""
    if shape is None:
        return None, "this run is one process"
    path = folder / f"{shard_name(shape['rank'])}.json"
    if not path.is_file():
        saved = sorted(folder.glob("shard-rank*.json"))
        if not saved:
            return None, "it has no per-rank shards"
        other = _read_json(saved[0])
        return None, f"its shards are for {describe(other)}, this run is {describe(shape)}"
    index = _read_json(path)
    differ = [k for k in shape if index.get(k) != shape[k]]  # a pipeline's: pp, stage too
    if index.get("format") != FORMAT:
        return None, f"{path.name} is not a {FORMAT} index"
    if differ:
        return None, (f"its shards are for {describe(index)} (layout differs: "
                      f"{', '.join(differ)}), this run is {describe(shape)}")
    file = folder / index["file"]
    if not file.is_file() or file.stat().st_size != index.get("bytes"):
        return None, f"{index['file']} is missing or not the size written"
    return index, ""


def agreed(context, fits: bool) -> bool:
    """True when every rank's shard fits (the ranks all load shards, or none does)."""
    if not context.distributed:
        return fits
    verdicts = [None] * context.world
    dist.all_gather_object(verdicts, fits)
    return all(verdicts)


def read_shard(folder: Path, index: dict) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / index["file"]))


def frozen_masters(folder: Path, paths: list[str]) -> dict[str, Tensor]:
    """The fp32 masters of `paths` alone from the consolidated optimizer file (the frozen
    base of a LoRA run: whole on every rank, not in any shard)."""
    from safetensors import safe_open

    from runtime.train.checkpoint import OPTIMIZER

    if not paths:
        return {}
    with safe_open(str(folder / OPTIMIZER), framework="pt") as handle:
        return {p: handle.get_tensor(f"master.{p}") for p in paths}


def load_frozen(trainer, folder: Path) -> None:
    """Trained-but-not-sharded parameters do not exist under ZeRO; the frozen ones (LoRA's
    base) are read from the consolidated optimizer file, by path (whole tensors: a
    tensor-parallel rank keeps its slices)."""
    zero = zero_of(trainer)
    if zero is None:
        return
    held = getattr(trainer, "frozen", None)
    if isinstance(held, dict) and getattr(trainer, "step", None) is not None:  # the GPU
        held.update(_rank_slices(trainer, frozen_masters(folder, sorted(held))))
        return
    paths = [p for p in trainer.names if p not in zero.paths]
    with torch.no_grad():
        for path, value in _rank_slices(trainer, frozen_masters(folder, paths)).items():
            trainer.model.params[path].copy_(value)


def _rank_slices(trainer, whole: dict[str, Tensor]) -> dict[str, Tensor]:
    """This tensor-parallel rank's slices of `whole` (as they are without --tp)."""
    from runtime.tensor_parallel import shard_params

    model = trainer.model
    return shard_params(whole, model.source.program(planned=False),
                        getattr(model, "tp_rank", 0))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def whole_state(folder: Path) -> dict:
    """The consolidated optimizer state (masters, exp_avg, exp_avg_sq by path, step) joined
    from every rank's ZeRO shard: each bucket instance's parts in data-parallel rank order,
    cut into parameters at the bucket's offsets. Every rank reads every shard (a resume on
    another number of ranks or another stage)."""
    from safetensors import safe_open

    from modulec.plan.distributed import bucket_key, bucket_paths
    from runtime.cuda.state import joined_master
    from runtime.errors import RuntimeUserError

    indexes = sorted((_read_json(p) for p in folder.glob("shard-rank*.json")),
                     key=lambda index: index.get("dp_rank", -1))
    if indexes and "pp" in indexes[0]:
        return _pipeline_state(folder, indexes)
    if not indexes or any("buckets" not in index for index in indexes) or \
            [index.get("dp_rank") for index in indexes] != list(range(indexes[0]["dp"])):
        raise RuntimeUserError(f"checkpoint {folder} has no optimizer.safetensors and not "
                               "every rank's ZeRO shard", help=["resume from a complete "
                                                                "checkpoint folder"])
    handles = [safe_open(str(folder / index["file"]), framework="pt") for index in indexes]
    state = {part: {} for part in PARTS} | {"step": int(indexes[0]["step"])}
    for spec in indexes[0]["buckets"]:
        for i in range(spec["instances"]):
            joined = {part: _joined(handles, f"zero.{bucket_key(spec, i)}.{part}")
                      for part in ("hi", "lo", "exp_avg", "exp_avg_sq")}
            master = joined_master(joined["hi"], joined["lo"]) if joined["lo"] is not None \
                else joined["hi"].float()
            for p, path in zip(spec["params"], bucket_paths(spec, i)):
                cut = slice(p["offset"], p["offset"] + p["numel"])
                for part, flat in (("masters", master), ("exp_avg", joined["exp_avg"]),
                                   ("exp_avg_sq", joined["exp_avg_sq"])):
                    state[part][path] = flat[cut].float().view(p["shape"]).clone()
    return state


def _pipeline_state(folder: Path, indexes: list[dict]) -> dict:
    """A pipeline's optimizer state joined from its ranks' shards (every rank's there)."""
    from runtime.errors import RuntimeUserError
    from runtime.train.pipeline_shards import joined_state

    world = indexes[0].get("world")
    if sorted(index.get("rank") for index in indexes) != list(range(world or 0)):
        raise RuntimeUserError(f"checkpoint {folder} has no optimizer.safetensors and not "
                               f"every rank's pipeline shard", help=["resume from a "
                                                                     "complete checkpoint "
                                                                     "folder"])
    return joined_state(folder, indexes)


def _joined(handles, name: str):
    parts = [h.get_tensor(name) for h in handles if name in h.keys()]
    return torch.cat(parts) if parts else None
