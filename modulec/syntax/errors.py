"""E001: syntax errors a person understands.

A curated catalog recognizes the common mistakes (missing destination after `->`, missing
`:`, an unclosed bracket, an indentation problem, a misspelled keyword, the specification's
`...` placeholders); anything else falls back to "expected one of ...". Each recognizer
returns a `SyntaxProblem`: the diagnostic and the line the recovery should patch out.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from modulec.diagnostics import Diagnostic, Label, error
from modulec.source import SourceFile, Span
from modulec.syntax.indenter import LayoutProblem

DECLARATION_KEYWORDS = ("module", "abstract", "block", "model", "primitive", "recipe",
                        "import", "from")

READABLE = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "DOCSTRING": "a docstring",
    "_NL": "end of line", "_BLOCK_NL": "an indented block", "_INDENT": "an indented block", "_DEDENT": "end of block",
    "$END": "end of file", "COLON": "`:`", "COMMA": "`,`", "EQUAL": "`=`", "_ARROW": "`->`",
    "LPAR": "`(`", "RPAR": "`)`", "LSQB": "`[`", "RSQB": "`]`", "LBRACE": "`{`",
    "RBRACE": "`}`", "AT": "`@`", "_DOT": "`.`", "QMARK": "`?`", "STAR": "`*`",
    "ADD_OP": "`+` or `-`", "MUL_OP": "an operator", "COMP_OP": "a comparison",
    "POW_OP": "`**`", "IMPL_TEXT": "a kernel reference", "DASH": "`-`", "ELLIPSIS": "`...`",
}
# Tokens that say nothing useful in an "expected one of" list.
NOISE = {"OR", "OROR", "AND", "ANDAND", "X", "TIMES", "MUL_OP", "POW_OP", "COMP_OP", "STAR",
         "ADD_OP", "QMARK", "_DOT", "LSQB", "LPAR", "IF", "AT", "NOT", "BANG", "ELLIPSIS",
         "LBRACE", "TRUE", "FALSE", "NONE", "ARRAY", "DOCSTRING"}
EXPRESSION_START = {"NAME", "NUMBER", "STRING"}
LINE_STARTS = ("_NL", "_BLOCK_NL", "_INDENT", "_DEDENT")


@dataclass(frozen=True)
class SyntaxProblem:
    diagnostic: Diagnostic
    patch_line: int  # 1-based line the recovery replaces; 0 when nothing can be patched


def describe(exc: Exception, source: SourceFile, open_brackets: list[Token],
             recent: list[Token]) -> SyntaxProblem:
    """The E001 diagnostic for a parse failure, from the most specific recognizer that fits."""
    for recognize in (_placeholder, _unclosed_bracket, _unmatched_closer, _missing_destination,
                      _missing_colon, _bare_header, _unexpected_indent, _unknown_declaration,
                      _bad_character):
        problem = recognize(exc, source, open_brackets, recent)
        if problem is not None:
            return problem
    return _expected_one_of(exc, source, inside_brackets=bool(open_brackets))


def layout_problem(problem: LayoutProblem, source: SourceFile) -> SyntaxProblem:
    """Diagnostics for what the postlexer found: tabs, bad dedents, unmatched closers."""
    span = source.span(problem.offset, problem.end)
    if problem.kind == "tab":
        d = error("E001", "tab character in indentation", span, "indented with a tab",
                  help=["indent with spaces (two per level is the convention)"])
        return SyntaxProblem(d, 0)
    if problem.kind == "dedent":
        d = error("E001", "unindent does not match any outer indentation level", span,
                  f"this line is indented by {problem.detail}",
                  help=["indent it to the level of the block it belongs to"])
        return SyntaxProblem(d, span.line)
    d = error("E001", f"unmatched `{problem.detail}`", span, "nothing to close here",
              help=[f"remove this `{problem.detail}` or add its opening bracket"])
    return SyntaxProblem(d, span.line)


# ====================================================================== recognizers
def _unclosed_bracket(exc, source, open_brackets, recent):
    if not open_brackets:
        return None
    bracket = open_brackets[-1]
    where = _error_offset(exc, source)
    arrow_inside = "->" in source.text[max(where - 1, 0):where + 2]
    same_line = source.position(where)[0] == bracket.line
    if same_line and not arrow_inside and _token_type(exc) != "$END":
        return None
    closer = {"(": ")", "[": "]", "{": "}"}[bracket.value]
    span = source.span(bracket.start_pos, bracket.end_pos)
    d = error("E001", f"unclosed `{bracket.value}`", span, f"this `{bracket.value}` is never closed",
              help=[f"add `{closer}` where the expression ends"],
              secondary=[Label(_error_span(exc, source), "the parser was still inside it here")])
    return SyntaxProblem(d, bracket.line)


def _placeholder(exc, source, open_brackets, recent):
    where = _error_offset(exc, source)
    window_start = max(where - 3, 0)
    found = source.text.find("...", window_start, where + 3)
    if found < 0:
        return None
    span = source.span(found, found + 3)
    d = error("E001", "`...` is a placeholder, not syntax", span, "write out what goes here",
              notes=["the specification's examples use `...` for text they leave out; "
                     "`...` is only valid inside an index (`x[..., -1]`)"])
    return SyntaxProblem(d, span.line)


def _unmatched_closer(exc, source, open_brackets, recent):
    token = _token(exc)
    if token is None or token.type not in ("RPAR", "RSQB", "RBRACE") or open_brackets:
        return None
    span = source.span(token.start_pos, token.end_pos)
    d = error("E001", f"unmatched `{token.value}`", span, "nothing to close here",
              help=[f"remove this `{token.value}` or add its opening bracket"])
    return SyntaxProblem(d, span.line)


def _bare_header(exc, source, open_brackets, recent):
    """`forward` followed by an indented block: the header lacks its `:`."""
    if not isinstance(exc, UnexpectedToken) or exc.token.type != "_BLOCK_NL" or len(recent) < 2:
        return None
    name = recent[-2]
    line_start = len(recent) < 3 or recent[-3].type in LINE_STARTS
    if name.type != "NAME" or not line_start:
        return None
    return _colon_after(name, source)


def _missing_destination(exc, source, open_brackets, recent):
    if not isinstance(exc, UnexpectedToken) or exc.token.type not in ("_NL", "_BLOCK_NL", "$END",
                                                                       "_DEDENT"):
        return None
    previous = recent[-2] if len(recent) >= 2 else None
    if previous is None or previous.type != "_ARROW":
        return None
    span = source.span(previous.start_pos, previous.end_pos)
    d = error("E001", "missing destination after `->`", span, "this arrow leads nowhere",
              help=["name the tensor that receives the result: `... -> y`"],
              notes=["to continue a flow on the next line, start that line with `->`"])
    return SyntaxProblem(d, span.line)


def _missing_colon(exc, source, open_brackets, recent):
    if not isinstance(exc, UnexpectedToken) or "COLON" not in exc.expected:
        return None
    if exc.token.type not in ("_NL", "_BLOCK_NL", "$END"):
        return None
    before = recent[-2] if len(recent) >= 2 else None
    if before is None or before.type in LINE_STARTS:
        return None
    return _colon_after(before, source)


def _colon_after(token: Token, source: SourceFile) -> SyntaxProblem:
    span = source.span(token.end_pos, token.end_pos)
    d = error("E001", f"expected `:` after `{token.value}`", span, "add `:` here",
              help=["a line that opens a block (a declaration, a section, `if`, `else`) ends with `:`"])
    return SyntaxProblem(d, span.line)


def _unexpected_indent(exc, source, open_brackets, recent):
    if not isinstance(exc, UnexpectedToken) or exc.token.type != "_BLOCK_NL":
        return None
    line = exc.token.end_line
    text = source.line_text(line)
    start = exc.token.end_pos - (exc.token.end_column - 1)
    span = source.span(start, start + len(text) - len(text.lstrip()))
    d = error("E001", "unexpected indentation", span, "this line is indented deeper",
              help=["only a line ending with `:` opens an indented block; to continue a flow "
                    "on the next line, start that line with `->`"])
    return SyntaxProblem(d, line)


def _unknown_declaration(exc, source, open_brackets, recent):
    token = _token(exc)
    if token is None or token.type != "NAME" or token.column != 1:
        return None
    if not isinstance(exc, UnexpectedToken) or "MODULE" not in exc.expected:
        return None
    span = source.span(token.start_pos, token.end_pos)
    guess = difflib.get_close_matches(token.value, DECLARATION_KEYWORDS, n=1, cutoff=0.6)
    helps = [f"did you mean `{guess[0]}`?"] if guess else \
        ["a file holds imports and declarations: module, block, model, primitive, recipe"]
    d = error("E001", f"expected a declaration, found `{token.value}`", span,
              "not a declaration keyword", help=helps)
    return SyntaxProblem(d, token.line)


def _bad_character(exc, source, open_brackets, recent):
    # With no terminal matching in the parser's state, the lexer's fallback often matches
    # IMPL_TEXT (free text): that too means "this character starts nothing valid here".
    if isinstance(exc, UnexpectedCharacters):
        where = exc.pos_in_stream
    elif _token_type(exc) == "IMPL_TEXT" and "IMPL_TEXT" not in exc.expected:
        where = exc.token.start_pos
    else:
        return None
    char = source.text[where] if where < len(source.text) else ""
    span = source.span(where, where + 1)
    if char == ">" and source.text[where - 1:where] == "-":
        d = error("E001", "unexpected `->`", source.span(where - 1, where + 1),
                  "expected an operation or a tensor name before this arrow",
                  help=["each `->` leads to an operation (`relu()`), a module, or the "
                        "destination tensor"])
    elif char == '"':
        d = error("E001", "unterminated string", span, "this string never ends",
                  help=['close it with `"` on the same line; use `"""` for text over several lines'])
    elif char == "'":
        d = error("E001", "unexpected character `'`", span, "single quotes do not make a string",
                  help=['strings use double quotes: "text"'])
    else:
        allowed = getattr(exc, "allowed", None) or getattr(exc, "expected", None)
        d = error("E001", f"unexpected `{char}`", span, "not valid here",
                  notes=[_expected_note(allowed)] if allowed else [])
    return SyntaxProblem(d, span.line)


def _expected_one_of(exc, source, inside_brackets: bool):
    token = _token(exc)
    found = _found_text(token)
    span = _error_span(exc, source)
    expected = set(getattr(exc, "expected", None) or ())
    if inside_brackets:  # newlines are continuation inside brackets: never "expected"
        expected -= {"_NL", "_BLOCK_NL"}
    d = error("E001", f"unexpected {found}", span, "unexpected here",
              notes=[_expected_note(expected)] if expected else [])
    return SyntaxProblem(d, span.line)


# ====================================================================== helpers
def _token(exc) -> Token | None:
    return getattr(exc, "token", None)


def _token_type(exc) -> str | None:
    token = _token(exc)
    return token.type if token is not None else None


def _error_offset(exc: UnexpectedInput, source: SourceFile) -> int:
    token = _token(exc)
    if token is not None and token.start_pos is not None:
        return min(token.start_pos, len(source.text))
    return min(getattr(exc, "pos_in_stream", None) or len(source.text), len(source.text))


def _error_span(exc, source: SourceFile) -> Span:
    token = _token(exc)
    start = _error_offset(exc, source)
    width = len(token.value) if token is not None and token.type not in LINE_STARTS else 0
    return source.span(start, start + max(width, 0))


def _found_text(token: Token | None) -> str:
    if token is None or token.type == "$END":
        return "end of file"
    if token.type in LINE_STARTS:
        return READABLE[token.type]
    return f"`{token.value}`"


def _expected_note(expected) -> str:
    expected = set(expected)
    if EXPRESSION_START <= expected:
        expected = (expected - EXPRESSION_START) | {"an expression"}
    names = sorted({_readable(name) for name in expected if name not in NOISE})
    if not names:
        names = sorted({_readable(name) for name in expected})
    return "expected " + (names[0] if len(names) == 1 else "one of " + ", ".join(names[:12]))


def _readable(name: str) -> str:
    if name in READABLE:
        return READABLE[name]
    return f"`{name.lower()}`" if name.isupper() and not name.startswith("_") else name
