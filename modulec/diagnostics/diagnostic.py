"""Diagnostics are data: one object rendered to terminal, JSON and (later) LSP."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable

from modulec.source import Span


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Label:
    """A span with an optional message; the primary label carries the carets (^^^)."""

    span: Span
    message: str = ""
    primary: bool = False


@dataclass(frozen=True)
class Diagnostic:
    code: str
    severity: Severity
    message: str
    labels: tuple[Label, ...] = ()
    notes: tuple[str, ...] = ()
    help: tuple[str, ...] = ()

    @property
    def primary_span(self) -> Span | None:
        for label in self.labels:
            if label.primary:
                return label.span
        return self.labels[0].span if self.labels else None

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR


def error(code: str, message: str, span: Span | None, label: str = "", *,
          notes: tuple[str, ...] | list[str] = (), help: tuple[str, ...] | list[str] = (),
          secondary: tuple[Label, ...] | list[Label] = ()) -> Diagnostic:
    """An error with one primary span (and optional secondary labels)."""
    return _make(Severity.ERROR, code, message, span, label, notes, help, secondary)


def warning(code: str, message: str, span: Span | None, label: str = "", *,
            notes: tuple[str, ...] | list[str] = (), help: tuple[str, ...] | list[str] = (),
            secondary: tuple[Label, ...] | list[Label] = ()) -> Diagnostic:
    return _make(Severity.WARNING, code, message, span, label, notes, help, secondary)


def _make(severity, code, message, span, label, notes, help, secondary) -> Diagnostic:
    labels = (Label(span, label, primary=True),) if span is not None else ()
    return Diagnostic(code, severity, message, labels + tuple(secondary), tuple(notes), tuple(help))


@dataclass
class DiagnosticBag:
    """Collects diagnostics during a pass; passes report here rather than raising."""

    items: list[Diagnostic] = field(default_factory=list)

    def add(self, diagnostic: Diagnostic) -> None:
        self.items.append(diagnostic)

    def extend(self, diagnostics) -> None:
        self.items.extend(diagnostics)

    @property
    def has_errors(self) -> bool:
        return any(d.is_error for d in self.items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def summary_line(diagnostics: Iterable[Diagnostic]) -> str:
    """`2 errors, 1 warning emitted`, or `no problems found`."""
    items = list(diagnostics)
    errors = sum(1 for d in items if d.is_error)
    counts = [(errors, "error"), (len(items) - errors, "warning")]
    parts = [_plural(n, noun) for n, noun in counts if n]
    return ", ".join(parts) + " emitted" if parts else "no problems found"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
