"""Training checkpoints: `SAVE/checkpoint-<step>/`, each a HuggingFace checkpoint
directory (`model.safetensors`, or above --max-shard-size HF's `model-0000i-of-0000N.
safetensors` + `model.safetensors.index.json`; `config.json`) plus what resuming needs:

- `optimizer.safetensors`: fp32 `master.<path>`, `exp_avg.<path>`, `exp_avg_sq.<path>` by
  parameter path (tied parameters: their owner only), the optimizer step in the metadata;
- `trainer_state.json`, written last: the step, the data position, the run's settings, the
  losses so far, and the size of every other file (checked on resume);
- under data parallel with ZeRO >= 1, tensor parallel or pipeline parallel, every rank's
  own shard (`shard-rank<r>.safetensors` + `.json`, runtime.train.shards; a pipeline's,
  runtime.train.pipeline_shards), written into the same temporary folder before it is
  published.

Rank 0 writes the consolidated files tensor by tensor as the parameters are gathered
(runtime/train/consolidated.py): its host memory holds one bucket or tensor at a time.

A checkpoint is written into a temporary folder next to it (`.checkpoint-<step>.*.tmp`),
each file through a temp file + os.replace and fsynced, then the folder is renamed into
place and `SAVE/latest` (the name of the newest) is replaced atomically. A crash mid-save
leaves only the temporary folder, which nothing reads: never a half checkpoint that looks
complete. Re-saving a step moves the old folder aside (`.checkpoint-<step>.old`) only once
the new one is complete; a crash between the two renames leaves the old one there, which
`find_checkpoint` reads and the next save puts back. The next save also removes the
temporary folders of killed saves.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from runtime.errors import RuntimeUserError
from runtime.hf_weights.export import write_config
from runtime.hf_weights.stream import (MAX_SHARD_SIZE, StreamFile, atomic_text,
                                        current_umask, fsync_path)

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
LATEST = "latest"
FORMAT = "modulec-train/1"
PARTS = ("master", "exp_avg", "exp_avg_sq")


def save_checkpoint(root, source, trainer: dict, *, schema: list, layout: dict,
                    config: dict | None, dtype: torch.dtype, adapters=None,
                    shards=None, optimizer: bool = True,
                    max_shard_size: int = MAX_SHARD_SIZE, opener=None) -> Path:
    """Write checkpoint-<step> under `root` from `source` (runtime/train/consolidated.py:
    the parameters one at a time; a state dict, masters, exp_avg, exp_avg_sq and step,
    is read as one) and `trainer` (the JSON state); returns its folder. `optimizer`:
    write `optimizer.safetensors` (not where the ranks' shards replace it). `adapters`
    (a LoRA model): its adapters go to PEFT's adapter files beside the (frozen) base.
    `shards` (runtime.train.shards.ShardSave): every rank's shard is written into the
    temporary folder before it is published, and the other ranks are told after.
    `max_shard_size`: above it the weights are HF's shards and index. `opener`: each
    streamed file's writer (runtime.hf_weights.stream.StreamFile; a test's probe)."""
    from runtime.train.consolidated import LocalSource, write_consolidated

    if isinstance(source, dict):
        source = LocalSource(source, optimizer)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    final = root / f"checkpoint-{trainer['step']}"
    temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        if shards is not None:
            shards.leader(temp)
        adapter_masters = write_consolidated(
            source, temp, schema=schema, layout=layout, dtype=dtype,
            optimizer=OPTIMIZER if optimizer else None, optimizer_format=FORMAT,
            max_shard_size=max_shard_size, opener=opener or StreamFile)
        if config is not None:
            write_config(temp, config)
        if adapters is not None:
            from runtime.lora import save_lora

            # whole: a tensor-parallel run's are its ranks' slices joined
            save_lora(adapters, temp, adapter_masters)
        files = {f.name: f.stat().st_size for f in sorted(temp.iterdir())}
        text = json.dumps(trainer | {"format": FORMAT, "files": files}, indent=2) + "\n"
        atomic_text(temp / STATE, text)
        _publish(temp)
        _replace_folder(temp, final)
        atomic_text(root / LATEST, final.name + "\n")
        if shards is not None:
            shards.published()
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
    return final


def find_checkpoint(path) -> Path:
    """A checkpoint folder, or a save folder (its `latest`)."""
    path = Path(path)
    for folder in (path, _aside(path)):
        if (folder / STATE).is_file():
            return folder
    if (path / LATEST).is_file():
        named = path / (path / LATEST).read_text(encoding="utf-8").strip()
        for folder in (named, _aside(named)):  # a re-save killed between its renames
            if (folder / STATE).is_file():
                return folder
    found = [f.parent for f in path.glob("checkpoint-*/" + STATE)]
    found += [f.parent for f in path.glob(".checkpoint-*.old/" + STATE)
              if not (path / _step_name(f.parent) / STATE).is_file()]
    if found:
        return max(found, key=_step_of)
    where = "does not exist" if not path.exists() else "holds no complete checkpoint"
    raise RuntimeUserError(f"--resume {path} {where}",
                           help=[f"pass a checkpoint folder (with {STATE}) or the --save "
                                 "folder of an earlier run"])


def read_checkpoint(folder: Path) -> tuple[dict, dict]:
    """(trainer JSON state, optimizer state by part) of a complete checkpoint."""
    return read_trainer(folder), read_optimizer(folder)


def read_trainer(folder: Path) -> dict:
    """The trainer JSON state, after checking every file it lists is there, whole."""
    trainer = json.loads((folder / STATE).read_text(encoding="utf-8"))
    for name, size in trainer.get("files", {}).items():
        if not (folder / name).is_file() or (folder / name).stat().st_size != size:
            raise RuntimeUserError(f"checkpoint {folder} is damaged: {name} is missing or "
                                   "not the size that was written")
    return trainer


def read_optimizer(folder: Path) -> dict:
    """The consolidated optimizer state: masters, exp_avg, exp_avg_sq by path, step; from
    the ranks' ZeRO shards where the checkpoint has no optimizer file (runtime.train.shards
    writes none then: the shards hold it all)."""
    from safetensors import safe_open

    if not (folder / OPTIMIZER).is_file():
        from runtime.train.shards import whole_state

        return whole_state(folder)

    state: dict = {part: {} for part in PARTS}
    with safe_open(str(folder / OPTIMIZER), framework="pt") as handle:
        state["step"] = int(handle.metadata()["step"])
        for key in handle.keys():
            part, _, path = key.partition(".")
            state.setdefault(part, {})[path] = handle.get_tensor(key)  # fp8: amax histories
    state["masters"] = state.pop("master")
    return state


def recover(root: Path) -> None:
    """Undo what killed saves left in `root`: a `.checkpoint-<step>.old` whose
    `checkpoint-<step>` is missing (killed between the renames of a re-save) is put back,
    one whose step is there again is deleted, and `.checkpoint-<step>.*.tmp` folders
    (killed before publishing) are deleted, and so are `.latest.*.tmp` files (killed while
    `latest` was replaced). Only those names, only folders (files for `latest`), never
    links."""
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(f".{LATEST}.") and entry.name.endswith(".tmp") and \
                entry.is_file() and not entry.is_symlink():
            entry.unlink()
            continue
        if not entry.is_dir() or entry.is_symlink() or not entry.name.startswith(".checkpoint-"):
            continue
        if entry.name.endswith(".tmp"):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(".old") and _step_of(entry) >= 0:
            final = root / _step_name(entry)
            if final.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.replace(entry, final)


def _replace_folder(temp: Path, final: Path) -> None:
    """Rename the complete `temp` to `final`; an existing `final` (a re-run to the same
    step) is moved aside first and deleted after. Between the two renames `final` is
    missing: readers then take the folder set aside (see find_checkpoint)."""
    old = _aside(final)
    if final.exists():
        if old.exists():  # stale: `final` is complete, so this copy is not needed
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(temp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _aside(final: Path) -> Path:
    """Where a re-save keeps the old `checkpoint-<step>` until the new one is in place."""
    return final.with_name(f".{final.name}.old") if final.name else final


def _step_name(aside: Path) -> str:
    """`checkpoint-<step>` of its `.checkpoint-<step>.old`."""
    return aside.name.removeprefix(".").removesuffix(".old")


def _publish(folder: Path) -> None:
    """Flush every file to disk and give the folder and files the umask's permissions
    (temp files and folders are made private)."""
    umask = current_umask()
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)
        fsync_path(file)
    os.chmod(folder, 0o777 & ~umask)
    fsync_path(folder)


def _step_of(folder: Path) -> int:
    tail = _step_name(folder).rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1
