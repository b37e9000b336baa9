"""Source paths in an IR document, independent of the working directory.

The lowered graph carries each node's file as the loader spelled it (relative to the
working directory, or absolute), so the bytes of `modulec build -o` changed with where it
ran. The document records them relative to a declared root instead: the entry file's
folder, and `std/...` for the standard library wherever it is installed. Posix
separators, no `.` parts: the same build gives the same bytes from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from modulec.paths import data_dir


def rooted(path: str, root: Path) -> str:
    """`path` (as the loader spelled it) relative to `root`, or `std/...`."""
    if not path:
        return path
    real = Path(os.path.realpath(path))
    std = Path(os.path.realpath(data_dir("std")))
    if real.is_relative_to(std):
        return "std/" + real.relative_to(std).as_posix()
    return Path(os.path.relpath(real, root)).as_posix()


def normalize_paths(document: dict, entry) -> dict:
    """A copy of `document` with every source file named in a node span (and the same
    strings elsewhere: fused spans, metadata.source) rooted at the entry file's folder."""
    root = Path(os.path.realpath(entry)).parent
    files = {str(entry)} | _span_files(document.get("graph", {}))
    mapping = {f: rooted(f, root) for f in files if f}
    return _replace(document, mapping)


def _span_files(graph: dict) -> set[str]:
    return {str(node["span"][0]) for function in graph.get("functions", ())
            for node in function.get("nodes", ()) if node.get("span")}


def _replace(value, mapping: dict):
    # Iterative would be safer for depth, but documents are shallow (a handful of levels).
    if isinstance(value, str):
        return mapping.get(value, value)
    if isinstance(value, dict):
        return {k: _replace(v, mapping) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, mapping) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace(v, mapping) for v in value)
    return value
