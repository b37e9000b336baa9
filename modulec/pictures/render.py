"""Running graphviz's `dot` on DOT text, for `modulec graph --format svg|png`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from modulec.files import atomic_write
from modulec.pictures import PictureError

SUFFIXES = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
TIMEOUT_S = 300


def dot_program() -> str | None:
    """The path of graphviz's `dot`, or None when it is not installed."""
    return shutil.which("dot")


def missing_dot_message(fmt: str) -> str:
    return (f"`--format {fmt}` needs graphviz's `dot` program, which is not on PATH; install "
            "graphviz (`make setup` does: apt-get install graphviz), or write `--format dot` "
            "and render the text elsewhere")


def render(dot_text: str, fmt: str) -> bytes:
    """DOT text -> the bytes of an SVG or PNG picture, laid out by `dot`."""
    program = dot_program()
    if program is None:
        raise PictureError(missing_dot_message(fmt))
    done = subprocess.run([program, f"-T{fmt}"], input=dot_text.encode("utf-8"),
                          capture_output=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0 or not done.stdout:
        # modulec wrote DOT that graphviz rejects: a bug here, not the user's
        raise RuntimeError(f"dot -T{fmt} failed (status {done.returncode}): "
                           + done.stderr.decode("utf-8", "replace").strip())
    return done.stdout


def write_bytes(path: Path, data: bytes) -> None:
    """Write atomically (modulec.files): a reader never sees half a picture."""
    atomic_write(path, lambda temporary: Path(temporary).write_bytes(data))
