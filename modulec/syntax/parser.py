"""Parsing: text -> syntax tree (modulec.syntax.ast) or E001 diagnostics.

Nothing is cached on disk: a cache file that is unpickled can run code planted by whoever
can write the folder (issue 16 item 1), and building the tables (~0.25 s) plus parsing std
is cheap enough to do per process. A file
with errors is parsed again declaration by declaration, and a broken line is patched out
and the declaration re-parsed, so that one mistake does not hide the next.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lark.lexer
from lark import Lark
from lark.exceptions import UnexpectedInput, VisitError

from modulec.diagnostics import Diagnostic
from modulec.paths import grammar_file
from modulec.source import SourceFile
from modulec.syntax import ast as A
from modulec.syntax import lalr
from modulec.syntax.builder import Builder
from modulec.syntax.depth import beyond_limits, too_deep_at
from modulec.syntax.precedence import TooDeep
from modulec.syntax.indenter import DedentError, Indenter
from modulec.syntax.errors import layout_problem
from modulec.syntax.recovery import parse_with_recovery

_PARSER: "Parser | None" = None


@dataclass(frozen=True)
class ParseResult:
    program: A.Program | None
    diagnostics: tuple[Diagnostic, ...]

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def lark_options(strict: bool = False) -> dict:
    return dict(parser="lalr", lexer="contextual", start="start",
                maybe_placeholders=True, propagate_positions=False, strict=strict)


class Parser:
    """One LALR parser with its postlexer and builder (not thread-safe: one parse at a time)."""

    def __init__(self) -> None:
        text = grammar_file().read_text(encoding="utf-8")
        self.indenter = Indenter()
        self.builder = Builder()
        with _no_collision_check():
            self.lark = Lark(text, postlex=self.indenter, transformer=self.builder,
                             **lark_options())
        # Each reduce looks its goto up by the rule's name, which the grammar loader left a
        # lark Token (a str subclass with its own __eq__): every lookup called Token.__eq__
        # against the table's plain-str keys (a million calls in the fuzz run). The same
        # text as a plain str finds the same entries.
        for rule in self.lark.rules:
            rule.origin.name = str(rule.origin.name)

    def parse_raw(self, text: str, file: str) -> A.Program:
        """Parse or raise (UnexpectedInput, DedentError); positions refer to `text`."""
        self.indenter.start(text)
        self.builder.file = file
        collecting = gc.isenabled()
        gc.disable()  # the tree is acyclic: collections during a parse only cost time
        try:
            return lalr.parse(self.lark, text)  # Lark.parse, the per-token calls folded in
        except VisitError as error:  # a builder callback failed: report the original
            raise error.orig_exc from None
        finally:
            if collecting:
                gc.enable()


@contextmanager
def _no_collision_check():
    """Build the lexers without lark's regex-collision check. Where interegular is
    installed, lark compares every pair of terminals of every contextual lexer; outside
    strict mode a collision is only logged, never an error, so the tables are the same
    with or without it, and the check was ~0.3 s of every process's ~0.5 s parser build
    (each CLI call, each gloo rank). tests/test_grammar.py builds the grammar in strict
    mode, where a collision is an error."""
    checked = lark.lexer.has_interegular
    lark.lexer.has_interegular = False
    try:
        yield
    finally:
        lark.lexer.has_interegular = checked


def parser() -> Parser:
    global _PARSER
    if _PARSER is None:
        _PARSER = Parser()
    return _PARSER


def parse_source(source: SourceFile, cache: bool = False) -> ParseResult:
    """Parse one file: its syntax tree, or the E001 diagnostics that explain why not.

    With `cache`, the result is kept in this process only (std is read by several passes);
    never on disk, so no file another user can write is ever loaded as a tree. Without it,
    the last RECENT results are kept, by name and text: `build` after `check` in one
    process (the LSP, the tests' in-process CLI) reads the same file again, and the
    result is a function of the two (the trees and diagnostics are immutable).
    """
    key = (source.name, source.text)
    if cache:
        if key not in _MEMO:
            _MEMO[key] = _parse_source(source)
        return _MEMO[key]
    result = _RECENT.pop(key, None)
    if result is None:
        result = _parse_source(source)
        if len(_RECENT) >= RECENT:
            del _RECENT[next(iter(_RECENT))]  # the least recently used
    _RECENT[key] = result
    return result


_MEMO: dict[tuple[str, str], ParseResult] = {}  # this process's parsed std files
RECENT = 8
_RECENT: dict[tuple[str, str], ParseResult] = {}  # the last files parsed, oldest first


def _parse_source(source: SourceFile) -> ParseResult:
    try:
        return _parse_checked(source)
    except TooDeep as exc:  # an operator chain deeper than the tree limit (precedence.py)
        return ParseResult(None, (too_deep_at(exc.span),))


def _parse_checked(source: SourceFile) -> ParseResult:
    text = source.text if source.text.endswith("\n") else source.text + "\n"
    p = parser()
    try:
        program = p.parse_raw(text, source.name)
    except (UnexpectedInput, DedentError) as failure:
        program, diagnostics = parse_with_recovery(p, source, text, failure)
        deep = beyond_limits(program)  # what recovery kept is walked recursively too
        if deep is not None:
            return ParseResult(None, tuple(diagnostics) + (deep,))
        return ParseResult(program, tuple(diagnostics))
    layout = [layout_problem(problem, source).diagnostic for problem in p.indenter.problems]
    deep = beyond_limits(program)  # later stages walk trees recursively: bound the depth here
    if deep is not None:
        return ParseResult(None, tuple(layout) + (deep,))
    return ParseResult(program, tuple(layout))


def parse_text(text: str, name: str = "<input>") -> ParseResult:
    return parse_source(SourceFile(name, text))


def parse_file(path: str | Path, cache: bool = False) -> ParseResult:
    return parse_source(SourceFile.read(path), cache)
