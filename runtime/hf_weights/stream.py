"""Safetensors files written tensor by tensor: the header is made up front from the names,
shapes and dtypes (`Spec`), then each tensor is written at its offset as it comes and
dropped, so a writer holds one tensor at a time, never the whole model.

The bytes are safetensors' own (`safetensors.torch.save_file` of the same tensors writes
the same file): the data ordered by dtype (widest first, safetensors' dtype order) then by
name, the JSON header compact, `__metadata__` first, padded with spaces to 8 bytes.

`StreamCheckpoint` is a HuggingFace weights folder: one `model.safetensors`, or above
`max_shard_size` bytes of tensors HF's sharded form (`model-0000i-of-0000N.safetensors`
and `model.safetensors.index.json`, split as huggingface_hub's
`split_torch_state_dict_into_shards` splits: in order, a new file when the next tensor
would pass the size, a tensor above it alone). Every file is written to a temp file in
its folder, fsynced and renamed into place when all its tensors are in.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# the one atomic writer (torch-free, so the compiler shares it); callers import it from here
from modulec.files import atomic_text, atomic_write, current_umask, fsync_path  # noqa: F401

# torch dtype -> (safetensors name, its place in safetensors' Dtype enum: the data order)
DTYPES = {torch.bool: ("BOOL", 0), torch.uint8: ("U8", 4), torch.int8: ("I8", 5),
          torch.float8_e5m2: ("F8_E5M2", 6), torch.float8_e4m3fn: ("F8_E4M3", 7),
          torch.int16: ("I16", 9), torch.float16: ("F16", 11), torch.bfloat16: ("BF16", 12),
          torch.int32: ("I32", 13), torch.float32: ("F32", 15), torch.float64: ("F64", 17),
          torch.int64: ("I64", 18)}
MAX_SHARD_SIZE = 5_000_000_000  # huggingface_hub's default ("5GB")
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= int(size)
        return numel * torch.empty((), dtype=self.dtype).element_size()


def header(specs: list[Spec], metadata: dict | None) -> tuple[bytes, dict[str, tuple]]:
    """(the file's first bytes: length and JSON header, name -> (begin, end) in the data)."""
    ordered = sorted(specs, key=lambda s: (-DTYPES[s.dtype][1], s.name))
    table, offsets, at = {}, {}, 0
    if metadata is not None:
        table["__metadata__"] = metadata
    for spec in ordered:
        offsets[spec.name] = (at, at + spec.nbytes)
        table[spec.name] = {"dtype": DTYPES[spec.dtype][0], "shape": list(spec.shape),
                            "data_offsets": list(offsets[spec.name])}
        at += spec.nbytes
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


class StreamFile:
    """One safetensors file of `specs`: `write(name, tensor)` in any order, then `close()`
    (every tensor written) renames it to `path`; `abort()` removes the temp file."""

    def __init__(self, path: Path, specs: list[Spec], metadata: dict | None = None):
        self.path, self.specs = Path(path), {s.name: s for s in specs}
        if len(self.specs) != len(specs):
            raise ValueError(f"{self.path.name}: a tensor name given twice")
        head, self.offsets = header(specs, metadata)
        self.start, self.left = len(head), set(self.specs)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                        dir=self.path.parent)
        self.file = os.fdopen(fd, "wb")
        self.file.write(head)
        self.file.truncate(self.start + sum(s.nbytes for s in specs))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None or name not in self.left:
            raise ValueError(f"{self.path.name}: `{name}` is not due (unknown or written)")
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            raise ValueError(f"{self.path.name}: `{name}` is {tuple(tensor.shape)} "
                             f"{tensor.dtype}, its header says {spec.shape} {spec.dtype}")
        self.file.seek(self.start + self.offsets[name][0])
        if tensor.numel():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self.file.write(memoryview(flat.numpy()))
        self.left.discard(name)

    def close(self) -> Path:
        if self.left:
            self.abort()
            raise ValueError(f"{self.path.name}: never written: {sorted(self.left)[:5]}")
        self.file.flush()
        # mkstemp made it private (0600): the umask's permissions, as atomic_write gives
        os.fchmod(self.file.fileno(), 0o666 & ~current_umask())
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def split_shards(specs: list[Spec], max_shard_size: int) -> list[list[Spec]]:
    """huggingface_hub's split: in order; a tensor that would pass the size starts a new
    shard, one larger than the size has a shard of its own."""
    shards, current, size = [], [], 0
    for spec in specs:
        if spec.nbytes > max_shard_size:
            shards.append([spec])
            continue
        if current and size + spec.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    return shards + ([current] if current else [])


class StreamCheckpoint:
    """`model.safetensors`, or HF's shards and index above `max_shard_size`, written
    tensor by tensor (`write`, then `close`). `opener(path, specs, metadata)` makes each
    file's writer (StreamFile; a test's probe)."""

    def __init__(self, directory, specs: list[Spec], max_shard_size: int = MAX_SHARD_SIZE,
                 opener=StreamFile):
        self.directory = Path(directory)
        self.total = sum(s.nbytes for s in specs)
        groups = [specs] if self.total <= max_shard_size else split_shards(specs, max_shard_size)
        self.names = [SINGLE] if len(groups) == 1 else \
            [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self.files, self.where = [], {}
        try:
            for name, group in zip(self.names, groups):
                self.files.append(opener(self.directory / name, group, {"format": "pt"}))
                self.where |= {s.name: self.files[-1] for s in group}
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.where[name].write(name, tensor)

    def close(self) -> Path:
        """Every file renamed into place (the index last); the first file's path."""
        paths = [file.close() for file in self.files]
        if len(paths) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {name: file.path.name for name, file in self.where.items()}}
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            atomic_text(self.directory / INDEX, text)
        return paths[0]

    def abort(self) -> None:
        for file in self.files:
            file.abort()
