"""Diagnostics: data (`Diagnostic`), and renderers for people (rustc layout) and tools (JSON).

The renderers are imported on first use: they pull in `rich`, which a check that finds
nothing never needs (`modulec check` must start fast).
"""

from importlib import import_module

from modulec.diagnostics.diagnostic import (
    Diagnostic, DiagnosticBag, Label, Severity, error, summary_line, warning,
)

_LAZY = {
    "render_human": "modulec.diagnostics.render_human",
    "render_json_lines": "modulec.diagnostics.render_json",
    "to_json_dict": "modulec.diagnostics.render_json",
}

__all__ = ["Diagnostic", "DiagnosticBag", "Label", "Severity", "error", "summary_line", "warning",
           *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'modulec.diagnostics' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    # Importing `render_human` (the module) binds that name here to the module; rebind the
    # functions so that `from modulec.diagnostics import render_human` gets the function.
    for lazy_name, owner in _LAZY.items():
        if owner == _LAZY[name]:
            globals()[lazy_name] = getattr(module, lazy_name)
    return globals()[name]
