"""Diagnostics for people, in rustc's layout.

The text is built as `rich.text.Text` so one code path serves both plain output (tests, pipes,
`rendered` in JSON) and colored terminal output; only the final console differs.
"""

from __future__ import annotations

import io
from itertools import groupby
from collections.abc import Iterable
from dataclasses import dataclass, replace

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from modulec.diagnostics.diagnostic import Diagnostic, Label, Severity
from modulec.source import SourceFile, Span

# A tab is always four columns (rustc's choice): the same rule for the echoed line and the
# caret offsets keeps marks aligned whatever the reader's tab stops are.
TAB = "    "
# Other control characters are shown as U+FFFD: echoing them raw could drive the terminal
# (ESC sequences) and, having no width, would shift the carets.
_VISIBLE = {code: "\ufffd" for code in [*range(32), 127]} | {ord("\t"): TAB}
LEVEL_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow"}
GUTTER_STYLE = "bold blue"
SECONDARY_STYLE = "bold blue"

# One painted cell of a mark row: (character, style).
_Cell = tuple[str, str]


@dataclass(frozen=True)
class _Mark:
    """One label drawn under its source line, in display columns (0-based, tabs expanded)."""

    start: int
    width: int
    char: str
    style: str
    message: str
    primary: bool


def render_human(diagnostics: Iterable[Diagnostic], sources: dict[str, SourceFile], *,
                 color: bool = False, width: int = 100) -> str:
    """All diagnostics, separated by blank lines, ending in a newline ("" when there are none)."""
    global _HIGHLIGHT
    _HIGHLIGHT = color  # echoed source lines get syntax colors only on a color terminal
    diagnostics = list(diagnostics)
    try:
        blocks = [_render_one(d, sources) for d in diagnostics[:MAX_SHOWN]]
    finally:
        _HIGHLIGHT = False
    if not blocks:
        return ""
    if len(diagnostics) > MAX_SHOWN:  # a mangled file can give one per token: O(n^2) text
        blocks.append(Text(f"note: {len(diagnostics) - MAX_SHOWN} more diagnostics not shown "
                           f"(the first {MAX_SHOWN} are)"))
    text = Text("\n\n").join(blocks)
    text.append("\n")
    return _to_string(text, color, width)


_HIGHLIGHT = False
MAX_SHOWN = 100  # diagnostics rendered in one call (clang stops at 20 errors by default)
MAX_LINE = 240  # characters of a source line echoed; a longer one is cut around its marks


def _highlight_line(text: str) -> Text:
    """An echoed source line, syntax-colored (Pygments, loaded only when colors are on)."""
    if not _HIGHLIGHT:
        return Text(text)
    from modulec.highlight.rich_line import highlight_line

    return highlight_line(text)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _to_string(text: Text, color: bool, width: int) -> str:
    # soft_wrap: never wrap, since a wrapped source line would misplace its carets.
    # Explicit color_system/no_color keep the output independent of TERM/NO_COLOR.
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=color, no_color=not color,
                      color_system="standard" if color else None, width=width,
                      highlight=False, markup=False, emoji=False, soft_wrap=True,
                      force_jupyter=False)
    console.print(text, end="")
    return buffer.getvalue()


# --- one diagnostic -----------------------------------------------------------------------

def _render_one(diagnostic: Diagnostic, sources: dict[str, SourceFile]) -> Text:
    groups = _group_by_file(diagnostic)
    gutter = _gutter_width(groups, sources)
    lines = [_header(diagnostic)]
    for index, (file, labels) in enumerate(groups):
        # Close the previous file's snippet before a ::: header; a bare location needs no bar.
        if index and groups[index - 1][0] in sources:
            lines.append(_bar(gutter))
        lines += _file_section(labels, sources.get(file), gutter, index == 0,
                               LEVEL_STYLE[diagnostic.severity])
    lines += _footer(diagnostic, gutter)
    return Text("\n").join(lines)


def _header(diagnostic: Diagnostic) -> Text:
    code = f"[{diagnostic.code}]" if diagnostic.code else ""
    return Text.assemble((f"{diagnostic.severity.value}{code}", LEVEL_STYLE[diagnostic.severity]),
                         (f": {diagnostic.message}", "bold"))


def _group_by_file(diagnostic: Diagnostic) -> list[tuple[str, list[Label]]]:
    """Labels by file, the primary span's file first, then in order of first appearance."""
    groups: dict[str, list[Label]] = {}
    if diagnostic.primary_span is not None:
        groups[diagnostic.primary_span.file] = []
    for label in diagnostic.labels:
        groups.setdefault(label.span.file, []).append(label)
    return list(groups.items())


def _gutter_width(groups: list[tuple[str, list[Label]]], sources: dict[str, SourceFile]) -> int:
    shown = [label.span.line for file, labels in groups if file in sources for label in labels]
    return len(str(max(shown, default=1)))


def _bar(gutter: int) -> Text:
    return Text.styled(" " * gutter + " |", GUTTER_STYLE)


def _file_section(labels: list[Label], source: SourceFile | None, gutter: int,
                  first: bool, level_style: str) -> list[Text]:
    arrow = "-->" if first else ":::"
    location = Text.assemble((" " * gutter + arrow, GUTTER_STYLE), f" {_location(_anchor(labels))}")
    if source is None:  # nothing to echo: the location alone still tells where to look
        return [location]
    return [location, _bar(gutter)] + _snippet(labels, source, gutter, level_style)


def _anchor(labels: list[Label]) -> Span:
    """The span a file header points at: the primary one, else the earliest."""
    primary = [label.span for label in labels if label.primary]
    return primary[0] if primary else min((label.span for label in labels),
                                          key=lambda s: (s.line, s.column))


def _location(span: Span) -> str:
    return f"{span.file}:{span.line}:{span.column}"


def _footer(diagnostic: Diagnostic, gutter: int) -> list[Text]:
    entries = [("note", n) for n in diagnostic.notes] + [("help", h) for h in diagnostic.help]
    if not entries:
        return []
    return [_bar(gutter)] + [_child_line(kind, message, gutter) for kind, message in entries]


def _child_line(kind: str, message: str, gutter: int) -> Text:
    # Continuation lines of a multi-line note line up under its first line, as rustc does.
    indent = " " * (gutter + len(f" = {kind}: "))
    body = message.replace("\n", "\n" + indent)
    return Text.assemble((" " * gutter + " =", GUTTER_STYLE), " ", (kind, "bold"), f": {body}")


# --- source snippet -----------------------------------------------------------------------

def _snippet(labels: list[Label], source: SourceFile, gutter: int,
             level_style: str) -> list[Text]:
    """Each line that a label starts on, with its marks; gaps elided like rustc."""
    by_line: dict[int, list[Label]] = {}
    for label in labels:
        by_line.setdefault(label.span.line, []).append(label)
    lines: list[Text] = []
    previous: int | None = None
    for number in sorted(by_line):
        lines += _gap(previous, number, source, gutter)
        raw, labels = _window(_raw_line(source, number), by_line[number])
        lines.append(_source_line(number, source, gutter, raw))
        lines += _mark_lines(labels, raw, gutter, level_style)
        previous = number
    return lines


def _window(line: str, labels: list[Label]) -> tuple[str, list[Label]]:
    """A line over MAX_LINE characters cut to MAX_LINE from a little before its first mark,
    with `…` where text is left out, and the labels' columns moved to match."""
    if len(line) <= MAX_LINE:
        return line, labels
    first = min(label.span.column for label in labels) - 1
    low = max(0, min(first - 20, len(line) - MAX_LINE))
    high = low + MAX_LINE
    shift = low - (1 if low else 0)
    cut = ("…" if low else "") + line[low:high] + ("…" if high < len(line) else "")

    def moved(span: Span) -> Span:
        column = min(max(span.column - shift, 1), len(cut))
        end = span.end_column - shift if span.end_line == span.line else len(cut) + 1
        return span._replace(column=column, end_column=min(max(end, column), len(cut) + 1))

    return cut, [replace(label, span=moved(label.span)) for label in labels]


def _gap(previous: int | None, number: int, source: SourceFile, gutter: int) -> list[Text]:
    # A single skipped line costs as much as "..." and is more useful, so show it.
    if previous is None or number - previous == 1:
        return []
    if number - previous == 2:
        return [_source_line(previous + 1, source, gutter)]
    return [Text.styled("...", GUTTER_STYLE)]


def _raw_line(source: SourceFile, number: int) -> str:
    return source.line_text(number).rstrip("\r")  # CRLF files: the \r is not text


def _source_line(number: int, source: SourceFile, gutter: int, raw: str | None = None) -> Text:
    text = _visible((_raw_line(source, number) if raw is None else raw).rstrip())
    line = Text.styled(f"{number:<{gutter}} |", GUTTER_STYLE)  # rustc left-aligns numbers
    if text:
        line.append(" ")
        line.append(_highlight_line(text))
    return line


def _visible(text: str) -> str:
    return text.translate(_VISIBLE)


def _display_width(text: str) -> int:
    return cell_len(_visible(text))


def _mark_for(label: Label, line: str, level_style: str) -> _Mark:
    """Where a label's marks go: a multi-line span is marked to the end of its first line."""
    span = label.span
    begin = span.column - 1
    end = span.end_column - 1 if span.end_line == span.line else len(line)
    start = _display_width(line[:begin]) + max(0, begin - len(line))
    width = max(1, _display_width(line[begin:end]))  # zero width still gets one mark
    char, style = ("^", level_style) if label.primary else ("-", SECONDARY_STYLE)
    return _Mark(start, width, char, style, label.message, label.primary)


def _mark_lines(labels: list[Label], line: str, gutter: int, level_style: str) -> list[Text]:
    """rustc's underline block: every mark on one row, the rightmost label's text inline,
    the other labels' texts hung below on `|` connectors, right to left."""
    marks = sorted((_mark_for(label, line, level_style) for label in labels),
                   key=lambda m: (m.start, m.primary))
    row: list[_Cell] = []
    for mark in marks:  # primary sorts last among equals, so its carets win overlaps
        _paint(row, mark.start, mark.char * mark.width, mark.style)
    if marks[-1].message:
        _paint(row, len(row) + 1, marks[-1].message, marks[-1].style)
    rows = [row] + _hanging_rows([m for m in marks[:-1] if m.message])
    prefix = _bar(gutter).append(" ")
    return [prefix.copy().append_text(_row_text(r)) for r in rows]


def _hanging_rows(pending: list[_Mark]) -> list[list[_Cell]]:
    rows: list[list[_Cell]] = []
    while pending:
        connectors: list[_Cell] = []
        for mark in pending:
            _paint(connectors, mark.start, "|", mark.style)
        last = pending.pop()
        text_row: list[_Cell] = []
        for mark in pending:
            _paint(text_row, mark.start, "|", mark.style)
        _paint(text_row, last.start, last.message, last.style)
        rows += [connectors, text_row]
    return rows


def _paint(row: list[_Cell], column: int, text: str, style: str) -> None:
    row.extend([(" ", "")] * (column + len(text) - len(row)))
    row[column:column + len(text)] = [(ch, style) for ch in text]


def _row_text(row: list[_Cell]) -> Text:
    # One span per run of equal style keeps colored output free of per-character escapes.
    runs = groupby(row, key=lambda cell: cell[1])
    return Text.assemble(*(("".join(char for char, _ in cells), style) for style, cells in runs))
