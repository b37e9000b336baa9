"""Check a document's unsaved text exactly as `modulec check` checks a file on disk.

`check_one` is reused unchanged: only the resolver differs, reading the editor's open
documents (the overlay) instead of the disk for those paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import click

from modulec.cli.inputs import CheckOptions, check_one
from modulec.diagnostics import Diagnostic
from modulec.resolve import Resolver
from modulec.resolve.resolver import Parsed, ResolvedFile
from modulec.source import SourceFile


class OverlayResolver(Resolver):
    """A `Resolver` that parses the in-memory text of open documents (path -> text)."""

    def __init__(self, overlay: dict[Path, str], search_path=()) -> None:
        super().__init__(search_path)
        self.overlay = {Path(p).resolve(): text for p, text in overlay.items()}

    def _parse(self, path: Path, shown: str | None = None) -> Parsed:
        if path in self.overlay and path not in self._parsed:
            from modulec.resolve.resolver import _display_name
            from modulec.syntax.parser import parse_source

            source = SourceFile(shown or _display_name(path), self.overlay[path])
            result = parse_source(source)
            self._parsed[path] = Parsed(source, result.program, list(result.diagnostics))
        return super()._parse(path, shown)


@dataclass
class Analysis:
    """One check of a document: what hover and go-to-definition look things up in."""

    path: Path
    source: SourceFile
    resolved: ResolvedFile
    diagnostics: list[Diagnostic]
    instances: list = field(default_factory=list)  # checked `Instance`s (empty on errors)

    @property
    def program(self):
        return self.resolved.program


def analyze(path: Path, text: str, overlay: dict[Path, str] | None = None,
            search_path=()) -> Analysis:
    """`modulec check PATH`, with `text` as the file's contents (and `overlay` for others)."""
    resolver = OverlayResolver({**(overlay or {}), path: text}, search_path)
    checked: list = []
    with click.Context(click.Command("lsp")):  # check_one records the file in ctx.meta
        result = check_one(path, CheckOptions(tuple(search_path)), resolver, checked)
    resolved = resolver.load(path)  # loaded already: the same ResolvedFile
    source = result.source or SourceFile(str(path), text)
    return Analysis(path, source, resolved, result.diagnostics, checked)
