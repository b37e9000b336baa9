"""`modulec check`, past the syntax: check every declaration of a parsed file.

Modules, blocks and models are checked as declared (parameters without defaults stay
symbolic); a model's defaults make it a concrete instance. Primitives are declarations
of the op table and are checked by the op table's loader.
"""

from __future__ import annotations

from modulec.check.declarations import check_declarations
from modulec.check.instance import instantiate
from modulec.check.module import check_body
from modulec.check.world import LocalNames, Names, World
from modulec.diagnostics import Diagnostic
from modulec.syntax import ast as A


def check_program(program: A.Program, names: Names | None = None) -> list[Diagnostic]:
    world = World(names or LocalNames({d.name: d for d in program.decls}))
    check_declarations(world, program)
    for decl in program.decls:
        if decl.kind in ("module", "block", "model") and not decl.abstract:
            check_body(instantiate(world, world.definition(decl)))
    return world.diagnostics


def check_instance(decl: A.Decl, names: Names, args: dict) -> list[Diagnostic]:
    """Instantiate `decl` with concrete arguments (a model's real sizes) and check it."""
    world = World(names)
    check_body(instantiate(world, world.definition(decl), args))
    return world.diagnostics
