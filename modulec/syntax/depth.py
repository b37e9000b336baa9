"""How deep a syntax tree nests, measured without recursion: a tree deeper than MAX_DEPTH
is an E001 at its deepest node (issue 16 item 5). Every later stage walks trees
recursively (evaluating constants, printing, lowering); bounding the depth here means no
RecursionError is reachable from a program, whatever those walkers do. No real program
comes near the bound: std's deepest tree is a few dozen levels."""

from __future__ import annotations

from modulec.diagnostics import Diagnostic, error
from modulec.syntax import ast as A

MAX_DEPTH = 128
SKIPPED = ("span", "name_span", "file")


def too_deep(program: A.Program | None) -> Diagnostic | None:
    """E001 at the first node found deeper than MAX_DEPTH, or None."""
    stack = [(program, 0, None)]
    while stack:
        node, depth, span = stack.pop()
        span = getattr(node, "span", None) or span
        if depth > MAX_DEPTH:
            return too_deep_at(span)
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
