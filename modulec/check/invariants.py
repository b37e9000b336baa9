"""A primitive's `invariants:` (spec §9.8.3), checked where the declaration is.

`- backward_uses: [out]` says the backward reads `out`, so `out` must be in the
primitive's `save:` list: a name missing there is E006. Any other invariant is a W006: the
spec names no other kind, and one that nothing checks must not look checked.
"""

from __future__ import annotations

from modulec.check.world import World
from modulec.syntax import ast as A

BACKWARD_USES = "backward_uses"
CHECKED = (BACKWARD_USES,)


def check_invariants(world: World, program: A.Program) -> None:
    for decl in program.decls:
        section = _section(decl, "invariants")
        if section is not None:
            saved = _saved(decl)
            for entry in _entries(section):
                _check_entry(world, decl, entry, saved)


def _check_entry(world: World, decl: A.Decl, entry: A.Entry, saved: set[str]) -> None:
    key = entry.key.id if isinstance(entry.key, A.Name) else None
    if key != BACKWARD_USES:
        world.warn("W006", f"the invariant `{key or '?'}` of `{decl.name}` has no effect yet: "
                           "nothing checks it", entry.key.span, "not checked",
                   notes=["the invariants modulec checks: " +
                          ", ".join(f"`{name}`" for name in CHECKED) + " (spec §9.8.3)"],
                   help=["remove it, or state it as `- backward_uses: [names]` if that is "
                         "what it means"])
        return
    for name in _names(entry.value):
        if name.id not in saved:
            world.error("E006", f"invariant `{BACKWARD_USES}` of `{decl.name}` names "
                                f"`{name.id}`, which is not in `save:`", name.span,
                        "not saved for the backward",
                        help=[f"add `{name.id}` to `{decl.name}`'s `save:` list"])


def _section(decl: A.Decl, name: str):
    """The declaration's section `name:` (with a body) or entry `name: value`."""
    for item in decl.body:
        if isinstance(item, A.Section) and item.name == name:
            return item
        if isinstance(item, A.Entry) and isinstance(item.key, A.Name) and item.key.id == name:
            return item
    return None


def _entries(section) -> list[A.Entry]:
    items = section.body if isinstance(section, A.Section) else ()
    found = [item.item if isinstance(item, A.ListItem) else item for item in items]
    return [item for item in found if isinstance(item, A.Entry)]


def _saved(decl: A.Decl) -> set[str]:
    entry = _section(decl, "save")
    value = entry.value if isinstance(entry, A.Entry) else None
    return {name.id for name in _names(value)}


def _names(value) -> list[A.Name]:
    items = value.items if isinstance(value, (A.ListExpr, A.TupleExpr)) else (value,)
    items = [item.value if isinstance(item, A.Element) else item for item in items]
    return [item for item in items if isinstance(item, A.Name)]
