"""The files a command works on, and what happens to each: read, parse, check."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from modulec.cli.guard import CURRENT_FILE

if TYPE_CHECKING:
    from modulec.diagnostics import Diagnostic
    from modulec.source import SourceFile

MODULE_SUFFIX = ".module"


@dataclass
class FileResult:
    """One input file: its text (None when it could not be read), tree and diagnostics."""

    name: str
    source: SourceFile | None
    program: object | None
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


@dataclass(frozen=True)
class CheckOptions:
    """Settings of `check` for later passes (the import resolver will read `search_path`)."""

    search_path: tuple[Path, ...] = ()


def parse_one(path: Path) -> FileResult:
    from modulec.source import SourceFile
    from modulec.syntax import parser  # looked up per call, so tests can patch parse_source

    click.get_current_context().meta[CURRENT_FILE] = str(path)
    try:
        source = SourceFile.read(path)
    except (OSError, UnicodeDecodeError) as exc:
        return unreadable(path, exc)
    result = parser.parse_source(source)
    return FileResult(source.name, source, result.program, list(result.diagnostics))


def check_one(path: Path, options: CheckOptions, resolver=None, checked=None) -> FileResult:
    """Parse and resolve imports (modulec.resolve), then check sections and semantics."""
    from modulec.check.driver import check_program, scopes_of
    from modulec.resolve import Resolver
    from modulec.syntax.sections import check_sections

    click.get_current_context().meta[CURRENT_FILE] = str(path)
    resolver = resolver or Resolver(options.search_path)
    try:
        resolved = resolver.load(path)
    except (OSError, UnicodeDecodeError) as exc:
        return unreadable(path, exc)
    result = FileResult(str(path), resolved.source, resolved.program, list(resolved.diagnostics))
    if result.program is None:
        return result
    from modulec.resolve.lock_check import lock_problems

    result.diagnostics.extend(lock_problems(resolver, resolved, str(path)))
    # Recovery removes broken lines from the tree, so checking what is left adds no
    # follow-on errors, and the user sees every problem of the file in one run.
    result.diagnostics.extend(check_sections(result.program))
    if result.ok:
        before = len(resolved.scope.diagnostics)  # lookups report E023 ambiguities there
        scopes = scopes_of(resolver)
        result.diagnostics.extend(check_program(result.program, resolved.scope, checked, scopes))
        result.diagnostics.extend(resolved.scope.diagnostics[before:])
    return result


def unreadable(path: Path, exc: Exception) -> FileResult:
    """A file that vanished, is unreadable or is not UTF-8: an error without a code or span."""
    from modulec.diagnostics import error

    if isinstance(exc, UnicodeDecodeError):
        reason = f"not valid UTF-8 (byte offset {exc.start})"
    else:
        reason = getattr(exc, "strerror", None) or str(exc)
    return FileResult(str(path), None, None, [error("", f"cannot read {path}: {reason}", None)])


def collect_module_files(inputs: tuple[Path, ...]) -> list[Path]:
    """Files as given, folders expanded (sorted); each file once, at its first mention."""
    seen: set[Path] = set()
    files = []
    for item in inputs:
        for path in module_files_under(item) if item.is_dir() else [item]:
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files


def module_files_under(folder: Path) -> list[Path]:
    """Every `*.module` file below `folder`, skipping hidden files and folders, and links
    that lead out of `folder` (a link to /etc/shadow named x.module had its first line
    printed in a diagnostic; `check DIR` reads only what DIR holds)."""
    found, inside = [], Path(os.path.realpath(folder))
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names
                  if n.endswith(MODULE_SUFFIX) and not n.startswith(".")
                  and Path(os.path.realpath(Path(root, n))).is_relative_to(inside)]
    return sorted(found, key=lambda p: p.relative_to(folder).parts)
