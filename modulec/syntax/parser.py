"""Parsing: text -> syntax tree (modulec.syntax.ast) or E001 diagnostics.

The LALR tables are built once and cached on disk, so `modulec check` starts fast. A file
with errors is parsed again declaration by declaration, and a broken line is patched out
and the declaration re-parsed, so that one mistake does not hide the next.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lark import Lark
from lark.exceptions import UnexpectedInput, VisitError

from modulec.diagnostics import Diagnostic
from modulec.paths import grammar_file
from modulec.source import SourceFile
from modulec.syntax import ast as A
from modulec.syntax.builder import Builder
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
        self.lark = Lark(text, postlex=self.indenter, transformer=self.builder,
                         cache=_cache_path(text), **lark_options())

    def parse_raw(self, text: str, file: str) -> A.Program:
        """Parse or raise (UnexpectedInput, DedentError); positions refer to `text`."""
        self.indenter.start(text)
        self.builder.file = file
        collecting = gc.isenabled()
        gc.disable()  # the tree is acyclic: collections during a parse only cost time
        try:
            return self.lark.parse(text)
        except VisitError as error:  # a builder callback failed: report the original
            raise error.orig_exc from None
        finally:
            if collecting:
                gc.enable()


def _cache_path(grammar_text: str) -> str:
    import lark

    key = hashlib.sha256((grammar_text + lark.__version__).encode()).hexdigest()[:16]
    folder = _cache_folder()
    return str(folder / f"grammar-{key}.lark-cache")


def _cache_folder() -> Path:
    """A writable folder for the LALR tables; never named `modulec`, which would shadow the
    package for `python -m modulec` run from the folder that holds it."""
    candidates = [os.environ.get("MODULEC_CACHE_DIR"),
                  Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "modulec-lalr",
                  Path(tempfile.gettempdir()) / "modulec-lalr-cache"]
    for candidate in filter(None, candidates):
        try:
            Path(candidate).mkdir(parents=True, exist_ok=True)
            return Path(candidate)
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="modulec-lalr-"))


def parser() -> Parser:
    global _PARSER
    if _PARSER is None:
        _PARSER = Parser()
    return _PARSER


def parse_source(source: SourceFile, cache: bool = False) -> ParseResult:
    """Parse one file: its syntax tree, or the E001 diagnostics that explain why not.

    With `cache`, the result is kept on disk keyed by the file's name and text and by the
    parser's own code (so a new modulec never reads an old tree): the standard library,
    read on every `modulec check`, is parsed once per machine.
    """
    if not cache:
        return _parse_source(source)
    key = _tree_key(source)
    if key in _MEMO:
        return _MEMO[key]
    path = _cache_folder() / "trees" / f"{key}.pickle"
    try:
        result = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError):
        result = _parse_source(source)
        _store(path, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    _MEMO[key] = result
    return result


_MEMO: dict[str, ParseResult] = {}  # this process's cached trees (std read by several passes)


def _tree_key(source: SourceFile) -> str:
    global _CODE_DIGEST
    if _CODE_DIGEST is None:
        here = Path(__file__).resolve().parent
        parts = [grammar_file().read_bytes()] + [
            (here / n).read_bytes() for n in ("ast.py", "builder.py", "parser.py",
                                              "precedence.py", "indenter.py", "recovery.py")]
        _CODE_DIGEST = hashlib.sha256(b"\0".join(parts)).hexdigest()
    text = f"{_CODE_DIGEST}\0{source.name}\0{source.text}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _store(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tree-")
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except OSError:
        pass  # a cache that cannot be written is only slower


_CODE_DIGEST: str | None = None


def _parse_source(source: SourceFile) -> ParseResult:
    text = source.text if source.text.endswith("\n") else source.text + "\n"
    p = parser()
    try:
        program = p.parse_raw(text, source.name)
    except (UnexpectedInput, DedentError):
        program, diagnostics = parse_with_recovery(p, source, text)
        return ParseResult(program, tuple(diagnostics))
    layout = [layout_problem(problem, source).diagnostic for problem in p.indenter.problems]
    return ParseResult(program, tuple(layout))


def parse_text(text: str, name: str = "<input>") -> ParseResult:
    return parse_source(SourceFile(name, text))


def parse_file(path: str | Path, cache: bool = False) -> ParseResult:
    return parse_source(SourceFile.read(path), cache)
