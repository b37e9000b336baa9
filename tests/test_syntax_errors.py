"""E001: the curated catalog of syntax errors, the fallback, and recovery."""

import pytest

from modulec.syntax.parser import parse_text
from modulec.syntax.sections import check_sections

HEAD = "module M():\n  forward:\n    graph:\n"


def errors(text: str):
    result = parse_text(text, "t.module")
    assert all(d.code == "E001" for d in result.diagnostics)
    return list(result.diagnostics)


def only(text: str):
    found = errors(text)
    assert len(found) == 1, [d.message for d in found]
    return found[0]


CASES = [
    # (source, message fragment, line, column of the primary span, help/note fragment)
    (HEAD + "      x -> relu() ->\n      y -> z\n", "missing destination after `->`", 4, 19, "-> y"),
    ("module M()\n  params:\n    w: [d]\n", "expected `:` after `)`", 1, 11, "ends with `:`"),
    ("module M():\n  forward\n    graph:\n      x -> y\n", "expected `:` after `forward`", 2, 10, ":"),
    (HEAD + "      x -> f(a, b\n      y -> z\n", "unclosed `(`", 4, 13, "add `)`"),
    ("module M():\n  params:\n    w: [d]]\n", "unmatched `]`", 3, 11, "remove"),
    ("module M():\n  forward:\n      graph:\n        x -> y\n    save: [x]\n",
     "unindent does not match", 5, 1, "indent it"),
    (HEAD + "      x -> y\n        z -> w\n", "unexpected indentation", 5, 1, "`->`"),
    ("modle M():\n  params:\n    w: [d]\n", "expected a declaration, found `modle`", 1, 1,
     "did you mean `module`"),
    ("model Llama2(...):\n  params:\n    w: [d]\n", "`...` is a placeholder", 1, 14, "leave out"),
    ('module M():\n  hf_config:\n    architecture: "Llama\n', "unterminated string", 3, 19, '"""'),
    ("module M():\n  hf_config:\n    architecture: 'x'\n", "character `'`", 3, 19, "double quotes"),
    (HEAD + "      x -> -> y\n", "unexpected `->`", 4, 12, "operation"),
]


@pytest.mark.parametrize("source, message, line, column, hint", CASES,
                         ids=[c[1][:30] for c in CASES])
def test_catalog(source, message, line, column, hint):
    d = only(source)
    assert message in d.message
    span = d.primary_span
    assert (span.line, span.column) == (line, column)
    assert any(hint in text for text in d.help + d.notes)


def test_tab_in_indentation_is_reported_but_parsing_goes_on():
    result = parse_text("module M():\n\tparams:\n\t\tw: [d]\n")
    assert [d.message for d in result.diagnostics] == ["tab character in indentation"] * 2
    assert result.program.decls[0].name == "M"


def test_fallback_names_what_was_expected():
    d = only("module M():\n  params:\n    w: [d] 5\n")
    assert d.message.startswith("unexpected")
    assert any(note.startswith("expected") for note in d.notes)


def test_several_errors_in_one_file_and_the_rest_still_parses():
    text = (HEAD + "      x -> ->\n      y -> z\n\nmodule B()\n  params:\n    w: [d]\n\n"
            "module C():\n  params:\n    w: [d\n\nmodule Good():\n  params:\n    v: [e]\n")
    result = parse_text(text)
    assert len(result.diagnostics) == 3
    assert [d.primary_span.line for d in result.diagnostics] == [4, 7, 13]
    # broken lines are patched out of M and C; B lost its header, so it is dropped
    assert [d.name for d in result.program.decls] == ["M", "C", "Good"]


def test_error_spans_point_into_the_original_text():
    text = HEAD + "      x -> ->\n      averyveryverylongname -> y -> ->\n"
    for d in errors(text):
        span = d.primary_span
        assert text[span.start:span.end] in ("->", ">", "")


def test_unknown_section_suggests_the_nearest_names():
    result = parse_text("module M():\n  forwrd:\n    graph:\n      x -> y\n")
    (d,) = check_sections(result.program)
    assert d.message == "unknown section `forwrd` in module `M`"
    assert d.help == ("did you mean `forward`?",)
    assert (d.primary_span.line, d.primary_span.column) == (2, 3)


def test_misplaced_flow_is_reported():
    result = parse_text("module M():\n  x -> y\n")
    (d,) = check_sections(result.program)
    assert "a flow cannot stand directly in module `M`" == d.message


PRIMITIVE = "primitive p:\n  forward:\n    in: x: [*]\n    out: y: [*]\n  collective: {}\n"


def test_a_primitives_collective_section_lists_distinct_phases():
    for good in ("[forward]", "[backward]", "[forward, backward]"):
        assert check_sections(parse_text(PRIMITIVE.format(good)).program) == []
    for bad in ("[forwad]", "[]", "[forward, forward]", "forward"):
        (d,) = check_sections(parse_text(PRIMITIVE.format(bad)).program)
        assert (d.code, d.message) == (
            "E001", "`collective:` lists the phases whose kernel is a collective"), bad
