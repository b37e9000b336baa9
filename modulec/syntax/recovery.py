"""Error recovery: report several syntax errors per file.

When a file fails to parse, it is cut into top-level chunks (an import, a declaration) and
each chunk is parsed on its own, with the text before it blanked so that positions stay
exact. Inside a chunk, the logical line an error points at is replaced by a placeholder
item (`__error__` or `__error__:` when an indented block follows) and the chunk is parsed
again, up to a limit. Placeholders are removed from the tree that comes back.
"""

from __future__ import annotations

import re
from dataclasses import replace

from lark.exceptions import UnexpectedInput

from modulec.source import SourceFile, Span
from modulec.syntax import ast as A
from modulec.syntax.depth import beyond_limits
from modulec.syntax.errors import SyntaxProblem, describe, layout_problem
from modulec.syntax.indenter import DedentError

PLACEHOLDER = "__error__"
MAX_ERRORS_PER_CHUNK = 8
_TOP_LEVEL_START = re.compile(r"[A-Za-z_\"@]")


def parse_with_recovery(parser, source: SourceFile, text: str,
                        failure: Exception | None = None):
    """(program with what could be parsed, diagnostics) for a file that has errors.

    `failure`: what parsing all of `text` just raised (the parser's indenter still holds
    that parse's state). A file of one chunk (no imports, one declaration: 265 of the
    first 600 fuzz programs' 367 broken files) starts with exactly that parse of exactly
    that text, so its first attempt takes the error as it is: a second parse up to the
    same token was 7% of the fuzz run's parsing, and 0.4 s for a line of 20,000 repeated
    tokens."""
    items, problems = [], []
    for start, end in top_level_chunks(text):
        whole = failure if start == 0 and end == len(text) else None
        chunk_items, chunk_problems = _parse_chunk(parser, source, text, start, end, whole)
        items.extend(chunk_items)
        problems.extend(chunk_problems)
    diagnostics = _unique([p.diagnostic for p in problems])
    return A.Program(tuple(items), file=source.name), diagnostics


def top_level_chunks(text: str) -> list[tuple[int, int]]:
    """Offsets of the top-level constructs: lines at column 0 outside docstrings."""
    starts, offset, in_docstring = [], 0, False
    for line in text.splitlines(keepends=True):
        if not in_docstring and _TOP_LEVEL_START.match(line):
            starts.append(offset)
        if line.count('"""') % 2 == 1:
            in_docstring = not in_docstring
        offset += len(line)
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return list(zip(starts, starts[1:] + [len(text)]))


def _parse_chunk(parser, source, text, start, end, failure=None):
    prefix = re.sub(r"[^\n]", " ", text[:start])
    chunk = text[start:end]
    problems: list[SyntaxProblem] = []
    patched_lines: set[int] = set()
    for _ in range(MAX_ERRORS_PER_CHUNK):
        attempt = prefix + chunk
        seen = SourceFile(source.name, attempt)
        try:
            if failure is not None:  # `attempt` is the text whose parse raised it
                failure, raised = None, failure
                raise raised
            program = parser.parse_raw(attempt, source.name)
        except DedentError as exc:
            problem = layout_problem(exc.problem, seen)
        except UnexpectedInput as exc:
            ind = parser.indenter
            problem = describe(exc, seen, ind.open_brackets, ind.recent)
        else:
            problems += [_respan(layout_problem(p, seen), source) for p in parser.indenter.problems]
            items = _without_placeholders(program.items)
            deep = beyond_limits(items)  # respan_tree below recurses: bound the depth first
            if deep is not None:
                return [], problems + [SyntaxProblem(deep, 0)]
            if patched_lines:  # offsets after a patched line are the patched text's
                items = [respan_tree(item, source) for item in items]
            return items, problems
        if PLACEHOLDER not in problem.diagnostic.message:  # about our own patch: not the user's
            problems.append(_respan(problem, source))
        line = problem.patch_line
        if line == 0 or line in patched_lines:
            break
        patched_lines.add(line)
        chunk = patch_line(prefix + chunk, line)[len(prefix):]
    return [], problems


def patch_line(text: str, line: int) -> str:
    """Replace the logical line starting at 1-based `line` by a placeholder item."""
    lines = text.split("\n")
    index = line - 1
    if index >= len(lines):
        return text
    last = _logical_line_end(lines, index)
    indent = _indent(lines[index])
    opens_block = last + 1 < len(lines) and _next_is_deeper(lines, last + 1, indent)
    lines[index] = " " * indent + _placeholder_text(indent, opens_block)
    for other in range(index + 1, last + 1):
        lines[other] = ""
    return "\n".join(lines)


def _placeholder_text(indent: int, opens_block: bool) -> str:
    if indent == 0:  # top level holds declarations and imports only
        return f"module {PLACEHOLDER}():" if opens_block else f"import {PLACEHOLDER}"
    return PLACEHOLDER + (":" if opens_block else "")


def _logical_line_end(lines: list[str], index: int) -> int:
    """The last physical line of the statement starting at `index` (brackets balanced)."""
    depth = 0
    for current in range(index, len(lines)):
        depth += _bracket_balance(lines[current])
        if depth <= 0:
            return current
    return index  # never closed: patch only the first line


def _bracket_balance(line: str) -> int:
    code = re.sub(r'"[^"\n]*"', "", line).split("#", 1)[0]
    return sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _next_is_deeper(lines: list[str], start: int, indent: int) -> bool:
    for line in lines[start:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return _indent(line) > indent
    return False


def _respan(problem: SyntaxProblem, source: SourceFile) -> SyntaxProblem:
    """Offsets computed on a patched text, recomputed for the original file."""
    d = problem.diagnostic
    labels = tuple(replace(label, span=source.respan(label.span)) for label in d.labels)
    return replace(problem, diagnostic=replace(d, labels=labels))


def respan_tree(node, source: SourceFile):
    """A copy of a syntax-tree node with every span's offsets recomputed for `source`."""
    if isinstance(node, tuple) and not isinstance(node, Span):
        return tuple(respan_tree(child, source) for child in node)
    if not hasattr(node, "__dataclass_fields__"):
        return node
    changes = {}
    for name in node.__dataclass_fields__:
        value = getattr(node, name)
        if isinstance(value, Span):
            changes[name] = source.respan(value) if value.file == source.name else value
        elif isinstance(value, tuple) or hasattr(value, "__dataclass_fields__"):
            changes[name] = respan_tree(value, source)
    return replace(node, **changes)


# ====================================================================== cleanup
def _without_placeholders(items) -> list:
    kept = []
    for item in items:
        if _is_placeholder(item):
            continue
        kept.append(_clean(item))
    return kept


def _clean(item):
    if isinstance(item, A.Decl):
        return replace(item, body=tuple(_without_placeholders(item.body)))
    if isinstance(item, A.Section):
        return replace(item, body=tuple(_without_placeholders(item.body)))
    if isinstance(item, A.IfBlock):
        orelse = tuple(_without_placeholders(item.orelse)) if item.orelse is not None else None
        return replace(item, body=tuple(_without_placeholders(item.body)), orelse=orelse)
    return item


def _is_placeholder(item) -> bool:
    if isinstance(item, A.Decl):
        return item.name == PLACEHOLDER
    if isinstance(item, A.Import):
        return item.path == (PLACEHOLDER,)
    head = getattr(item, "key", None) or getattr(item, "expr", None)
    return isinstance(head, A.Name) and head.id == PLACEHOLDER


def _unique(diagnostics):
    seen, result = set(), []
    for d in diagnostics:
        key = (d.code, d.message, d.primary_span)
        if key not in seen:
            seen.add(key)
            result.append(d)
    return result
