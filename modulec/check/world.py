"""What every part of the checker shares: where diagnostics go, how a name finds its
declaration, the op table, and the cache of module instances."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Protocol

from modulec.diagnostics import Diagnostic, error, warning
from modulec.ops.registry import OpRule, op_table
from modulec.semantic.decls import ModuleDef, module_def
from modulec.source import Span
from modulec.syntax import ast as A
from modulec.types.dims import Dim

TOPOLOGY = {"tp_size": Dim.const(1)}  # the compile-time topology without `--tp` (§7.6.0)


class Names(Protocol):
    """Name resolution for one file (implemented by modulec.resolve)."""

    def declaration(self, name: str, span: Span | None) -> A.Decl | None: ...

    def candidates(self) -> list[str]: ...


@dataclass
class LocalNames:
    """The declarations of one file plus the primitives: resolution without imports."""

    decls: dict[str, A.Decl]

    def declaration(self, name: str, span: Span | None) -> A.Decl | None:
        return self.decls.get(name)

    def candidates(self) -> list[str]:
        return list(self.decls)


@dataclass
class World:
    """`names` resolves in the file being checked; `scopes` maps every other loaded file's
    name to its own names, so that a block declared elsewhere resolves its references in
    the file that wrote them."""

    names: Names
    scopes: dict[str, Names] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    instances: dict = field(default_factory=dict)
    _defs: dict[int, ModuleDef] = field(default_factory=dict)
    _seen: set = field(default_factory=set)
    quiet: int = 0  # >0 while checking an instance for its types only (see `report`)
    recording: bool = False  # lowering: record each instance's graph as Graph IR
    instantiating: list = field(default_factory=list)  # instances being made, innermost last
    # sizes a build fixes: the inputs' free dims (`--shape B=8`) and the topology's
    # `tp_size` (spec §7.6.0; `--tp`, 1 otherwise), which every module may read
    dims: dict = field(default_factory=lambda: dict(TOPOLOGY))
    function_names: dict = field(default_factory=dict)

    @property
    def ops(self) -> dict[str, OpRule]:
        return op_table()

    def definition(self, decl: A.Decl) -> ModuleDef:
        """The typed view of a declaration, with its base folded in when it `extends`."""
        key = id(decl)
        if key not in self._defs:
            from modulec.check.declarations import merge_extends

            self._defs[key] = module_def(decl)  # placed first: a cycle of `extends` stops here
            self._defs[key] = merge_extends(self, decl, self._defs[key])
        return self._defs[key]

    def names_at(self, span: Span | None) -> Names:
        """The names visible where `span` is written."""
        if span is None:
            return self.names
        return self.scopes.get(span.file, self.names)

    def lookup_decl(self, name: str, span: Span | None) -> A.Decl | None:
        return self.names_at(span).declaration(name, span)

    def candidates(self, span: Span | None) -> list[str]:
        return self.names_at(span).candidates()

    def already_reported(self, name: str, span: Span | None) -> bool:
        """A failed lookup the resolver has explained (ambiguous, failed import)."""
        check = getattr(self.names_at(span), "already_reported", None)
        return bool(check and check(name))

    # ------------------------------------------------------------ reporting
    def report(self, diagnostic: Diagnostic) -> None:
        """Add a diagnostic once per (code, message, span). While quiet (a called module
        instantiated at its caller's sizes, `hf_plan`) nothing is added: the module's own
        check reports its errors where written, and a failed constraint or a containment
        cycle is reported again at the call (unmuted, both were reported twice, and an
        error that has nothing to do with the sizes was named `in Inner(d=4)` when the
        caller came first). Errors that depend on the sizes go through `error_unmuted`."""
        if self.quiet:
            return
        key = (diagnostic.code, diagnostic.message, diagnostic.primary_span)
        if key not in self._seen:
            self._seen.add(key)
            self.diagnostics.append(diagnostic)

    def error(self, code: str, message: str, span, label: str = "", **more) -> None:
        self.report(error(code, message, span, label, **more))

    def error_unmuted(self, code: str, message: str, span, label: str = "", **more) -> None:
        """An error reported even while instantiating quietly: a size no tensor can have
        (a dim below 1 or past the limit) is wrong whoever called the module, and muted it
        left a parameter without a type for the lowering to trip over (exit 101). While
        quiet it names the instance whose sizes it was found at (`in Outer(d=4)`: its
        values come from a caller)."""
        notes = [f"in {self.instantiating[-1].describe()}"] \
            if self.quiet and self.instantiating and "notes" not in more else []
        notes += more.pop("notes", [])
        quiet, self.quiet = self.quiet, 0
        try:
            self.error(code, message, span, label, notes=notes, **more)
        finally:
            self.quiet = quiet

    def warn(self, code: str, message: str, span, label: str = "", **more) -> None:
        self.report(warning(code, message, span, label, **more))


# Python's spellings of the DSL's literals (spec §2.5: `true`, `false`, `None`)
PYTHON_LITERALS = {"True": "true", "False": "false", "none": "None", "null": "None",
                   "TRUE": "true", "FALSE": "false"}


def did_you_mean(name: str, candidates, n: int = 4) -> list[str]:
    """`did you mean` help naming up to `n` close candidates by edit distance; for a
    Python spelling of a literal, the DSL's."""
    if name in PYTHON_LITERALS:
        return [f"write `{PYTHON_LITERALS[name]}`: the DSL's literals are `true`, `false` "
                "and `None`"]
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.6)
    if not close:
        return []
    quoted = [f"`{c}`" for c in close]
    joined = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return [f"did you mean {joined}?"]
