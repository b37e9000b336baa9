"""Every complete example of the language spec parses, prints and re-parses to the same tree."""

from __future__ import annotations

import pytest

from modulec.syntax.parser import ParseResult, parse_text
from modulec.syntax.printer import print_program
from spec_blocks import ROOT, SPEC, declaration_blocks, placeholder_blocks

DECLARATIONS = declaration_blocks()
PLACEHOLDERS = placeholder_blocks()
SHARED_SPEC = ROOT.parent / "shared" / "spec" / "module-dsl-spec.md"


def _ids(blocks) -> list[str]:
    return [f"line{line}" for line, _ in blocks]


def _parse_clean(text: str, name: str):
    result = parse_text(text, name)
    assert isinstance(result, ParseResult)
    messages = [f"{d.code} {d.message}" for d in result.diagnostics]
    assert result.ok and not result.diagnostics, f"{name}: {messages}"
    return result.program


def test_block_counts():
    assert len(DECLARATIONS) == 94
    assert len(PLACEHOLDERS) == 31


@pytest.mark.parametrize(("line", "text"), DECLARATIONS, ids=_ids(DECLARATIONS))
def test_spec_example_parses(line, text):
    program = _parse_clean(text, f"spec:{line}")
    assert program is not None


@pytest.mark.parametrize(("line", "text"), DECLARATIONS, ids=_ids(DECLARATIONS))
def test_spec_example_round_trips(line, text):
    tree = _parse_clean(text, f"spec:{line}")
    printed = print_program(tree)
    reparsed = _parse_clean(printed, f"printed:{line}")
    assert reparsed == tree, f"spec line {line}: tree changed by print\n{printed}"


@pytest.mark.parametrize(("line", "text"), DECLARATIONS, ids=_ids(DECLARATIONS))
def test_spec_example_printing_is_idempotent(line, text):
    printed = print_program(_parse_clean(text, f"spec:{line}"))
    again = print_program(_parse_clean(printed, f"printed:{line}"))
    assert again == printed


@pytest.mark.parametrize(("line", "text"), PLACEHOLDERS, ids=_ids(PLACEHOLDERS))
def test_placeholder_block_never_raises(line, text):
    """`...` stands for elided text: the parser may reject it, but only with E001."""
    result = parse_text(text, f"spec:{line}")
    assert isinstance(result, ParseResult)
    if not result.ok:
        assert result.diagnostics
        assert {d.code for d in result.diagnostics if d.is_error} == {"E001"}


def test_spec_matches_shared_copy():
    if not SHARED_SPEC.exists():
        pytest.skip(f"{SHARED_SPEC} is absent (it exists only on developer machines)")
    assert SPEC.read_text(encoding="utf-8") == SHARED_SPEC.read_text(encoding="utf-8"), \
        "docs/spec/module-dsl-spec.md differs from ../shared/spec/module-dsl-spec.md"
