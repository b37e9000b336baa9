"""The weight schema of a build (`modulec.check.weights.hf_plan`) made concrete: one `Item`
per parameter of every layer, with the checkpoint names it reads, and the transforms.

A schema entry maps `blocks[{i}].attention.qkv_weight` for all layers at once; loading and
exporting work layer by layer, on concrete paths (`blocks[3].attention.qkv_weight`) and
names (`model.layers.3.self_attn.q_proj.weight`), so both are filled in here, once.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.hf_weights.errors import WeightLoadError

PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
KINDS = ("direct", "fuse", "transform", "tied", "stack")
_INDEX_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
              ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
              ast.Mod: lambda a, b: a % b}


def fill(text: str, subs: dict[str, int]) -> str:
    """`text` with each `{name}` of `subs` replaced by its index, and each index expression
    over them (`{i + 3}`, `{2 * i + j}`: placeholders, integers, `+ - * // %`, what the
    build's weight schema holds; modulec/check/weight_index.py) by its value. A `{...}`
    naming anything else stays as written."""
    def one(match) -> str:
        inner = match[1].strip()
        if inner in subs:
            return str(subs[inner])
        try:
            return str(_index_value(ast.parse(inner, mode="eval").body, subs))
        except (SyntaxError, KeyError, ValueError, ZeroDivisionError):
            return match[0]
    return PLACEHOLDER.sub(one, text)


def _index_value(node, subs: dict[str, int]) -> int:
    if isinstance(node, ast.Name):
        return subs[node.id]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_index_value(node.operand, subs)
    if isinstance(node, ast.BinOp) and type(node.op) in _INDEX_OPS:
        return _INDEX_OPS[type(node.op)](_index_value(node.left, subs),
                                         _index_value(node.right, subs))
    raise ValueError("not an index expression")


@dataclass(frozen=True)
class Item:
    """One concrete parameter of a schema entry (one layer of a stacked entry)."""

    entry: dict
    path: str
    subs: dict

    @property
    def kind(self) -> str:
        return self.entry["kind"]

    @property
    def shape(self) -> list:
        """The parameter's shape: ints, or the text of a dimension that had no size."""
        return list(self.entry.get("shape") or [])

    @property
    def may_be_absent(self) -> bool:
        """Optional (`key?:`), or under an `if` the build could not decide: such an entry
        is left out when the checkpoint has none of its tensors (in any layer)."""
        return bool(self.entry.get("optional") or self.entry.get("condition"))

    @property
    def target(self) -> str:
        return fill(self.entry["target"], self.subs)

    def names(self, plan: dict | None = None, expert: int | None = None) -> list[str]:
        """The checkpoint names of `plan` (the entry, or a stack's inner plan)."""
        subs = dict(self.subs)
        if expert is not None:
            subs[self.entry.get("expert", "e")] = expert
        return [fill(name, subs) for name in (plan or self.entry)["hf"]]

    def experts(self) -> int:
        count = self.entry.get("count")
        return count if isinstance(count, int) else int(self.shape[self.entry["dim"]])

    def sources(self) -> list[str]:
        """Every checkpoint name this parameter reads (all experts of a stack)."""
        if self.kind == "stack":
            inner = self.entry["inner"]
            return [n for e in range(self.experts()) for n in self.names(inner, e)]
        return [] if self.kind == "tied" else self.names()

    def source_key(self) -> tuple:
        """Two parameters with the same key load the same tensor (a tied parameter mapped
        to its target's checkpoint names): they share it."""
        return (self.kind, tuple(self.sources()), self.entry.get("dim"), self.entry.get("fn"))


def expand(schema: list[dict]) -> list[Item]:
    """Every concrete parameter of the schema, in schema order (layers in index order)."""
    items = []
    for entry in schema:
        if entry.get("kind") not in KINDS:
            raise WeightLoadError(f"weight schema entry `{entry.get('param')}` has kind "
                                  f"`{entry.get('kind')}`; this runtime knows {', '.join(KINDS)}",
                                  ["rebuild the model with this checkout's `modulec build`"])
        stacks = entry.get("stacks") or []
        counts = [range(int(s["count"])) for s in stacks]
        for indices in itertools.product(*counts):
            subs = {s["placeholder"]: i for s, i in zip(stacks, indices)}
            items.append(Item(entry, fill(entry["param"], subs), subs))
    return items


def tied_targets(schema: list[dict]) -> dict[str, str]:
    """Each tied parameter's path -> the path of the parameter whose tensor it shares
    (`tied_to`): the target owns the value, its gradient and its optimizer state."""
    return {item.path: item.target for item in expand(schema) if item.kind == "tied"}


def known(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def fits(found, expected) -> bool:
    """Whether a shape matches an expected one (a dimension without a size matches any)."""
    return len(found) == len(expected) and all(
        not isinstance(e, int) or f == e for f, e in zip(found, expected))


# ====================================================================== transforms
def _transpose(x):
    return x.transpose(-1, -2)


@dataclass(frozen=True)
class Transform:
    """A `transform(name, fn: f)`: forward (checkpoint -> parameter), inverse (export) and
    the gradient w.r.t. the checkpoint tensor from the parameter's gradient `g` and value
    `p` (chain rule; `p` is needed only when the transform is not linear)."""

    forward: Callable
    inverse: Callable
    grad: Callable
    linear: bool
    swaps: bool = False  # the checkpoint tensor's last two dims are the parameter's, swapped

    def checkpoint_shape(self, shape: list) -> list:
        return shape[:-2] + [shape[-1], shape[-2]] if self.swaps else shape


TRANSFORMS: dict[str, Transform] = {
    "identity": Transform(lambda x: x, lambda p: p, lambda g, p: g, True),
    "neg": Transform(torch.neg, torch.neg, lambda g, p: -g, True),
    "exp": Transform(torch.exp, torch.log, lambda g, p: g * p, False),            # dp/dx = p
    "log": Transform(torch.log, torch.exp, lambda g, p: g * torch.exp(-p), False),  # 1/x
    "negate_exp": Transform(lambda x: -torch.exp(x), lambda p: torch.log(-p),
                            lambda g, p: g * p, False),                           # dp/dx = p
    "transpose": Transform(_transpose, _transpose, lambda g, p: _transpose(g), True, True),
}


def transform_of(item: Item) -> Transform:
    name = item.entry.get("fn")
    if name not in TRANSFORMS:
        raise WeightLoadError(f"`{item.entry['param']}` uses transform `{name}`, which this "
                              f"runtime does not know ({', '.join(TRANSFORMS)})",
                              ["rebuild the model with this checkout's `modulec build`"])
    return TRANSFORMS[name]
