"""The soundness invariant of the language (issue 15), as a function the property tests
call (helper, not a test file):

    for every program `check` accepts, `build` succeeds, `ir verify` accepts its IR, and a
    forward + backward with random weights on small sizes completes, or stops with a
    diagnostic about the user's program; never an internal error.

`soundness(text, folder)` runs the whole chain in-process on one program (written to a
file of `folder`, so imports resolve as for a user's file) and returns an `Outcome`: what
happened to each declaration. A broken invariant raises `Unsound` with the program, the
stage and the backtrace.
"""

from __future__ import annotations

import itertools
import json
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch

from modulec.cli.build_cmd import verify_document
from modulec.cli.inputs import CheckOptions, check_one
from modulec.ir.serialize import dumps
from modulec.lower.build import BuildRequest, build
from runtime.errors import RuntimeUserError
from runtime.model import Model, parameter_shapes
from runtime.program import Program
from runtime.verify import FREE_DIM_SIZES, _free_dims, _random_inputs, _random_params
from runtime.verify_config import declaration_config

CODE = re.compile(r"E\d{3}")
RUNNABLE = ("module", "block", "model")
MAX_ELEMENTS = 1 << 20  # larger is no small size: built and verified, not run
_names = itertools.count()


class Unsound(AssertionError):
    """`check` accepted the program and a later stage crashed or refused it wrongly."""


@dataclass
class Outcome:
    accepted: bool  # `check` reported no error
    ran: list[str] = field(default_factory=list)  # declarations run forward and backward
    stopped: list[str] = field(default_factory=list)  # stopped by a build diagnostic
    skipped: list[str] = field(default_factory=list)  # a known-broken kind, not run


def star_input(decl) -> bool:
    """Whether a forward input has a `*` dim (`x: [*, d]`): built alone, its rank is open."""
    from dataclasses import fields, is_dataclass

    from modulec.syntax import ast as A

    def has_star(node) -> bool:
        if isinstance(node, A.Star):
            return True
        if isinstance(node, (tuple, list)):
            return any(has_star(item) for item in node)
        return is_dataclass(node) and any(has_star(getattr(node, f.name))
                                          for f in fields(node) if f.name != "span")

    return any(has_star(item) for section in decl.sections("forward") for item in section.body
               if getattr(getattr(item, "key", None), "id", None) in ("in", "inputs"))


def soundness(text: str, folder: Path, label: str = "", only: str | None = None,
              skip=lambda decl: False) -> Outcome:
    """`only`: run just this declaration (the others of the file are run through it);
    `skip(decl)`: a declaration of a kind known to be broken, counted but not run."""
    path = Path(folder) / f"program_{next(_names)}.module"
    path.write_text(text, encoding="utf-8")
    try:
        return _check_and_run(path, text, label, only, skip)
    finally:
        path.unlink()


def _check_and_run(path: Path, text: str, label: str, only: str | None, skip) -> Outcome:
    with click.Context(click.Command("soundness")):  # check_one notes the current file
        checked = _stage("check", text, label, lambda: check_one(path, CheckOptions()))
    if not checked.ok:
        return Outcome(False)
    outcome = Outcome(True)
    for decl in checked.program.decls:
        if only not in (None, decl.name):
            continue
        if decl.kind in RUNNABLE and _has_forward(decl) and not decl.abstract:
            if skip(decl):
                outcome.skipped.append(decl.name)
            elif _run_declaration(path, decl, text, label):
                outcome.ran.append(decl.name)
            else:
                outcome.stopped.append(decl.name)
    return outcome


def _has_forward(decl) -> bool:
    from modulec.cli.verify_cmd import _has_forward

    return _has_forward(decl)


def _run_declaration(path: Path, decl, text: str, label: str) -> bool:
    """True when it ran; False when the build stopped with a diagnostic of the user's."""
    where = f"{label} `{decl.name}`"
    config = _stage("verify sizes", text, where, lambda: declaration_config(decl))
    # the usual free dims sized up front: one build, unless the inputs name others
    shapes = dict(FREE_DIM_SIZES) | dict(config.shapes)
    program = _build(path, decl.name, config.settings, shapes, text, where)
    if program is not None and _free_dims(program.metadata["inputs"], shapes):
        shapes |= _free_dims(program.metadata["inputs"], shapes)
        program = _build(path, decl.name, config.settings, shapes, text, where)
    if program is None:
        return False
    _verify_ir(program, path, text, where)
    if _largest_value(program) > MAX_ELEMENTS:  # a mutant's 2**31 vocabulary, say
        return False
    _stage("forward + backward", text, where, lambda: _forward_backward(program, shapes))
    return True


def _largest_value(program: Program) -> int:
    """The elements of the largest value (or parameter) the program holds at these sizes."""
    largest = 0
    for function in program.graph.functions:
        for info in function.values:
            numel = 1
            for dim in info.shape:
                numel *= int(dim) if str(dim).isdigit() else 1
            largest = max(largest, numel)
    for shape in parameter_shapes(program.graph).values():
        numel = 1
        for dim in shape:
            numel *= dim if isinstance(dim, int) else 1
        largest = max(largest, numel)
    return largest


def _build(path, name, settings, shapes, text, where) -> Program | None:
    request = BuildRequest(path, model=name, settings=dict(settings), shapes=dict(shapes))
    result = _stage("build", text, where, lambda: build(request))
    errors = [d for d in result.diagnostics if d.is_error]
    if result.document is not None and not errors and result.failure is None:
        return Program(result.graph, result.document)
    if errors and all(d.code and CODE.fullmatch(d.code) for d in errors):
        return None  # a diagnostic: the sizes break one of the user's constraints, say
    raise Unsound(_report("build", text, where, "no IR and no diagnostic with a code: "
                          + "; ".join(d.message for d in errors) + f" {result.failure or ''}"))


def _verify_ir(program: Program, path: Path, text: str, where: str) -> None:
    ir_path = path.with_suffix(".ir.json")
    ir_path.write_text(dumps(program.document), encoding="utf-8")
    try:
        problems = _stage("ir verify", text, where, lambda: verify_document(ir_path))
    finally:
        ir_path.unlink()
    if problems:
        raise Unsound(_report("ir verify", text, where, "\n".join(problems)))


class _Built:
    """A model source that is one program already built."""

    def __init__(self, program: Program):
        self._program = program

    def program(self, shapes=None, planned=True) -> Program:
        return self._program

    def program_for(self, inputs) -> Program:
        return self._program


def _forward_backward(program: Program, shapes: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    model = Model(_Built(program), dtype=torch.float64, check_finite=False)
    sizes = parameter_shapes(program.graph)
    model.params = _random_params(sizes, generator)
    inputs = _random_inputs(program.metadata["inputs"], shapes, generator, sizes)
    outputs = model.forward(**inputs)
    seeds = {name: torch.randn(value.shape, generator=generator, dtype=torch.float64)
             for name, value in outputs.items() if value.is_floating_point()}
    model.backward(**seeds)


def _stage(stage: str, text: str, where: str, run):
    """`run()`; any exception is a broken invariant, except a diagnostic at `build`."""
    try:
        return run()
    except Unsound:
        raise
    except Exception as exc:  # noqa: BLE001 - every escape is what the test looks for
        kind = "a runtime error" if isinstance(exc, RuntimeUserError) else "a crash"
        raise Unsound(_report(stage, text, where, f"{kind}: {type(exc).__name__}: {exc}\n"
                              + "".join(traceback.format_exc(limit=-8)))) from exc


def _report(stage: str, text: str, where: str, what: str) -> str:
    return (f"accepted by `check`, then `{stage}` failed on {where}:\n{what}\n"
            f"--- program ---\n{text}--- end ---")


def summary(counts: dict) -> str:
    return json.dumps(counts, sort_keys=True)
