"""Diagnostics for tools: one JSON object per line, modelled on rustc's `--error-format=json`.

Differences from rustc, on purpose: `code` is the plain code string (our spec requires it),
and `byte_start`/`byte_end` are character offsets (`Span.start`/`end`), which is what an
editor holding the decoded text needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from modulec.diagnostics.diagnostic import Diagnostic, Label
from modulec.diagnostics.render_human import render_human
from modulec.source import SourceFile, Span


def render_json_lines(diagnostics: Iterable[Diagnostic], sources: dict[str, SourceFile]) -> str:
    """One compact JSON object per diagnostic, each ending in a newline."""
    return "".join(_dump(to_json_dict(d, sources)) + "\n" for d in diagnostics)


def to_json_dict(diagnostic: Diagnostic, sources: dict[str, SourceFile]) -> dict:
    return {
        "$message_type": "diagnostic",
        "code": diagnostic.code,
        "level": diagnostic.severity.value,
        "message": diagnostic.message,
        "spans": [_span_dict(label, sources.get(label.span.file)) for label in diagnostic.labels],
        "children": _children(diagnostic),
        "rendered": render_human([diagnostic], sources, color=False),
    }


def _dump(obj: dict) -> str:
    # Insertion order is fixed by the code above, so the output is deterministic as it is.
    return json.dumps(obj, separators=(",", ":"))


def _span_dict(label: Label, source: SourceFile | None) -> dict:
    span = label.span
    return {
        "file_name": span.file,
        "byte_start": span.start,
        "byte_end": span.end,
        "line_start": span.line,
        "column_start": span.column,
        "line_end": span.end_line,
        "column_end": span.end_column,
        "is_primary": label.primary,
        "label": label.message or None,
        "text": _span_text(span, source) if source is not None else [],
        # Kept null so consumers written for rustc's format find the keys they expect.
        "suggested_replacement": None,
        "suggestion_applicability": None,
        "expansion": None,
    }


def _span_text(span: Span, source: SourceFile) -> list[dict]:
    """Each source line the span touches, with the highlighted columns on that line."""
    return [_line_dict(span, number, source.line_text(number).rstrip("\r"))
            for number in range(span.line, span.end_line + 1)]


def _line_dict(span: Span, number: int, text: str) -> dict:
    start = span.column if number == span.line else 1
    end = span.end_column if number == span.end_line else len(text) + 1
    return {"text": text, "highlight_start": start, "highlight_end": end}


def _children(diagnostic: Diagnostic) -> list[dict]:
    entries = [("note", n) for n in diagnostic.notes] + [("help", h) for h in diagnostic.help]
    return [{"message": message, "code": None, "level": level, "spans": [], "children": [],
             "rendered": None} for level, message in entries]
