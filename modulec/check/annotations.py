"""Annotation checks: every `@name(...)` against the table of `annotation_table`.

E008: unknown annotation, wrong placement, unknown / duplicate / missing argument, too many
positional arguments, a value of the wrong kind, an unknown recipe. W006: a valid
annotation (or argument) that has no effect on some backend yet (annotation_effects).
E013: an unknown fusion pattern or `ops` entry, or a `@fuse` with nothing to fuse. E025:
a checkpoint region spanning pipeline stages (`memory_policy.pipeline_problems`, driven by
`StageRule`); E008 also for stages that do not form a pipeline
(`partition.partition_problems`). All wording comes from the table; no code here names
an annotation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache
from typing import Iterator

from modulec.check import memory_policy as G
from modulec.check.annotation_effects import without_effect
from modulec.check.annotation_table import (
    ANNOTATIONS, PLACEMENTS, Kind, Param, Spec, argument_values, key_text, usage,
)
from modulec.check.memory_policy import name_span, pipeline_problems
from modulec.check.partition import partition_problems
from modulec.diagnostics import Diagnostic, Label, error
from modulec.diagnostics.spelling import edit_distance
from modulec.ops.kernel_names import all_kernel_names, describe as describe_kernels
from modulec.paths import data_dir
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as expr_text

REGISTRY_NOTES = {  # what a name outside a registry's names is told about them
    "ops": lambda known: "known operations: the primitives (std/primitives), the "
                         "declarations and imports of this file, and the operations this "
                         "flow calls",
    "recipes": lambda known: "known recipes: " + ", ".join(f"`{name}`" for name in known)
                             if known else "no `recipe` is declared or imported in this file",
}
INPUT_KEYS, OUTPUT_KEYS = frozenset({"in", "inputs"}), frozenset({"out", "outputs"})
FOUND = {A.String: "the string ", A.Number: "the number ", A.Bool: "", A.NoneLit: "",
         A.ListExpr: "the list ", A.TupleExpr: "the tuple ", A.Name: "the name "}


@dataclass(frozen=True)
class Site:
    """An annotation and where it stands."""

    annotation: A.Annotation
    placement: str
    decl: A.Decl
    flow: A.Flow | None = None
    rank: int | None = None  # on a parameter: its number of dims, where written out


# ====================================================================== entry point
def check_annotations(program: A.Program) -> list[Diagnostic]:
    registries = {"ops": primitive_names() | _program_names(program),
                  "recipes": _recipe_names(program)}
    diagnostics = []
    for site in annotation_sites(program):
        diagnostics += check_site(site, registries)
    for decl in program.decls:
        diagnostics += partition_problems(decl) + pipeline_problems(decl)
    return diagnostics


def check_site(site: Site, registries: dict | None = None) -> list[Diagnostic]:
    """The annotation's errors; when it has none, W006 for what it leaves undone."""
    note = site.annotation
    spec = ANNOTATIONS.get(note.name)
    if spec is None:
        return [_unknown_annotation(note)]
    bound, problems = _bind(spec, note)
    known = dict(registries or {})
    problems = _bare_names(spec, note, problems, known)
    known["ops"] = known.get("ops", frozenset()) | _called(site.flow)
    on = _operations_on(site) & primitive_names()
    known["kernels"], known["kernels:note"] = all_kernel_names(on), _kernels_note(on)
    known["kernels:where"] = ", ".join(f"`{op}`" for op in sorted(on)) or "this flow"
    problems += _values(spec, bound, note, known)
    problems = _placement(spec, site) + problems + _one_of(spec, bound, note)
    return problems or without_effect(spec, bound, site.placement, note, site.flow is not None,
                                      site.rank)


# ====================================================================== sites
def annotation_sites(program: A.Program) -> Iterator[Site]:
    for decl in program.decls:
        yield from _on(decl.annotations, "decl", decl)
        yield from _items(decl.body, decl, None)


def _on(annotations, placement, decl, flow=None, rank=None) -> Iterator[Site]:
    for note in annotations:
        yield Site(note, placement, decl, flow, rank)


def _items(items, decl, section: str | None) -> Iterator[Site]:
    for item in items:
        yield from _item(item, decl, section)


def _item(item, decl, section) -> Iterator[Site]:
    if isinstance(item, A.Section):
        yield from _on(item.annotations, "body_line", decl)
        yield from _items(item.body, decl, item.name)
    elif isinstance(item, A.AnnotationLine):
        yield from _on(item.annotations, "body_line", decl)
    elif isinstance(item, (A.Entry, A.Binding)):
        placement = _entry_placement(item, section)
        yield from _on(item.annotations, placement, decl, rank=_rank(item, placement))
        yield from _elements(item.value, placement, decl, None)
    elif isinstance(item, A.IfBlock):
        yield from _items(item.body + (item.orelse or ()), decl, section)
    elif isinstance(item, A.ListItem):
        yield from _item(item.item, decl, section)
    elif isinstance(item, (A.Flow, A.Step)):
        yield from _flow(next(G.iter_flows([item])), decl)


def _entry_placement(item, section) -> str:
    """A binding makes a tensor; an entry is an input, an output or a parameter."""
    if isinstance(item, A.Binding):
        return "output"
    for name in (G.name_of(item.key), section):
        if name in INPUT_KEYS | OUTPUT_KEYS:
            return "input" if name in INPUT_KEYS else "output"
    return "param"


def _rank(item, placement: str) -> int | None:
    """A parameter's number of dims as written (`w: [N, C, bf16]`: 2); None elsewhere."""
    value = getattr(item, "value", None)
    if placement != "param" or not isinstance(value, A.ListExpr):
        return None
    from modulec.types.tensor import DTYPES

    return sum(1 for i in value.items if not (isinstance(i, A.Name) and i.id in DTYPES))


def _flow(flow: A.Flow, decl) -> Iterator[Site]:
    last = len(flow.steps) - 1
    for index, step in enumerate(flow.steps):
        placement = "output" if index == last else ("input" if index == 0 else "op")
        yield from _on(step.annotations, placement, decl, flow)
        yield from _elements(step.expr, placement, decl, flow)


def _elements(node, placement, decl, flow) -> Iterator[Site]:
    """Annotations on tuple elements anywhere inside an expression."""
    if isinstance(node, tuple):
        for child in node:
            yield from _elements(child, placement, decl, flow)
    elif is_dataclass(node) and not isinstance(node, A.Annotation):
        if isinstance(node, A.Element):
            yield from _on(node.annotations, placement, decl, flow)
        for f in fields(node):
            if f.name not in ("span", "annotations"):
                yield from _elements(getattr(node, f.name), placement, decl, flow)


# ====================================================================== arguments
def _bind(spec: Spec, note: A.Annotation) -> tuple[dict[str, A.Arg], list[Diagnostic]]:
    bound: dict[str, A.Arg] = {}
    problems: list[Diagnostic] = []
    slots = iter(spec.positional)
    keyword_seen = False
    for arg in note.args or ():
        if arg.key is None:
            problems += _positional(spec, arg, next(slots, None), bound, keyword_seen)
        else:
            keyword_seen = True
            problems += _keyword(spec, arg, bound)
    return bound, problems


def _positional(spec, arg, param, bound, keyword_seen) -> list[Diagnostic]:
    if param is None:
        count = len(spec.positional)
        takes = f"takes {count} positional argument{'s' * (count != 1)}" if count else \
            "takes no positional arguments"
        return [error("E008", f"`@{spec.name}` {takes}", arg.span,
                      "unexpected positional argument", help=[_forms(spec)],
                      notes=[f"signature: `{usage(spec)}`"])]
    bound[param.name] = arg
    if keyword_seen:
        return [error("E008", f"positional argument after keyword argument in `@{spec.name}`",
                      arg.span, "positional argument", help=[_forms(spec)])]
    return []


def _bare_names(spec, note, problems, known) -> list[Diagnostic]:
    """An annotation without positional parameters given a bare name that the table's
    `bare` says it may have meant (`@precision(NoSuchRecipe)`: a policy or a recipe):
    say what to write instead of only "takes no positional arguments"."""
    bare = [a for a in note.args or () if a.key is None and isinstance(a.value, A.Name)]
    if not spec.bare or spec.positional or not bare:
        return problems
    spans = {a.span for a in bare}
    return [p for p in problems if p.primary_span not in spans] + \
        [_bare_name(spec, arg, known) for arg in bare]


def _bare_name(spec, arg, known) -> Diagnostic:
    name, meant, notes = arg.value.id, {}, []
    for source, _, what, form in spec.bare:
        param = spec.param(source)
        names = sorted(param.kind.choices if param else known.get(source, ()))
        meant.update({n: form.format(name=n) for n in names if n not in meant})
        notes.append(f"{what}: " + (", ".join(f"`{n}`" for n in names) or "none here"))
    signature = f"signature: `{usage(spec)}`"
    if name in meant:
        return error("E008", f"`@{spec.name}` takes no positional arguments", arg.span,
                     "a bare name", help=[f"write {meant[name]}"], notes=[signature])
    neither = " nor ".join(one for _, one, _, _ in spec.bare)
    guess = closest(name, meant)
    return error("E008", f"`{name}` in `@{spec.name}(...)` is neither {neither}", arg.span,
                 "unknown name",
                 help=([f"did you mean {meant[guess]}?"] if guess else []) + [_forms(spec)],
                 notes=notes + [signature])


def _keyword(spec, arg, bound) -> list[Diagnostic]:
    key = key_text(arg.key)
    if spec.param(key) is None:
        guess = closest(key, [p.name for p in spec.params])
        return [error("E008", f"`@{spec.name}` has no argument `{key}`", arg.key.span,
                      "unknown argument", help=_did_you_mean(guess),
                      notes=[f"signature: `{usage(spec)}`"])]
    if key in bound:
        first = Label(bound[key].span, "first given here")
        return [error("E008", f"argument `{key}` of `@{spec.name}` is given twice",
                      arg.key.span, "given again here", secondary=[first],
                      help=[f"give `{key}` once"])]
    bound[key] = arg
    return []


def _values(spec, bound, note, ops) -> list[Diagnostic]:
    problems = []
    for param in spec.params:
        arg = bound.get(param.name)
        if arg is not None:
            problems += check_value(spec, param, param.kind, arg.value, ops)
        elif param.required:
            problems.append(_missing(spec, param, note))
    return problems


def check_value(spec: Spec, param: Param, kind: Kind, node, ops) -> list[Diagnostic]:
    if param.default is None and isinstance(node, A.NoneLit):
        return []
    if not isinstance(node, kind.nodes) or _wrong_number(kind, node):
        return [_wrong_kind(spec, param, kind, node)]
    value = node.id if isinstance(node, A.Name) else \
        node.value if isinstance(node, A.String) and kind.registry else None
    allowed = kind.choices or (ops.get(kind.registry, frozenset()) if kind.registry else ())
    if value is not None and (allowed or kind.registry) and value not in allowed:
        return [_not_allowed(spec, param, kind, node, value, allowed, ops)]
    if value is not None and kind.hints and value not in kind.hints:
        return _hint(spec, param, kind, node)
    if kind.items is not None and isinstance(node, (A.ListExpr, A.TupleExpr)):
        return _check_items(spec, param, kind, node, ops)
    return []


def _wrong_number(kind: Kind, node) -> bool:
    return kind.number == "int" and isinstance(node, A.Number) and \
        not isinstance(node.value, int)


def _check_items(spec, param, kind, node, ops) -> list[Diagnostic]:
    items = [e.value if isinstance(e, A.Element) else e for e in node.items]
    if kind.length is not None and len(items) != kind.length:
        return [_wrong_kind(spec, param, kind, node)]
    return [d for item in items if item is not None
            for d in check_value(spec, param, kind.items, item, ops)]


def _one_of(spec, bound, note) -> list[Diagnostic]:
    rule = spec.one_of
    if rule is None or any(_given(bound.get(name)) for name in rule.params):
        return []
    if rule.unless and G.name_of(argument_values(note).get(rule.unless[0])) == rule.unless[1]:
        return []
    notes = [_choices_note(p) for p in map(spec.param, rule.params) if p.kind.choices]
    return [error(rule.code, rule.message, note.span, "nothing given", help=[_forms(spec)],
                  notes=notes)]


def _given(arg: A.Arg | None) -> bool:
    """An argument that says something: `ops=[]` lists nothing to fuse."""
    return arg is not None and not (isinstance(arg.value, A.ListExpr) and not arg.value.items)


# ====================================================================== messages
def _unknown_annotation(note: A.Annotation) -> Diagnostic:
    guess = closest(note.name, ANNOTATIONS)
    known = ", ".join(f"`@{name}`" for name in ANNOTATIONS)
    return error("E008", f"unknown annotation `@{note.name}`", name_span(note),
                 "unknown annotation", help=_did_you_mean(guess, "@"),
                 notes=[] if guess else [f"known annotations: {known}"])


def _placement(spec: Spec, site: Site) -> list[Diagnostic]:
    if site.placement in spec.placements:
        return []
    places = " or ".join(PLACEMENTS[p] for p in PLACEMENTS if p in spec.placements)
    return [error("E008", f"`@{spec.name}` cannot be used on {PLACEMENTS[site.placement]}",
                  name_span(site.annotation), "not allowed here",
                  notes=[f"`@{spec.name}` {spec.summary} ({spec.section}); "
                         f"it goes on {places}"])]


def _missing(spec, param, note) -> Diagnostic:
    notes = [_choices_note(param)] if param.kind.choices else \
        [f"`{param.name}`: {param.kind.describe} ({param.summary})"]
    return error("E008", f"`@{spec.name}` is missing its `{param.name}` argument", note.span,
                 f"`{param.name}` is required", help=[_forms(spec)], notes=notes)


def _wrong_kind(spec, param, kind, node) -> Diagnostic:
    text = expr_text(node)
    found = FOUND.get(type(node), "the expression ") + f"`{_shorten(text)}`"
    return error("E008", f"`{param.name}` of `@{spec.name}` must be {kind.describe}, "
                         f"found {found}", node.span, f"expected {kind.describe}",
                 help=_quick_fix(kind, node, text), notes=[f"`{param.name}`: {param.summary}"])


def _quick_fix(kind: Kind, node, text: str) -> list[str]:
    if isinstance(node, A.String) and _fits_unquoted(kind, node.value):
        return [f"write `{node.value}` without quotes"]
    if isinstance(node, A.Name) and A.String in kind.nodes:
        return [f'write `"{node.id}"` (a string)']
    return _did_you_mean(closest(text, kind.choices)) if kind.choices else []


def _shorten(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _fits_unquoted(kind: Kind, text: str) -> bool:
    if kind.choices:
        return text in kind.choices
    if kind.number == "int":
        return text.lstrip("-").isdigit()
    return A.Name not in kind.nodes and text.replace(".", "", 1).isdigit()


def _not_allowed(spec, param, kind, node, value, allowed, registries) -> Diagnostic:
    """`value` is not among `allowed` (the kind's choices, or its registry's names; a
    registry may say more about its names here: `<registry>:note`, `<registry>:where`)."""
    where = registries.get(f"{kind.registry}:where", "")
    message = kind.unknown.format(value=value, param=param.name, annotation=spec.name,
                                  where=where)
    guess = closest(value, sorted(allowed))
    note = registries.get(f"{kind.registry}:note")
    notes = [_choices_note(param, kind)] if kind.choices else \
        [note or REGISTRY_NOTES[kind.registry](sorted(allowed))]
    return error(kind.code, message, node.span, kind.label.format(param=param.name),
                 help=_did_you_mean(guess), notes=notes)


def _hint(spec, param, kind, node) -> list[Diagnostic]:
    """Any name goes, but one within two edits of a known value is taken for a typo (a
    warning would need a W code, and Appendix D has none for this)."""
    guess = closest(node.id, kind.hints, limit=2)
    if guess is None:
        return []
    return [error("E008", kind.near.format(value=node.id, guess=guess), node.span,
                  "misspelled?", help=_did_you_mean(guess),
                  notes=[f"a custom `{param.name}` of `@{spec.name}` may have any name that "
                         f"is not within two edits of a standard one ({spec.section})"])]


def _choices_note(param: Param, kind: Kind | None = None) -> str:
    kind = kind or param.kind
    return f"`{param.name}` is one of: {', '.join(kind.choices)}"


def _forms(spec: Spec) -> str:
    return "usage: " + " or ".join(f"`{form}`" for form in spec.forms)


def _did_you_mean(guess: str | None, prefix: str = "") -> list[str]:
    return [f"did you mean `{prefix}{guess}`?"] if guess else []


# ====================================================================== known names
@lru_cache(maxsize=1)
def primitive_names() -> frozenset[str]:
    folder = data_dir("std") / "primitives"
    return frozenset(path.stem for path in folder.glob("*.module"))


def _program_names(program: A.Program) -> frozenset[str]:
    names = {decl.name for decl in program.decls}
    for item in program.items:
        if isinstance(item, (A.Import, A.FromImport)):
            names |= {i.alias or i.name for i in item.names or ()}
        if isinstance(item, A.Import) and not item.names:
            names.add(item.alias or item.path[-1])
    return frozenset(names)


def _operations_on(site: Site) -> frozenset[str]:
    """The operations an annotation concerns: the step it follows, or (after the
    destination) every operation of its flow."""
    if site.flow is None:
        return frozenset()
    step = next((s for s in site.flow.operations
                 if any(n is site.annotation for n in s.annotations)), None)
    return _called(site.flow) if step is None else _call_names((step,))


def _kernels_note(ops: frozenset[str]) -> str:
    if not ops:
        return "a kernel implements a primitive operation, and this flow calls none"
    return "kernels: " + describe_kernels(ops)


def _recipe_names(program: A.Program) -> frozenset[str]:
    """The recipes a `@recipe(...)` may name: this file's `recipe` declarations, and any
    imported name (an import's kind is the resolver's business)."""
    declared = {decl.name for decl in program.decls if decl.kind == "recipe"}
    return frozenset(declared) | (_program_names(program) - {d.name for d in program.decls})


def _called(flow: A.Flow | None) -> frozenset[str]:
    return frozenset() if flow is None else _call_names(flow.operations)


def _call_names(steps) -> frozenset[str]:
    calls = [step.expr.func for step in steps if isinstance(step.expr, A.Call)]
    return frozenset(f.id if isinstance(f, A.Name) else f.attr for f in calls
                     if isinstance(f, (A.Name, A.Attribute)))


def closest(word: str, candidates, limit: int | None = None) -> str | None:
    """The candidate nearest `word` by edit distance (ties: alphabetical), if near enough."""
    limit = max(2, len(word) // 3) if limit is None else limit
    scored = sorted((edit_distance(word.lower(), c.lower()), c) for c in candidates if c != word)
    return scored[0][1] if scored and scored[0][0] <= limit else None
