"""Dimensions read back from their text (`str(Dim)`), as IR documents store them.

`4096`, `B`, `2*d_ff`, `B*T + 1`, `(d_model // num_heads)`, `min(T, 4096)`: integers,
names, `+ - * // %`, parentheses and the intrinsics of `modulec.types.dims`. A small
recursive-descent parser (no `eval`): a hand-edited IR gets a `ValueError` that says what
is wrong, never code run.
"""

from __future__ import annotations

import re
from functools import lru_cache

from modulec.types.dims import _INTRINSICS, Dim, intrinsic

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.]*)|(//|[-+*%(),]))")
MAX_TEXT = 400  # a dimension's text; longer is not something a build writes


@lru_cache(maxsize=8192)  # an IR repeats a few dims ("B", "T", "4096") thousands of times
def parse_dim(text: str) -> Dim:
    """The Dim whose text is `text`; ValueError when it is not one."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT:
        raise ValueError(f"`{text}` is not a dimension")
    parser = _Parser(_tokens(text), text)
    dim = parser.sum()
    if parser.peek() is not None:
        raise ValueError(f"`{text}` is not a dimension (unexpected `{parser.peek()}`)")
    return dim


def _tokens(text: str) -> list:
    tokens, position = [], 0
    while position < len(text):
        if text[position:].strip() == "":
            break
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"`{text}` is not a dimension (at `{text[position:].strip()}`)")
        number, name, symbol = match.groups()
        tokens.append(int(number) if number is not None else name or symbol)
        position = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list, text: str):
        self.tokens, self.text, self.at = tokens, text, 0

    def peek(self):
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected=None):
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            wanted = f"`{expected}`" if expected else "more"
            raise ValueError(f"`{self.text}` is not a dimension (expected {wanted})")
        self.at += 1
        return token

    def sum(self) -> Dim:
        total = self.product()
        while self.peek() in ("+", "-"):
            total = total + self.product() if self.take() == "+" else total - self.product()
        return total

    def product(self) -> Dim:
        value = self.unary()
        while self.peek() in ("*", "//", "%"):
            operator, right = self.take(), self.unary()
            value = value * right if operator == "*" else \
                value // right if operator == "//" else value % right
        return value

    def unary(self) -> Dim:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        return self.atom()

    def atom(self) -> Dim:
        token = self.take()
        if isinstance(token, int):
            return Dim.const(token)
        if token == "(":
            inner = self.sum()
            self.take(")")
            return inner
        if isinstance(token, str) and (token[0].isalpha() or token[0] == "_"):
            if self.peek() == "(" and token in _INTRINSICS:
                return intrinsic(token, self.arguments())
            return Dim.sym(token)
        raise ValueError(f"`{self.text}` is not a dimension (unexpected `{token}`)")

    def arguments(self) -> list[Dim]:
        self.take("(")
        values = [self.sum()]
        while self.peek() == ",":
            self.take()
            values.append(self.sum())
        self.take(")")
        return values
