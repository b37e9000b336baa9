"""`--shape DIM=SIZE` checked against the model: a dim its inputs do not have is a
mistake (it sized nothing), and so is a sequence dim `T` above the model's `max_seq`
(docs/decisions.md, "--shape")."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from modulec.check.given import SEQUENCE_BOUND, SEQUENCE_DIM
from modulec.syntax import ast as A
from modulec.types.tensor import DTYPES

INPUT_KEYS = ("in", "inputs")


def shape_problems(result, shapes: dict[str, int]) -> list[str]:
    """What is wrong with `shapes` for the model `result` (a BuildResult) built."""
    if not shapes or result.document is None or result.source is None:
        return []
    metadata = result.document["metadata"]
    decl = _declaration(result.source, metadata["model"])
    if decl is None:
        return []
    params = {p.name for p in decl.params or ()}
    dims = sorted(input_dims(decl) - params - set(DTYPES))
    problems = []
    for name, size in sorted(shapes.items()):
        if name in params:
            problems.append(f"--shape {name}={size}: `{name}` is a parameter of "
                            f"`{decl.name}`, not a dim of its inputs (use --set {name}={size})")
        elif name not in dims:
            problems.append(f"--shape {name}={size}: `{decl.name}`'s inputs have no dim "
                            f"`{name}` (their dims: {', '.join(dims) or 'none'})")
    bound = metadata.get("parameters", {}).get(SEQUENCE_BOUND, "")
    size = shapes.get(SEQUENCE_DIM)
    if size is not None and bound.isdigit() and size > int(bound):
        problems.append(f"--shape {SEQUENCE_DIM}={size} is longer than the model's "
                        f"{SEQUENCE_BOUND} ({bound}): use {SEQUENCE_DIM}={bound} or less, or "
                        f"--set {SEQUENCE_BOUND}={size}")
    return problems


def shapes_refused(result, shapes: dict[str, int]) -> bool:
    """Print what is wrong with `--shape` (as `error: ...` lines); True if anything is."""
    import click

    problems = shape_problems(result, shapes)
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    return bool(problems)


def _declaration(source, name: str):
    from modulec.syntax.parser import parse_source

    program = parse_source(source).program
    found = [d for d in program.decls if d.name == name] if program is not None else []
    return found[0] if found else None


def input_dims(decl: A.Decl) -> set[str]:
    """The names in the shapes of the declaration's forward inputs."""
    names: set[str] = set()
    for section in decl.sections("forward"):
        for item in section.body:
            if getattr(getattr(item, "key", None), "id", None) in INPUT_KEYS:
                _names(item, names)
    return names


def _names(node, names: set[str]) -> None:
    if isinstance(node, A.ListExpr):
        names.update(i.id for i in node.items if isinstance(i, A.Name))
    if isinstance(node, (tuple, list)):
        for item in node:
            _names(item, names)
    elif is_dataclass(node):
        for f in fields(node):
            if f.name != "span":
                _names(getattr(node, f.name), names)
