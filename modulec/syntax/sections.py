"""Which sections a declaration may hold: one table, checked after parsing.

The grammar gives every section body one item syntax, so a misspelled section (`forwrd:`)
parses; this check reports it as E001 with the closest known names. Only section *names*
and the kind of item at declaration level are checked here; what a section contains is
the business of the checker (modulec check, issue 3).
"""

from __future__ import annotations

import difflib

from modulec.diagnostics import Diagnostic, error
from modulec.diagnostics.diagnostic import Label
from modulec.syntax import ast as A

MODULE_SECTIONS = frozenset({
    "let", "constants", "params", "forward", "backward", "save", "recompute",
    "hf_config", "hf_mapping", "hf_export", "verify_backward",
})
DECLARATION_SECTIONS: dict[str, frozenset[str] | None] = {
    "module": MODULE_SECTIONS,
    "block": MODULE_SECTIONS | {"pattern"},
    "model": MODULE_SECTIONS,
    "primitive": frozenset({
        "params", "forward", "backward", "save", "impl", "invariants", "memory", "fusion",
        "precision", "constraints", "collective",
    }),
    "recipe": None,  # a recipe is a list of settings; any key is allowed
}
GRAPH_SECTIONS = frozenset({"in", "out", "inputs", "outputs", "graph", "save", "recompute",
                            "impl"})
NESTED_SECTIONS = {"forward": GRAPH_SECTIONS, "backward": GRAPH_SECTIONS}
VERIFY_BACKWARD_KEYS = frozenset({"epsilon", "tolerance", "shapes"})
# a primitive's `collective: [forward, backward]`: the phases whose kernel is a collective
# alone (modulec.ops.registry collective_ops; what may run on the communication stream)
PHASES = ("forward", "backward")


def check_sections(program: A.Program) -> list[Diagnostic]:
    diagnostics: list[Diagnostic] = []
    for decl in program.decls:
        allowed = DECLARATION_SECTIONS[decl.kind]
        if allowed is not None:
            diagnostics += _check_body(decl.body, allowed, f"{decl.kind} `{decl.name}`",
                                       decl.kind == "primitive")
    return diagnostics


def _check_body(items, allowed, where: str, primitive: bool) -> list[Diagnostic]:
    diagnostics, seen = [], {}
    for item in items:
        diagnostics += _check_item(item, allowed, where, primitive)
        name = _key_name(item.key) if isinstance(item, (A.Section, A.Entry)) else None
        if name in allowed and name in seen:  # the second one was read, the first dropped
            diagnostics.append(error(
                "E001", f"section `{name}` appears twice in {where}", item.key.span,
                "second one here", secondary=[Label(seen[name].span, "first one here")],
                help=[f"merge them into one `{name}:` section"]))
        elif name is not None:
            seen.setdefault(name, item.key)
    return diagnostics


def _check_item(item, allowed, where, primitive) -> list[Diagnostic]:
    if isinstance(item, (A.Docstring, A.AnnotationLine)):
        return []
    if isinstance(item, A.ImplBlock):
        return [] if "impl" in allowed else [_misplaced(item, "an `impl:` section", where)]
    if not isinstance(item, (A.Section, A.Entry)):
        return [_misplaced(item, _describe(item), where)]
    name = _key_name(item.key)
    if name is None or name in allowed:
        return _check_nested(item, name, primitive)
    return [_unknown(item.key, name, allowed, where)]


def _check_nested(item, name, primitive) -> list[Diagnostic]:
    if name == "verify_backward" and isinstance(item, A.Section):
        return _check_verify_backward(item)
    if name == "collective" and primitive:
        return _check_collective(item)
    nested = NESTED_SECTIONS.get(name)
    if nested is None or not isinstance(item, A.Section):
        return []
    diagnostics = []
    for child in item.body:  # `out: [..]` is an entry: renamed, it lost the outputs unseen
        if isinstance(child, (A.Section, A.Entry)) and not _gradient_or_known(child, nested):
            diagnostics.append(_unknown(child.key, _key_name(child.key), nested, f"`{name}:`"))
        elif isinstance(child, A.Section) and _key_name(child.key) != "graph":
            diagnostics += _flows_outside_graph(child, name)
    return diagnostics


def _flows_outside_graph(section: A.Section, outer: str) -> list[Diagnostic]:
    """Graph statements indented under `out:` (or `in:`, `save:`, ...) instead of `graph:`:
    they were dropped, and the forward computed nothing."""
    where = f"`{_key_name(section.key)}:` of `{outer}:`"
    return [_misplaced(child, _describe(child), where) for child in section.body
            if isinstance(child, (A.Flow, A.Step, A.IfBlock))]


def _check_verify_backward(section: A.Section) -> list[Diagnostic]:
    """Its settings (spec §9.8.1; runtime/verify_config.py reads them): a `vocab_size: 64`
    written directly in it, not under `shapes:`, would fail only at --verify-backward;
    `epsilon: abc` crashed it, and a `shapes:` entry whose key is no name was ignored."""
    diagnostics = []
    for child in section.body:
        if not isinstance(child, (A.Section, A.Entry)):
            continue
        name = _key_name(child.key)
        if name not in VERIFY_BACKWARD_KEYS:
            diagnostics.append(_unknown(child.key, name, VERIFY_BACKWARD_KEYS,
                                        "`verify_backward:`"))
        elif name == "shapes":
            diagnostics += _check_shapes(child)
        elif not (isinstance(child, A.Entry) and _positive_number(child.value)):
            diagnostics.append(error("E003", f"`{name}` in `verify_backward:` must be a "
                                     "positive number", child.span, "not a positive number",
                                     help=[f"for example `{name}: 1e-6`"]))
    return diagnostics


def _check_collective(item) -> list[Diagnostic]:
    """`collective: [forward]`: a list of phases, each once (read by the op table)."""
    items = item.value.items if isinstance(item, A.Entry) and isinstance(item.value,
                                                                          A.ListExpr) else None
    names = [i.id if isinstance(i, A.Name) else None for i in items or ()]
    if items and all(n in PHASES for n in names) and len(set(names)) == len(names):
        return []
    return [error("E001", "`collective:` lists the phases whose kernel is a collective",
                  item.span, "not a list of distinct phases",
                  help=["write `collective: [forward]`, `[backward]` or "
                        "`[forward, backward]`"])]


def _check_shapes(shapes) -> list[Diagnostic]:
    """`shapes:` holds `NAME: VALUE` lines: a parameter (`d_model: 32`) or a free dim
    (`T: 8`) each."""
    if not isinstance(shapes, A.Section):
        return [error("E001", "`shapes:` in `verify_backward:` is a section", shapes.span,
                      "needs its sizes on the lines below", help=["write `shapes:`, then "
                      "one `NAME: SIZE` per line, indented"])]
    diagnostics, seen = [], {}
    for item in shapes.body:
        if not (isinstance(item, A.Entry) and isinstance(item.key, A.Name)
                and item.default is None):
            diagnostics.append(error(
                "E001", "a `shapes:` line is `NAME: SIZE`", item.span, "not a size",
                help=["name a parameter (`d_model: 32`) or a free dim (`T: 8`)"]))
        elif item.key.id in seen:  # the second one was read, the first dropped
            diagnostics.append(error(
                "E001", f"`{item.key.id}` appears twice in `shapes:`", item.key.span,
                "second one here", secondary=[Label(seen[item.key.id], "first one here")],
                help=["keep one size per name"]))
        else:
            seen[item.key.id] = item.key.span
    return diagnostics


def _positive_number(value) -> bool:
    return isinstance(value, A.Number) and not isinstance(value.value, bool) and \
        0 < value.value < float("inf")


def _gradient_or_known(section, nested) -> bool:
    name = _key_name(section.key)
    return name is None or name in nested or name.startswith("d_")


def _key_name(key) -> str | None:
    return key.id if isinstance(key, A.Name) else None


def _unknown(key, name: str | None, allowed, where: str) -> Diagnostic:
    """`name` None: a key that is not a name at all (`0.5:` in `verify_backward:`)."""
    guesses = difflib.get_close_matches(name, sorted(allowed), n=4, cutoff=0.6) if name else []
    helps = [f"did you mean {_or_list(guesses)}?"] if guesses else []
    shown = f"section `{name}`" if name else "key (not a name)"
    return error("E001", f"unknown {shown} in {where}", key.span,
                 "not a section here", help=helps,
                 notes=[f"sections allowed here: {', '.join(sorted(allowed))}"])


def _misplaced(item, what: str, where: str) -> Diagnostic:
    return error("E001", f"{what} cannot stand directly in {where}", item.span,
                 "belongs inside a section",
                 help=["graph statements go in `forward:` or `backward:` under `graph:`; "
                       "bindings go in `let:`"])


def _describe(item) -> str:
    names = {A.Flow: "a flow", A.Step: "an expression", A.Binding: "a binding",
             A.Constraint: "a constraint", A.IfBlock: "an `if` block",
             A.ListItem: "a list item", A.Prose: "a list item"}
    return names.get(type(item), "this item")


def _or_list(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
