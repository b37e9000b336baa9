"""modulec `Diagnostic`s and `Span`s as LSP values (0-based positions, in characters)."""

from __future__ import annotations

from pathlib import Path

from lsprotocol import types as T

from modulec.diagnostics import Diagnostic, Severity
from modulec.source import Span

SEVERITY = {Severity.ERROR: T.DiagnosticSeverity.Error,
            Severity.WARNING: T.DiagnosticSeverity.Warning}
START = T.Range(T.Position(0, 0), T.Position(0, 0))


def to_range(span: Span) -> T.Range:
    return T.Range(T.Position(span.line - 1, span.column - 1),
                   T.Position(span.end_line - 1, span.end_column - 1))


def span_uri(span: Span, doc_name: str, doc_uri: str) -> str:
    """The document's own URI for its spans; other files' names are as the resolver shows
    them (relative to the working folder, or absolute)."""
    return doc_uri if span.file == doc_name else Path(span.file).resolve().as_uri()


def message_text(diagnostic: Diagnostic) -> str:
    """The message, then its notes and help, one per line (as `= note:` in the terminal)."""
    extra = [f"note: {n}" for n in diagnostic.notes] + [f"help: {h}" for h in diagnostic.help]
    return "\n".join([diagnostic.message, *extra])


def to_lsp(diagnostic: Diagnostic, doc_name: str, doc_uri: str) -> T.Diagnostic:
    """A diagnostic of the document. One whose primary span lies in another file (or that
    has none) is shown at the document's start, its real place in related information."""
    primary = diagnostic.primary_span
    here = primary is not None and primary.file == doc_name
    related = [T.DiagnosticRelatedInformation(
        T.Location(span_uri(label.span, doc_name, doc_uri), to_range(label.span)),
        label.message or ("here" if label.primary else "related"))
        for label in diagnostic.labels if label.message or not (label.primary and here)]
    return T.Diagnostic(
        range=to_range(primary) if here else START, message=message_text(diagnostic),
        severity=SEVERITY[diagnostic.severity], code=diagnostic.code or None,
        source="modulec", related_information=related or None)
