"""A model's tensor parameters as weight paths (`blocks[{i}].attention.qkv_weight`), and
how a mapping key's path expression reads: segments, placeholder levels, shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from modulec.check.instance import Instance, Stack, Submodule, TensorParamValue
from modulec.source import Span
from modulec.syntax import ast as A
from modulec.types.dims import Dim
from modulec.types.tensor import TensorType

LEVELS = ("i", "j", "k", "l", "m", "n")
PLACEHOLDER = re.compile(r"\{(\w+)\}")
MAX_DEPTH = 64


@dataclass(frozen=True)
class WeightPath:
    """One tensor parameter of a model. `path` uses the canonical placeholders; `stacks`
    holds (placeholder, count) for each stack level on the way, outermost first; `tied_to`
    is the canonical path of the parameter it shares storage with (`lm_head: tied_to(wte)`);
    `optional` is a declared `T?` (may be None)."""

    path: str
    type: TensorType
    tied_to: str | None = None
    optional: bool = False
    frozen: bool = False
    stacks: tuple = ()
    span: Span | None = None


def weight_paths(instance: Instance) -> list[WeightPath]:
    """Every tensor parameter present in this instance, in declaration order (parameters
    whose `if` guard is false are absent; Broken parameters are left out)."""
    found: list[WeightPath] = []
    walk_params(instance, "", (), found, 0)
    return found


def walk_params(instance: Instance, prefix: str, stacks: tuple, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        return
    for name, value in instance.params.items():
        path = join_path(prefix, name)
        if isinstance(value, TensorParamValue):
            tied = join_path(prefix, value.tied_to) if value.tied_to else None
            out.append(WeightPath(path, value.type, tied, value.optional, value.frozen,
                                  stacks, value.span))
        elif isinstance(value, Submodule):
            walk_params(value.instance, path, stacks, out, depth + 1)
        elif isinstance(value, Stack):
            level = level_name(len(stacks))
            walk_params(value.instance, f"{path}[{{{level}}}]", stacks + ((level, value.count),),
                  out, depth + 1)


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def level_name(depth: int) -> str:
    return LEVELS[depth] if depth < len(LEVELS) else f"i{depth}"


def path_segments(node) -> list | None:
    """`blocks[{i}].attention.qkv_weight` -> [("name", "blocks", node), ("index", Placeholder,
    node), ("name", "attention", node), ...]; None when it is not a path."""
    if isinstance(node, A.Name):
        return [("name", node.id, node)]
    if isinstance(node, A.Attribute):
        inner = path_segments(node.value)
        return None if inner is None else inner + [("name", node.attr, node)]
    if isinstance(node, A.Index):
        inner = path_segments(node.value)
        if inner is None or any(isinstance(s, A.Slice) for s in node.subscripts):
            return None
        return inner + [("index", s, node) for s in node.subscripts]
    return None


def strip_optional(key):
    return (key.value, True) if isinstance(key, A.OptionalType) else (key, False)


def levels_in(path: str) -> list[str]:
    return PLACEHOLDER.findall(path)


def shape_of(type_: TensorType) -> list:
    return [dim_value(d) for d in type_.dims]


def dim_value(dim) -> int | str:
    if isinstance(dim, Dim):
        return dim.value if dim.is_const else str(dim)
    return str(dim)


def stacks_of(weight: WeightPath) -> list[dict]:
    return [{"placeholder": level, "count": dim_value(count)} for level, count in weight.stacks]
