"""Walking syntax trees without `dataclasses.fields` per node and without recursion.

The checker and the build walk whole declarations (std's included) for one kind of node
several times per program; `fields()` and a generator per level made those walks a tenth
of a check. A node's fields are read once per class here, and the walk keeps a stack of
its own.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Iterator

_FIELDS: dict[type, tuple[str, ...] | None] = {}


def field_names(node) -> tuple[str, ...] | None:
    """The field names of a dataclass instance, in declaration order (read once per class);
    None for anything else."""
    cls = type(node)
    try:
        return _FIELDS[cls]
    except KeyError:
        names = tuple(f.name for f in fields(cls)) if is_dataclass(cls) else None
        _FIELDS[cls] = names
        return names


def tree_nodes(root, sequences: tuple[type, ...] = (list, tuple),
               skip: tuple[str, ...] = ("span",)) -> Iterator:
    """Every dataclass instance under `root` (itself included), through the `sequences`
    and the fields other than `skip`; in no particular order."""
    stack = [root]
    pop, extend = stack.pop, stack.extend
    while stack:
        node = pop()
        if isinstance(node, sequences):
            extend(node)
            continue
        names = field_names(node)
        if names is None:
            continue
        yield node
        extend(getattr(node, name) for name in names if name not in skip)
