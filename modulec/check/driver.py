"""`modulec check`, past the syntax: check every declaration of a parsed file.

Modules, blocks and models are checked as declared (parameters without defaults stay
symbolic); a model's defaults make it a concrete instance. Primitives are declarations
of the op table and are checked by the op table's loader.
"""

from __future__ import annotations

from modulec.check.declarations import check_declarations
from modulec.check.instance import Instance, Stack, Submodule, instantiate
from modulec.check.invariants import check_invariants
from modulec.check.module import check_body
from modulec.check.verify_sizes import check_verify_sizes
from modulec.check.world import LocalNames, Names, World
from modulec.diagnostics import Diagnostic
from modulec.syntax import ast as A


def check_program(program: A.Program, names: Names | None = None,
                  checked: list | None = None, scopes: dict | None = None,
                  deep_models: bool = True) -> list[Diagnostic]:
    """Diagnostics of every declaration; `checked` collects the instances (--emit resolved);
    `scopes` maps the names of other loaded files to their names (see `scopes_of`).
    `deep_models=False` leaves the model's submodule tree and weight mapping to the caller
    (`modulec build` checks them while lowering, at the sizes it builds)."""
    world = World(names or LocalNames({d.name: d for d in program.decls}), scopes or {})
    check_declarations(world, program)
    check_invariants(world, program)
    if _has_annotations(program):  # the annotation table is imported only when needed
        from modulec.check.annotations import check_annotations

        for diagnostic in check_annotations(program):
            world.report(diagnostic)
    for decl in program.decls:
        if decl.kind in ("module", "block", "model") and not decl.abstract:
            instance = instantiate(world, world.definition(decl))
            check_body(instance)
            if any(a.name == "shard" for p in instance.definition.params
                   for a in p.annotations):
                from modulec.check.sharding import check_shard_layouts

                check_shard_layouts(instance)
            if decl.kind == "model" and deep_models:
                from modulec.check.weights import check_weights  # models only: import late

                check_tree(instance)
                check_weights(instance)
            elif decl.kind != "model":
                check_children(instance)
            check_verify_sizes(world, decl)  # after: an error at its own sizes says so
            if checked is not None:
                checked.append(instance)
    return world.diagnostics


def check_children(instance: Instance) -> None:
    """A module's or block's submodules at the values it gives them, its own parameters
    left symbolic: a callee's graph was checked only at its own declaration, so a value
    it cannot take (`LayerNormParams(d, eps)` with `eps: float = -1` in the block)
    checked clean and the block did not build at any size (a gentle fuzz run). Quietly:
    at symbolic sizes much is unknown (`head_dim == None`), so only the errors that no
    caller's sizes can mend are reported (`World.error_unmuted`: a value an op cannot
    take, a size no tensor can have)."""
    seen = {id(instance)}
    children = [v.instance for v in instance.params.values() if isinstance(v, (Submodule, Stack))]
    instance.world.quiet += 1
    try:
        for child in children + instance.inline_calls:
            check_tree(child, seen)
    finally:
        instance.world.quiet -= 1


def check_tree(instance: Instance, seen: set | None = None) -> None:
    """Check every submodule's graphs at the sizes this instance gives them (a model's
    real sizes reach every block), and those of the modules its graphs call inline (`x ->
    MoELoadBalancingLoss(...) -> y`: only `build` checked them at those sizes, so a
    scale that overflowed to inf there checked clean); each instance is checked once."""
    seen = set() if seen is None else seen
    if id(instance) in seen:
        return
    seen.add(id(instance))
    check_body(instance)
    children = [v.instance for v in instance.params.values() if isinstance(v, (Submodule, Stack))]
    for child in children + instance.inline_calls:
        check_tree(child, seen)


def _has_annotations(node) -> bool:
    """Whether the syntax tree under `node` holds an annotation: a walk with a stack of
    its own (a deeply nested expression, 400 unary minus signs, overflowed Python's)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, A.Annotation):
            return True
        if isinstance(node, tuple):
            stack.extend(node)
            continue
        fields = getattr(node, "__dataclass_fields__", None) or ()
        stack.extend(getattr(node, name) for name in fields
                     if name not in ("span", "name_span", "file"))
    return False


def scopes_of(resolver) -> dict:
    """File name -> names, for every file a `modulec.resolve.Resolver` has loaded."""
    return {f.source.name: f.scope for f in resolver.files() if f.source is not None}


def check_instance(decl: A.Decl, names: Names, args: dict,
                   scopes: dict | None = None) -> list[Diagnostic]:
    """Instantiate `decl` with concrete arguments (a model's real sizes) and check it all."""
    world = World(names, scopes or {})
    check_tree(instantiate(world, world.definition(decl), args))
    return world.diagnostics
