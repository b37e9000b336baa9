"""The one atomic file writer of modulec and its runtime: IR documents, `module.lock`,
formatted sources and pictures (the compiler), `config.json`, shard indexes, checkpoints
and token files (the runtime, through runtime.hf_weights.stream). It is here, torch-free,
because the compiler never imports torch and the runtime already imports modulec."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, write) -> None:
    """`write(temp_path)` fills a temp file in `path`'s folder, which then gets the umask's
    permissions (mkstemp makes it private), is fsynced and renamed onto `path`: a reader
    sees the old file or the whole new one, never part of it. Whatever fails, the temp file
    is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_text(path: Path, text: str) -> None:
    """`text`, UTF-8 with `\\n` line ends on every platform (the same bytes everywhere),
    into `path` through atomic_write."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8", newline="\n"))


def fsync_path(path) -> None:
    """fsync a file or folder by its path (after whoever wrote it closed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask
