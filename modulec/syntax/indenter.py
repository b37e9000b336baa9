"""Indentation postlexer: turns newlines into _NL / _INDENT / _DEDENT with Python's rules.

Beyond Python's rules it knows the DSL's continuation lines, which the specification uses
freely:

- a line starting with `->` continues the previous statement, whatever its indentation;
- a line starting with `@`, indented deeper than the statement, carries more annotations
  for it (`-> out` then `@hook(...)` on the next line);
- newlines inside brackets never count.

It also turns a `-` that starts a line into DASH (a list item), and records the problems
it can see better than the parser can: tabs in indentation, a dedent to a level never
opened, brackets that never close.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lark import Token
from lark.lark import PostLex

OPENING = {"LPAR": ")", "LSQB": "]", "LBRACE": "}"}
CLOSING = {"RPAR": "(", "RSQB": "[", "RBRACE": "{"}
BRACKETS = {*OPENING, *CLOSING}
LINE_START = {None, "_NL", "_INDENT", "_DEDENT"}


@dataclass(frozen=True)
class LayoutProblem:
    """Something wrong with the layout of the text, found while lexing."""

    kind: str  # "tab" | "dedent" | "unclosed" | "unopened"
    offset: int
    end: int
    detail: str = ""


class DedentError(Exception):
    """A dedent to a column that matches no enclosing block: parsing cannot continue."""

    def __init__(self, problem: LayoutProblem):
        super().__init__(problem.detail)
        self.problem = problem


class Indenter(PostLex):
    always_accept = ("_NL",)

    def __init__(self) -> None:
        self.text = ""
        self.problems: list[LayoutProblem] = []
        self.open_brackets: list[Token] = []
        self.recent: deque[Token] = deque(maxlen=4)  # last tokens handed to the parser

    def start(self, text: str) -> None:
        """Prepare for one parse of `text` (the postlexer needs to look ahead in it)."""
        self.text = text
        self.problems = []
        self.open_brackets = []
        self.recent = deque(maxlen=4)

    def process(self, stream):
        levels = [0]
        previous = None
        for token in stream:
            kind = token.type
            if kind == "_NL":
                if self._continues(token, previous, levels[-1]):
                    continue
                yield from self._newline(token, levels)
                previous = "_NL"
                continue
            if kind == "ADD_OP" and token.value == "-" and previous in LINE_START:
                token = Token.new_borrow_pos("DASH", "-", token)
            elif kind in BRACKETS:
                self._track_bracket(token)
            self.recent.append(token)
            yield token
            previous = token.type
        while len(levels) > 1:
            levels.pop()
            end = len(self.text)
            yield Token("_DEDENT", "", end, 0, 0, 0, 0, end)

    # ------------------------------------------------------------ continuation lines
    def _continues(self, newline: Token, previous: str | None, level: int) -> bool:
        if self.open_brackets:
            return True
        rest = self.text[newline.end_pos:newline.end_pos + 2]
        if rest.startswith("->"):
            return True
        return rest.startswith("@") and self._indent_width(newline) > level

    # ------------------------------------------------------------ indentation
    def _newline(self, newline: Token, levels: list[int]):
        width = self._indent_width(newline)
        if width > levels[-1]:
            levels.append(width)
            yield self._remembered(Token.new_borrow_pos("_BLOCK_NL", newline.value, newline))
            yield self._layout_token("_INDENT", newline)
            return
        yield self._remembered(newline)
        while width < levels[-1]:
            levels.pop()
            yield self._layout_token("_DEDENT", newline)
        if width != levels[-1]:
            start = newline.end_pos - width
            detail = f"{width} (open blocks are at {', '.join(map(str, levels))})"
            raise DedentError(LayoutProblem("dedent", start, newline.end_pos, detail))

    def _layout_token(self, kind: str, newline: Token) -> Token:
        """An INDENT/DEDENT placed at the first character of the line it starts."""
        token = Token(kind, "", newline.end_pos, newline.end_line, newline.end_column,
                      newline.end_line, newline.end_column, newline.end_pos)
        self._remember(token)
        return token

    def _remember(self, token: Token) -> None:
        self.recent.append(token)

    def _remembered(self, token: Token) -> Token:
        self._remember(token)
        return token

    def _indent_width(self, newline: Token) -> int:
        if newline.end_pos >= len(self.text):
            return 0  # end of file: close every block
        last_line = newline.value.rsplit("\n", 1)[-1]
        if "#" in last_line:
            return 0
        if "\t" in last_line:
            start = newline.end_pos - len(last_line)
            self.problems.append(LayoutProblem("tab", start, newline.end_pos))
        return len(last_line.expandtabs(8))

    # ------------------------------------------------------------ brackets
    def _track_bracket(self, token: Token) -> None:
        if token.type in OPENING:
            self.open_brackets.append(token)
        elif token.type in CLOSING:
            if self.open_brackets:
                self.open_brackets.pop()
            else:
                self.problems.append(
                    LayoutProblem("unopened", token.start_pos, token.end_pos, token.value))
