"""Deeply nested programs end in a result or a diagnostic, never an internal error
(issue 16 item 5): 400 unary minus signs, 600 brackets (closed and unclosed), 150 calls
each of the next module."""

from __future__ import annotations

import pytest

from tests.test_cli import run

HEADER = "module M(d: int = 4):\n  let:\n    k = {expr}\n  params:\n    w: [d, d]\n"
FORWARD = ("  forward:\n    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
           "      x -> matmul(w, transpose=NT) -> y\n")


def _calls(depth: int) -> str:
    decls = []
    for i in range(depth):
        callee = f"M{i + 1}(d)" if i < depth - 1 else "silu()"
        decls.append(f"module M{i}(d: int):\n  forward:\n    in: x: [B, d]\n"
                     f"    out: y: [B, d]\n    graph:\n      x -> {callee} -> y\n")
    return "\n".join(decls)


@pytest.mark.parametrize("name,text,status", [
    ("minus", HEADER.format(expr="-" * 400 + "1") + FORWARD, 0),
    ("brackets", HEADER.format(expr="(" * 600 + "1" + ")" * 600) + FORWARD, 0),
    ("unclosed", HEADER.format(expr="(" * 600 + "1"), 1),
    ("calls", _calls(150), 0),
])
def test_deep_programs_check_without_an_internal_error(tmp_path, name, text, status):
    path = tmp_path / f"{name}.module"
    path.write_text(text, encoding="utf-8")
    result = run("check", path)
    assert result.exit_code == status, result.output
