"""The table of diagnostic codes, and the link between the codes the compiler emits and the
UI tests (tests/ui/) that show each of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import ui_harness
from modulec.diagnostics import Severity
from modulec.diagnostics.codes import CODES, OWN_CODES, all_codes, lookup

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec" / "module-dsl-spec.md"
UI_ROOT = ROOT / "tests" / "ui"
CODE = re.compile(r"[EW]0\d\d")
SPEC_ROW = re.compile(r"^\|\s*([EW]\d{3})\s*\|\s*(.*?)\s*\|\s*$")


# ============================================================================ the table
def spec_titles() -> dict[str, str]:
    """Code -> description from the specification's Appendix C and D tables."""
    text = SPEC.read_text(encoding="utf-8")
    appendix = text[text.index("### C. Compilation Errors"):]
    return {m[1]: m[2] for m in map(SPEC_ROW.match, appendix.splitlines()) if m}


def test_the_table_has_exactly_the_specified_codes_with_their_titles():
    specified = {code: info.title for code, info in CODES.items() if code not in OWN_CODES}
    assert specified == spec_titles()
    assert [i.code for i in all_codes()] == [f"E{n:03}" for n in range(1, 28)] + \
        [f"W{n:03}" for n in range(1, 6)] + list(OWN_CODES)


@pytest.mark.parametrize("info", all_codes(), ids=lambda i: i.code)
def test_every_code_has_a_title_and_an_explanation(info):
    assert info.title.strip()
    assert len(info.explanation.split()) >= 20, "explain what it means, the cause, the fix"
    assert "\n" not in info.explanation and "  " not in info.explanation
    assert info.severity is (Severity.ERROR if info.code[0] == "E" else Severity.WARNING)


def test_lookup():
    assert lookup("E017").title.startswith("Tensor redefinition")
    assert lookup("w004") is CODES["W004"]
    assert lookup("E999") is None and lookup("") is None


# ============================================================================ emitted codes
def diagnostic_calls() -> list[tuple[str, str, str]]:
    """(`error` or `warning`, code, `file:line`) of each `error("E0xx", ...)` /
    `warning("W0xx", ...)` call under modulec/ (found in the syntax tree, so a code held in
    a variable is not seen)."""
    calls = []
    for path in sorted((ROOT / "modulec").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            call = _diagnostic_call(node)
            if call is not None:
                calls.append((*call, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return sorted(calls, key=lambda c: _location_key(c[2]))


def emitted_codes() -> dict[str, list[str]]:
    """Code -> `file:line` of each call that emits it."""
    found: dict[str, list[str]] = {}
    for _, code, where in diagnostic_calls():
        found.setdefault(code, []).append(where)
    return found


def _location_key(where: str):
    path, line = where.rsplit(":", 1)
    return path, int(line)


def mentioned_codes() -> set[str]:
    """Every code written as a string anywhere under modulec/ (outside the table): a wider
    net than `emitted_codes`, since some checks pass their code along in a variable
    (`Kind(code="E013")`, `ctx.world.error(exc.code, ...)`)."""
    table = ROOT / "modulec" / "diagnostics" / "codes.py"
    found = set()
    for path in (ROOT / "modulec").rglob("*.py"):
        if path != table:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            found |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and CODE.fullmatch(node.value)}
    return found


def _diagnostic_call(node) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else \
        func.attr if isinstance(func, ast.Attribute) else None
    if name not in ("error", "warning"):
        return None
    args = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "code"]
    for arg in args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                and CODE.fullmatch(arg.value):
            return name, arg.value
    return None


def ui_expectations() -> dict[str, list[str]]:
    """Code -> the UI test files whose annotations expect it."""
    found: dict[str, list[str]] = {}
    for path in sorted(UI_ROOT.rglob("*.module")):
        for expected in ui_harness.parse_test_file(path).expected:
            name = path.relative_to(UI_ROOT).as_posix()
            if name not in found.setdefault(expected.code, []):
                found[expected.code].append(name)
    return found


def test_the_scan_finds_the_syntax_errors():
    assert "E001" in emitted_codes()


def test_errors_have_e_codes_and_warnings_w_codes():
    wrong = [f"{where}: {kind}(\"{code}\", ...)" for kind, code, where in diagnostic_calls()
             if code[0] != ("E" if kind == "error" else "W")]
    assert not wrong, "error() takes an E code and warning() a W code:\n  " + "\n  ".join(wrong)


def test_every_emitted_code_is_in_the_table():
    unknown = {c: w for c, w in emitted_codes().items() if c not in CODES}
    assert not unknown, f"codes emitted but missing from modulec/diagnostics/codes.py: {unknown}"


def test_every_emitted_code_has_a_ui_test():
    expected = ui_expectations()
    missing = {code: where for code, where in emitted_codes().items() if code not in expected}
    assert not missing, (
        "codes the compiler emits with no UI test expecting them (add a file under tests/ui/ "
        "with an annotation such as `#   ^^^ CODE: message`; see tests/ui/README.md):\n"
        + "\n".join(f"  {code}: emitted at {_some(where)}"
                    for code, where in sorted(missing.items())))


def _some(places: list[str], shown: int = 3) -> str:
    more = f" (+{len(places) - shown} more)" if len(places) > shown else ""
    return ", ".join(places[:shown]) + more


def test_ui_tests_expect_only_codes_the_compiler_emits():
    emitted = set(emitted_codes()) | mentioned_codes()
    stray = {code: files for code, files in ui_expectations().items() if code not in emitted}
    assert not stray, (
        "UI tests expect codes that the compiler never emits: no code under modulec/ "
        "mentions them (a typo in the annotation, or a check that was removed):\n"
        + "\n".join(f"  {code}: expected by {', '.join(files)}"
                    for code, files in sorted(stray.items())))
