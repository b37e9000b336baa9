"""Import statements -> requests (one per path to resolve) -> names in a `Scope`.

`import P` / `import P as M` is one request for P. `import P.{C, D as E}` and
`from P import C, D as E` are one request per item, for `P.C` and `P.D`. What a request
binds depends on what its path names (see `ScopeBuilder.add`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modulec.diagnostics import Diagnostic
from modulec.resolve import messages
from modulec.resolve.scope import Binding, Entry, Scope
from modulec.source import SourceFile, Span
from modulec.syntax import ast as A


@dataclass(frozen=True)
class Request:
    """One path to resolve, and the name (if any) it binds."""

    parts: tuple[str, ...]
    base: int  # how many parts the statement's path has (items come after)
    statement: A.Import | A.FromImport
    span: Span  # the item, or the statement's path
    item: str | None = None  # the item's name (brace and `from` forms)
    alias: str | None = None
    alias_span: Span | None = None

    @property
    def bound_name(self) -> str | None:
        return self.alias or self.item


def requests(program: A.Program, source: SourceFile) -> tuple[list[Request], list[Diagnostic]]:
    found, problems = [], []
    for statement in program.items:
        if isinstance(statement, A.Import) and statement.names is None:
            alias_span = _tail(source, statement.span, statement.alias)
            found.append(Request(statement.path, len(statement.path), statement,
                                 _path_span(source, statement), None, statement.alias,
                                 alias_span))
        elif isinstance(statement, (A.Import, A.FromImport)):
            if getattr(statement, "alias", None):
                problems.append(messages.alias_with_braces(statement.span))
            found += [_item_request(statement, item, source) for item in statement.names]
    return found, problems


def _item_request(statement, item: A.ImportItem, source: SourceFile) -> Request:
    name_span = source.span(item.span.start, item.span.start + len(item.name))
    return Request(statement.path + (item.name,), len(statement.path), statement,
                   name_span, item.name, item.alias, _tail(source, item.span, item.alias))


def _path_span(source: SourceFile, statement: A.Import) -> Span:
    """The dotted path alone (`a.b` of `import a.b as X`), when written without spaces."""
    dotted = ".".join(statement.path)
    start = statement.span.start
    if statement.alias and source.text[start:start + len(dotted)] == dotted:
        return source.span(start, start + len(dotted))
    return statement.span


def _tail(source: SourceFile, span: Span, alias: str | None) -> Span | None:
    """The span of the alias, which ends the statement or item."""
    return source.span(span.end - len(alias), span.end) if alias else None


def segment_span(source: SourceFile, request: Request, index: int) -> Span:
    """The span of path segment `index` (items have their own span)."""
    if index >= request.base:
        return request.span
    position = request.statement.span.start
    for number, part in enumerate(request.parts[:request.base]):
        start = source.text.find(part, position)
        if start < 0:
            return request.statement.span
        if number == index:
            return source.span(start, start + len(part))
        position = start + len(part)
    return request.statement.span


class ScopeBuilder:
    """Adds each resolved request's names to a scope, reporting E023, E024 and W002."""

    def __init__(self, scope: Scope, diagnostics: list[Diagnostic]) -> None:
        self.scope = scope
        self.diagnostics = diagnostics

    def add(self, request: Request, kind: str, bindings: list[Binding], module: str) -> None:
        """`kind` is what the path named: "declaration" (one binding) or "file"/"folder"."""
        if kind == "declaration":
            self._add_declaration(request, bindings[0], module)
        elif request.bound_name:
            self._add_prefix(request, bindings, module)
        else:
            self._add_whole_module(request, bindings)

    def _add_declaration(self, request: Request, binding: Binding, module: str) -> None:
        name = request.bound_name or request.parts[-1]
        entry = Entry(_renamed(binding, name), request.span, module, request.alias_span)
        self._bind(name, entry, self.scope.explicit)
        if request.item is None and request.alias is None:
            self._qualify(request.parts[:-1], [entry])

    def _add_prefix(self, request: Request, bindings: list[Binding], module: str) -> None:
        name = request.bound_name
        target = ("module",) + tuple(sorted({b.file for b in bindings}))
        if self._bind(name, Entry(None, request.span, module, request.alias_span, target),
                      self.scope.prefixes):
            self._qualify((name,), [Entry(b, request.span, b.module_path) for b in bindings])

    def _add_whole_module(self, request: Request, bindings: list[Binding]) -> None:
        entries = [Entry(b, request.span, b.module_path) for b in bindings]
        for entry in entries:
            self.scope.wildcard.setdefault(entry.binding.name, []).append(entry)
        self._qualify(request.parts, entries)

    def _qualify(self, prefix: tuple[str, ...], entries: list[Entry]) -> None:
        names = self.scope.qualified.setdefault(prefix, {})
        for entry in entries:
            names.setdefault(entry.binding.name, []).append(entry)

    def _bind(self, name: str, entry: Entry, table: dict[str, Entry]) -> bool:
        """Record an explicit name (or module prefix); False when a conflict was reported."""
        local = self.scope.locals.get(name)
        if local is not None and entry.alias_span is not None:
            what = f"the declaration `{name}` of this file"
            return self._report(messages.alias_shadows(name, entry.alias_span,
                                                       local.decl.name_span, what))
        if local is not None and entry.binding.decl is not local.decl:  # not a self-import
            self.diagnostics.append(messages.local_shadows_import(
                name, local.decl.name_span, entry.span, entry.module))
        existing = self.scope.explicit.get(name) or self.scope.prefixes.get(name)
        if existing is not None:
            return existing.key == entry.key or self._conflict(name, existing, entry)
        table[name] = entry
        return True

    def _conflict(self, name: str, first: Entry, second: Entry) -> bool:
        if second.alias_span is not None or first.alias_span is not None:
            alias, other = (second, first) if second.alias_span is not None else (first, second)
            what = f"`{name}` imported from `{other.module}`"
            return self._report(messages.alias_shadows(name, alias.alias_span, other.span, what))
        return self._report(messages.imported_twice(name, second.span, first.span,
                                                    second.module, first.module))

    def _report(self, diagnostic: Diagnostic) -> bool:
        self.diagnostics.append(diagnostic)
        return False

    def finish(self, primitives_folder: Path, file: Path) -> None:
        """Checks that need every import: aliases against whole-module names, W002, W001."""
        for name, entry in [*self.scope.explicit.items(), *self.scope.prefixes.items()]:
            others = [e for e in self.scope.wildcard.get(name, []) if e.key != entry.key]
            if entry.alias_span is not None and others:
                what = f"`{name}` imported from `{others[0].module}`"
                self._report(messages.alias_shadows(name, entry.alias_span, others[0].span, what))
        for name, local in self.scope.locals.items():
            entry = self.scope.wildcard.get(name, [None])[0]
            if entry and name not in self.scope.explicit and entry.binding.decl is not local.decl:
                self.diagnostics.append(messages.local_shadows_import(
                    name, local.decl.name_span, entry.span, entry.module))
            primitive = self.scope.prelude.get(name)
            if primitive is not None and file.parent != primitives_folder:
                self.diagnostics.append(messages.shadows_primitive(
                    name, local.decl.name_span, primitive.module_path))

    def mark_failed(self, request: Request) -> None:
        """Names the failed request would have bound: later passes stay quiet about them."""
        name = request.bound_name
        if name:
            self.scope.failed_names.add(name)
            self.scope.failed_prefixes.add((name,))
            return
        self.scope.failed_names.add(request.parts[-1])
        self.scope.failed_prefixes.update({request.parts, request.parts[:-1]})
        self.scope.incomplete = True


def _renamed(binding: Binding, name: str) -> Binding:
    if binding.name == name:
        return binding
    return Binding(name, binding.decl, binding.file, binding.module_path, binding.version,
                   binding.kind, binding.origin)
