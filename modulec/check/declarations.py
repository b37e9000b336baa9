"""Declaration-level rules: duplicates (E009), inheritance (E011), required sections (E012).

`extends` (§4.2, §4.3): the derived module inherits its base's parameters and forward
signature; `+name` adds a parameter the base lacks, a plain `name` overrides one the base
has with the same rank; a derived forward signature, when given, must equal the base's.
"""

from __future__ import annotations

from dataclasses import replace

from modulec.check.world import World, did_you_mean
from modulec.diagnostics import Label
from modulec.semantic.decls import ModuleDef, TensorParam
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show


def check_declarations(world: World, program: A.Program) -> None:
    seen: dict[str, A.Decl] = {}
    for decl in program.decls:
        if decl.name in seen:
            world.error("E009", f"`{decl.name}` is declared twice in this file", decl.name_span,
                        "declared again here",
                        secondary=[Label(seen[decl.name].name_span, "first declared here")])
        seen.setdefault(decl.name, decl)
        _duplicates(world, decl)
        _required_sections(world, decl)


def _duplicates(world: World, decl: A.Decl) -> None:
    definition = world.definition(decl)
    groups = [
        ("parameter", [(p.name, p.span) for p in decl.params or ()]),
        ("parameter", [(p.name, p.span) for p in definition.params]),
        ("constant", [(b.target.id, b.target.span) for b in definition.lets
                      if isinstance(b.target, A.Name)]),
    ]
    for what, names in groups:
        first: dict[str, object] = {}
        for name, span in names:
            if name in first:
                world.error("E009", f"duplicate {what} `{name}` in `{decl.name}`", span,
                            "declared again here",
                            secondary=[Label(first[name], "first declared here")])
            first.setdefault(name, span)


def _required_sections(world: World, decl: A.Decl) -> None:
    if decl.kind not in ("module", "block", "model") or decl.abstract:
        return
    definition = world.definition(decl)
    pattern = definition.sections.get("pattern")
    if isinstance(pattern, A.Section):
        _pattern_not_implemented(world, decl, pattern)
    elif decl.extends is not None:
        if definition.forward is not None and definition.forward.graph is None:
            base = show(decl.extends)
            world.error("E011", f"`{decl.name}` extends `{base}` but writes no forward graph",
                        decl.name_span, "no `graph:` here or in the base",
                        help=[f"`{base}` declares the signature only: add `forward:` with a "
                              "`graph:` that computes the outputs from the inputs"])
    elif definition.forward is None:
        world.error("E012", f"{decl.kind} `{decl.name}` has no `forward:` section",
                    decl.name_span, "needs a forward graph",
                    help=["add `forward:` with `in:`, `out:` and `graph:`"])
    elif definition.forward.graph is None and definition.forward.outputs:
        world.error("E012", f"{decl.kind} `{decl.name}` has no forward `graph:`",
                    decl.name_span, "nothing computes its outputs",
                    help=["add `graph:` under `forward:`, or declare it `abstract module` "
                          "(an interface that modules `extends`)"])


def _pattern_not_implemented(world: World, decl: A.Decl, pattern: A.Section) -> None:
    """§4.4's `pattern:` names a residual pattern but not where its norms and adds go
    (pre- or post-norm, one residual input or the (residual, x) pair of std's blocks):
    refused, with the flows a pre-norm `sequential_residual` would be."""
    kind = show(pattern.value) if pattern.value is not None else "pattern"
    pairs = [tuple(show(e.value) for e in item.item.expr.items)
             for section in pattern.body if isinstance(section, A.Section)
             for item in section.body if isinstance(getattr(item, "item", None), A.Step)
             and isinstance(item.item.expr, A.TupleExpr)]
    example = "; ".join(f"`x -> {p[0]} -> h1`, `h1 -> {p[1]} -> o1`, `(x, o1) -> add() -> x1`"
                        for p in pairs[:1] if len(p) == 2)
    world.error("E012", f"block `{decl.name}` has no `forward:` section: `pattern: {kind}` "
                "is not implemented", pattern.key.span,
                "modulec does not generate a block's graph from a pattern",
                help=["write the block's `forward:` (`in:`, `out:`, `graph:`)"
                      + (f"; a pre-norm residual is, for the first pair: {example}"
                         if example else "")])


def merge_extends(world: World, decl: A.Decl, definition: ModuleDef) -> ModuleDef:
    """The derived definition with its base's parameters and signature folded in."""
    base_decl = _base(world, decl)
    if base_decl is None:
        return definition
    base = world.definition(base_decl)
    params = _merged_params(world, decl, base, definition)
    forward = _merged_forward(world, decl, base, definition)
    return replace(definition, params=params, forward=forward)


def _base(world: World, decl: A.Decl) -> A.Decl | None:
    if decl.extends is None:
        return None
    name = decl.extends.id if isinstance(decl.extends, A.Name) else show(decl.extends)
    base = world.lookup_decl(name, decl.extends.span)
    if base is None or base.kind not in ("module", "block", "model") or base is decl:
        world.error("E011", f"`{decl.name}` extends `{name}`, which is not a module in scope",
                    decl.extends.span, "cannot extend this",
                    help=did_you_mean(name, world.candidates(decl.extends.span)))
        return None
    return base


def _merged_params(world, decl, base: ModuleDef, derived: ModuleDef) -> tuple[TensorParam, ...]:
    merged = {p.name: p for p in base.params}
    for param in derived.params:
        inherited = merged.get(param.name)
        if param.extend and inherited is not None:
            world.error("E011", f"`+{param.name}` adds a parameter that `{base.name}` already "
                        "declares", param.span, "already in the base",
                        secondary=[Label(inherited.span, f"declared in `{base.name}`")],
                        help=[f"drop the `+` to override `{param.name}`"])
        elif not param.extend and inherited is None:
            world.error("E011", f"`{param.name}` overrides nothing: `{base.name}` has no "
                        "such parameter", param.span, "not in the base",
                        help=[f"write `+{param.name}` to add a new parameter"] +
                        did_you_mean(param.name, [p.name for p in base.params]))
        elif inherited is not None and _rank(param) != _rank(inherited):
            world.error("E011", f"`{param.name}` overrides `{base.name}`'s parameter with a "
                        "different rank", param.span, f"rank {_rank(param)}",
                        secondary=[Label(inherited.span, f"rank {_rank(inherited)} in the base")])
        merged[param.name] = param
    return tuple(merged.values())


def _merged_forward(world, decl, base: ModuleDef, derived: ModuleDef):
    if derived.forward is None:
        return base.forward
    if base.forward is None or not derived.forward.declared_io:
        inherited_io = base.forward
        if inherited_io is None:
            return derived.forward
        return replace(derived.forward, inputs=inherited_io.inputs, outputs=inherited_io.outputs)
    if _signature(derived.forward) != _signature(base.forward):
        world.error("E011", f"`{decl.name}` changes the forward signature of `{base.name}`",
                    derived.forward.span, "signature differs from the base",
                    notes=[f"base: {_signature_text(base.forward)}",
                           f"here: {_signature_text(derived.forward)}"])
    return derived.forward


def _rank(param: TensorParam) -> int | None:
    type_ = param.type.value if isinstance(param.type, A.OptionalType) else param.type
    return len(type_.items) if isinstance(type_, A.ListExpr) else None


def _signature(phase) -> tuple:
    return tuple((s.name, show(s.type) if s.type else None) for s in phase.inputs + phase.outputs)


def _signature_text(phase) -> str:
    def part(sigs):
        return ", ".join(f"{s.name}: {show(s.type)}" if s.type else s.name for s in sigs)
    return f"in ({part(phase.inputs)}) -> out ({part(phase.outputs)})"
