"""What a name means in one file: `Binding`s, and the `Scope` that looks names up.

Priority of an unqualified name: a declaration of the file itself, then a name imported
explicitly (`import a.C`, `{C}`, `from a import C`), then a name brought in by a whole-file
or whole-folder import, then the primitives (the prelude). Several whole-module imports that
bring in different declarations under one name are an E023, reported when the name is
looked up, not when it is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from modulec.diagnostics import Diagnostic
from modulec.resolve import messages
from modulec.source import Span
from modulec.syntax import ast as A


@dataclass(frozen=True)
class Binding:
    """A declaration under a name: `std.modules.attention` `GQA` (v1) from an import."""

    name: str
    decl: A.Decl
    file: Path
    module_path: str
    version: str | None  # "v1", or None for an unversioned file
    kind: str  # "primitive" | "module" | "block" | "model" | "recipe"
    origin: str  # "local" | "import" | "prelude"

    @property
    def key(self) -> tuple[Path, str]:
        """Identity of the declaration: the same one reached twice is no conflict."""
        return self.file, self.decl.name


@dataclass(frozen=True)
class Entry:
    """One import's contribution: a binding (None for a module prefix) and where it came from."""

    binding: Binding | None
    span: Span  # the import path or item that made it
    module: str  # module path, for messages
    alias_span: Span | None = None  # set when `as` chose the name
    target: tuple = ()  # identity of a module prefix's target

    @property
    def key(self) -> tuple:
        return self.binding.key if self.binding is not None else self.target


@dataclass
class Scope:
    """The names of one file. Lookups report E023 ambiguities into `diagnostics`."""

    diagnostics: list[Diagnostic]
    prelude: dict[str, Binding]
    locals: dict[str, Binding] = field(default_factory=dict)
    explicit: dict[str, Entry] = field(default_factory=dict)
    prefixes: dict[str, Entry] = field(default_factory=dict)  # `import a.b as M`: M
    wildcard: dict[str, list[Entry]] = field(default_factory=dict)
    qualified: dict[tuple[str, ...], dict[str, list[Entry]]] = field(default_factory=dict)
    failed_names: set[str] = field(default_factory=set)
    failed_prefixes: set[tuple[str, ...]] = field(default_factory=set)
    incomplete: bool = False  # a whole-module import failed: any name may be missing
    _reported: set[tuple[str, Span]] = field(default_factory=set)

    def lookup(self, name: str, span: Span) -> Binding | None:
        """The declaration `name` means here, or None (unknown, or ambiguous: E023 reported)."""
        if name in self.locals:
            return self.locals[name]
        if name in self.explicit:
            return self.explicit[name].binding
        if name in self.wildcard:
            return self._unique(name, self.wildcard[name], span)
        return self.prelude.get(name)

    def lookup_qualified(self, parts: tuple[str, ...], span: Span) -> Binding | None:
        """`M.Linear` or `std.modules.attention.GQA`: a name under an imported module prefix."""
        if len(parts) == 1:
            return self.lookup(parts[0], span)
        entries = self.qualified.get(parts[:-1], {}).get(parts[-1])
        return self._unique(".".join(parts), entries, span) if entries else None

    def unresolved_import(self, parts: tuple[str, ...]) -> bool:
        """True when `parts` may come from an import that failed (and was reported):
        callers should not report it again as undefined."""
        if len(parts) == 1 and (parts[0] in self.failed_names or self.incomplete):
            return True
        return any(parts[:k] in self.failed_prefixes for k in range(1, len(parts)))

    def visible_names(self) -> list[str]:
        """Every unqualified name, sorted (for "did you mean" in later passes)."""
        names = self.locals.keys() | self.explicit.keys() | self.wildcard.keys()
        return sorted(names | self.prelude.keys())

    # The checker's `Names` protocol (modulec.check.world), so a Scope can stand in for it.
    def declaration(self, name: str, span: Span | None) -> A.Decl | None:
        binding = self.lookup_qualified(tuple(name.split(".")), span)
        return binding.decl if binding is not None else None

    def candidates(self) -> list[str]:
        return self.visible_names()

    def already_reported(self, name: str) -> bool:
        """Whether a failed lookup of `name` was explained already (E023 ambiguity, or an
        import that failed): the checker must not add "undefined" on top."""
        return any(reported == name for reported, _ in self._reported) or \
            self.unresolved_import(tuple(name.split(".")))

    def _unique(self, name: str, entries: list[Entry], span: Span) -> Binding | None:
        first_of_each: dict[tuple, Entry] = {}
        for entry in entries:
            first_of_each.setdefault(entry.key, entry)
        distinct = list(first_of_each.values())
        if len(distinct) == 1:
            return distinct[0].binding
        if (name, span) not in self._reported:
            self._reported.add((name, span))
            sources = [(entry.span, entry.module) for entry in distinct]
            self.diagnostics.append(messages.ambiguous(name, span, sources))
        return None
