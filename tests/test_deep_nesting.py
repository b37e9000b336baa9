"""Deeply nested programs end in a result or a diagnostic, never an internal error
(issue 16 item 5): 400 unary minus signs (E001: deeper than the parser reads), 600
brackets (closed and unclosed), 150 calls each of the next module."""

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
    ("minus", HEADER.format(expr="-" * 400 + "1") + FORWARD, 1),  # E001: too deep
    ("minus_100", HEADER.format(expr="-" * 100 + "1") + FORWARD, 0),
    ("brackets", HEADER.format(expr="(" * 600 + "1" + ")" * 600) + FORWARD, 0),
    ("unclosed", HEADER.format(expr="(" * 600 + "1"), 1),
    ("calls", _calls(150), 0),
    # found by the fuzz test (issue 16): prefix and right-associative chains recursed in the
    # precedence parser, deep trees in error recovery recursed while respanned (exit 101)
    ("not_2000", HEADER.format(expr="not " * 2000 + "true") + FORWARD, 1),
    ("power_2000", HEADER.format(expr="2 ** " * 2000 + "1") + FORWARD, 1),
    ("calls_and_a_syntax_error", HEADER.format(expr="f(" * 2000 + "1" + ")" * 2000) + FORWARD
     + "  params:\n    v: ][\n", 1),
])
def test_deep_programs_check_without_an_internal_error(tmp_path, name, text, status):
    path = tmp_path / f"{name}.module"
    path.write_text(text, encoding="utf-8")
    result = run("check", path)
    assert result.exit_code == status, result.output
    deep = "error[E001]: this nests more than 128 levels deep" in result.output
    assert deep == (status == 1 and name != "unclosed"), result.output


@pytest.mark.parametrize("command", [("check",), ("fmt",), ("build", "--shape", "B=1")])
def test_a_tree_too_deep_is_one_diagnostic_in_every_command(tmp_path, command):
    """Each later stage walks the tree recursively (build evaluated 400 minus signs into a
    RecursionError, exit 101): the parser bounds the depth, with a hint."""
    path = tmp_path / "deep.module"
    path.write_text(HEADER.replace("module M", "model M").format(expr="-" * 400 + "1")
                    + FORWARD, encoding="utf-8")
    result = run(command[0], path, *command[1:], *(["-o", tmp_path / "x.ir"]
                                                   if command[0] == "build" else []))
    assert result.exit_code == 1
    assert "error[E001]: this nests more than 128 levels deep" in result.output


@pytest.mark.parametrize("digits,status", [(4000, 0), (4001, 1), (20000, 1)])
def test_an_integer_literal_too_long_to_read_is_e001(tmp_path, digits, status):
    """Found by the fuzz test: a parameter default of 20,000 digits reached Python's int
    conversion limit (4,300 digits) in `check` (exit 101). The parser bounds the length of
    an integer literal; a float literal of any length reads (1e999 is E003's inf)."""
    path = tmp_path / "long.module"
    path.write_text(HEADER.format(expr="4" * digits) + FORWARD, encoding="utf-8")
    result = run("check", path)
    assert result.exit_code == status, result.output
    assert ("error[E001]: this integer literal has" in result.output) == (status == 1)
