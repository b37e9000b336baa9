"""A HuggingFace checkpoint directory: `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Names and shapes come from the files' headers, so every
check runs before a byte of tensor data is read.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from runtime.hf_weights.errors import WeightLoadError, listing

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """The tensors of a checkpoint: name -> (file, shape), in the files' order."""

    source: Path
    files: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def open(cls, directory) -> "Checkpoint":
        """Read the headers of the checkpoint in `directory` (or of one .safetensors file)."""
        path = Path(directory).expanduser()
        checkpoint = cls(path)
        for file in _files(path):
            checkpoint._add(file)
        return checkpoint

    def _add(self, file: Path) -> None:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name not in self.files:
                        self.files[name] = file
                        self.shapes[name] = list(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightLoadError(f"cannot read {file}: {exc}",
                                  ["the file is not a safetensors file, or it is truncated "
                                   "(an interrupted download?)"]) from None

    def reader(self) -> "Reader":
        return Reader(self)


class Reader:
    """Open handles on the checkpoint's files while tensors are read (a context manager)."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.stack = ExitStack()
        self.handles: dict[Path, object] = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def get(self, name: str):
        file = self.checkpoint.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return self.handles[file].get_tensor(name)


def _files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the one file, or the index's shards. A
    directory with both reads `model.safetensors`, as transformers does."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        where = "is not a directory" if path.exists() else "does not exist"
        raise WeightLoadError(f"checkpoint directory {path} {where}",
                              ["pass the directory that holds model.safetensors (or "
                               "model.safetensors.index.json and its shards)"])
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / INDEX).is_file():
        return _shards(path / INDEX)
    others = sorted(p.name for p in path.glob("*.safetensors"))
    found = [f"{path} holds {', '.join(others[:6])}"] if others else \
        [f"{path} holds no .safetensors file (a PyTorch .bin checkpoint? convert it with "
         "transformers' save_pretrained(safe_serialization=True))"]
    raise WeightLoadError(f"no {SINGLE} or {INDEX} in {path}",
                          found + ["pass a .safetensors file itself to read just that file"])


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightLoadError(f"cannot read {index}: {exc!r}",
                              ['an index is JSON with a "weight_map": {tensor name: shard '
                               'file}']) from None
    shards = [_confined(index, name) for name in names]
    absent = [s.name for s in shards if not s.is_file()]
    if absent:
        raise WeightLoadError("\n".join(listing(f"{index} lists shards that are not in "
                                                f"{index.parent}:", absent)),
                              ["the download is incomplete: fetch the missing shards"])
    return shards


def _confined(index: Path, name) -> Path:
    """The shard `name` of `index`, refused unless it is a plain relative path that stays
    inside the index's folder once resolved: an index is downloaded data, and an entry like
    `../../etc/passwd`, an absolute path or a symlink out of the folder would read (and use)
    files the checkpoint does not own."""
    folder = index.parent.resolve()
    path = Path(name) if isinstance(name, str) else None
    if path is None or path.is_absolute() or not name or "\\" in name:
        _outside(index, name)
    if ".." in path.parts:
        _outside(index, name)
    resolved = (folder / path).resolve()
    if not any(resolved.is_relative_to(root) for root in _roots(folder)):
        _outside(index, name)
    return resolved


def _roots(folder: Path) -> list[Path]:
    """Where a shard may live: the checkpoint folder, and for a HuggingFace hub cache
    snapshot (`<repo>/snapshots/<rev>/`, whose files are links to `<repo>/blobs/`) that
    repository's blobs folder, so downloaded checkpoints keep loading."""
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append(folder.parent.parent / "blobs")
    return roots


def _outside(index: Path, name) -> None:
    raise WeightLoadError(f"{index} lists a shard outside its folder: {name!r}",
                          ["a weight_map value must be a file name inside the checkpoint "
                           "folder (no absolute paths, no '..', no links out of it)"])
