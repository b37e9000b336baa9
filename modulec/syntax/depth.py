"""The limits a syntax tree must keep, checked without recursion right after parsing:

- how deep it nests: a tree deeper than MAX_DEPTH is an E001 at its deepest node (issue 16
  item 5). Every later stage walks trees recursively (evaluating constants, printing,
  lowering); bounding the depth here means no RecursionError is reachable from a program,
  whatever those walkers do. No real program comes near the bound: std's deepest tree is
  a few dozen levels.
- how long an integer literal is: one of more than MAX_DIGITS digits is an E001 at the
  literal. Python refuses to convert longer digit strings to an int (its 4300-digit
  guard against quadratic conversion), and every stage reads a literal's value."""

from __future__ import annotations

from modulec.diagnostics import Diagnostic, error
from modulec.syntax import ast as A

MAX_DEPTH = 128
MAX_DIGITS = 4000  # under Python's int conversion limit (sys.get_int_max_str_digits: 4300)
SKIPPED = ("span", "name_span", "file")


def beyond_limits(program: A.Program | None) -> Diagnostic | None:
    """E001 at the first node found deeper than MAX_DEPTH or the first integer literal
    longer than MAX_DIGITS, or None."""
    stack = [(program, 0, None)]
    while stack:
        node, depth, span = stack.pop()
        span = getattr(node, "span", None) or span
        if depth > MAX_DEPTH:
            return too_deep_at(span)
        if isinstance(node, A.Number) and _digits(node.text) > MAX_DIGITS:
            return too_long_at(node)
        if isinstance(node, (tuple, list)):
            stack.extend((child, depth, span) for child in node)
            continue
        fields = getattr(node, "__dataclass_fields__", None) or ()
        stack.extend((getattr(node, name), depth + 1, span) for name in fields
                     if name not in SKIPPED)
    return None


def too_deep_at(span) -> Diagnostic:
    return error("E001", f"this nests more than {MAX_DEPTH} levels deep", span,
                 help=[f"split the expression over `let:` bindings; modulec reads at most "
                       f"{MAX_DEPTH} levels"])


def _digits(text: str) -> int:
    """The digits of an integer literal (0 for a float: float() reads any length)."""
    return 0 if any(ch in text for ch in ".eE") else sum(ch.isdigit() for ch in text)


def too_long_at(node: A.Number) -> Diagnostic:
    digits = _digits(node.text)
    return error("E001", f"this integer literal has {digits:,} digits", node.span,
                 help=[f"modulec reads integer literals of up to {MAX_DIGITS:,} digits; "
                       "a size or count that large is a typo"])
