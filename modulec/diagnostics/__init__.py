"""Diagnostics: data (`Diagnostic`), and renderers for people (rustc layout) and tools (JSON)."""

from modulec.diagnostics.diagnostic import (
    Diagnostic, DiagnosticBag, Label, Severity, error, warning,
)
from modulec.diagnostics.render_human import render_human, summary_line
from modulec.diagnostics.render_json import render_json_lines, to_json_dict

__all__ = [
    "Diagnostic", "DiagnosticBag", "Label", "Severity", "error", "warning",
    "render_human", "render_json_lines", "summary_line", "to_json_dict",
]
