"""Operator precedence: groups the parser's flat `operand (op operand)*` sequences into trees.

Precedence follows Python (and Appendix A's ConstExpr grammar), lowest first:
`or`, `and`, `not` (prefix), comparisons (chained), `+ -`, `* / // %`, unary `- +`,
`**` (right-assoc; `-a ** b` is `-(a ** b)`), and the array operator `x` / `×`
(right-assoc, binds tightest: `[n] x T`). `||`, `&&` and `!` are accepted spellings of
`or`, `and` and `not`.
"""

from __future__ import annotations

from lark import Token

from modulec.syntax import ast as A
from modulec.syntax.depth import MAX_DEPTH

SPELLING = {"||": "or", "&&": "and", "!": "not", "×": "x"}

# operator -> (left binding power, right binding power); right-assoc when equal
INFIX = {
    "or": (1, 2), "and": (3, 4),
    "==": (7, 8), "!=": (7, 8), "<": (7, 8), ">": (7, 8), "<=": (7, 8), ">=": (7, 8),
    "+": (9, 10), "-": (9, 10),
    "*": (11, 12), "/": (11, 12), "//": (11, 12), "%": (11, 12),
    "**": (15, 14),
    "x": (17, 16),
}
PREFIX = {"not": 5, "-": 13, "+": 13}
COMPARISONS = {"==", "!=", "<", ">", "<=", ">="}


def spelling(token: Token) -> str:
    return SPELLING.get(token.value, token.value)


class TooDeep(Exception):
    """An expression whose operators nest deeper than the syntax-tree limit: the parser
    reports it as the depth limit's E001 (modulec.syntax.depth), at `span`."""

    def __init__(self, span):
        super().__init__("expression nested too deeply")
        self.span = span


def group(items: list, span_of) -> A.Expr:
    """Build the tree for `[prefix*, operand, (op, prefix*, operand)*]`."""
    expr, position = _parse(items, 0, 0, span_of)
    assert position == len(items)
    return expr


def _parse(items, position, min_power, span_of, depth=0):
    """Each nested call is one level of the tree it builds (a prefix operator's operand, a
    right operand): deeper than the tree limit is refused before Python's stack is."""
    if depth > MAX_DEPTH:
        raise TooDeep(span_of(items[position], items[position]))
    left, position = _operand(items, position, span_of, depth)
    while position < len(items):
        op = spelling(items[position])
        left_power, right_power = INFIX[op]
        if left_power < min_power:
            break
        if op in COMPARISONS:
            left, position = _chain(items, position, left, right_power, span_of, depth)
            continue
        right, position = _parse(items, position + 1, right_power, span_of, depth + 1)
        left = _combine(op, left, right, span_of)
    return left, position


def _chain(items, position, first, right_power, span_of, depth):
    """`a < b <= c`: one Compare with every link, as Python reads it."""
    rest = []
    while position < len(items) and spelling(items[position]) in COMPARISONS:
        op = spelling(items[position])
        right, position = _parse(items, position + 1, right_power, span_of, depth + 1)
        rest.append((op, right))
    return A.Compare(first, tuple(rest), span_of(first, rest[-1][1])), position


def _operand(items, position, span_of, depth):
    item = items[position]
    if not isinstance(item, Token):
        return item, position + 1
    op = spelling(item)
    operand, position = _parse(items, position + 1, PREFIX[op], span_of, depth + 1)
    return A.Unary(op, operand, span_of(item, operand)), position


def _combine(op, left, right, span_of):
    if op == "x":
        count = left.items[0] if isinstance(left, A.ListExpr) and len(left.items) == 1 else left
        return A.ArrayType(count, right, span_of(left, right))
    return A.Binary(op, left, right, span_of(left, right))
