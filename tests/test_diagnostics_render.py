"""The human (rustc layout) and JSON renderers of diagnostics."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from modulec.diagnostics import (
    Label, error, render_human, render_json_lines, summary_line, to_json_dict, warning,
)
from modulec.source import SourceFile, Span

MODEL = SourceFile("model.module", textwrap.dedent("""\
    graph encoder {
      input x: f32[8, 784]
      hidden = linear(x, 256)
      out = hidden -> relu() -> hiden2
    }


    let y: i32 = "a"
    """))
SOURCES = {"model.module": MODEL}


def at(source: SourceFile, line: int, column: int, length: int = 1) -> Span:
    """The span of `length` characters at a 1-based line and column."""
    start = sum(len(text) + 1 for text in source.text.split("\n")[:line - 1]) + column - 1
    return source.span(start, start + length)


def between(source: SourceFile, first: tuple[int, int], last: tuple[int, int]) -> Span:
    """The span from one (line, column) to another (exclusive)."""
    return at(source, *first).cover(at(source, *last, length=0))


def expected(text: str) -> str:
    """A dedented block without its first newline: the exact rendering a test expects."""
    return textwrap.dedent(text).lstrip("\n")


def undefined_name():
    return error("E002", "undefined name `hiden2`", at(MODEL, 4, 29, 6),
                 "not defined in this graph", notes=["names are scoped to their graph"],
                 help=["did you mean `hidden`?"])


def test_single_line_error_with_note_and_help():
    assert render_human([undefined_name()], SOURCES) == expected("""
        error[E002]: undefined name `hiden2`
         --> model.module:4:29
          |
        4 |   out = hidden -> relu() -> hiden2
          |                             ^^^^^^ not defined in this graph
          |
          = note: names are scoped to their graph
          = help: did you mean `hidden`?
        """)


def test_warning():
    diagnostic = warning("W010", "layer output is never used", at(MODEL, 3, 3, 6), "unused")
    assert render_human([diagnostic], SOURCES) == expected("""
        warning[W010]: layer output is never used
         --> model.module:3:3
          |
        3 |   hidden = linear(x, 256)
          |   ^^^^^^ unused
        """)


def test_secondary_label_on_another_line():
    diagnostic = error("E005", "shape mismatch", at(MODEL, 3, 22, 3), "expects 784 inputs",
                       secondary=[Label(at(MODEL, 2, 17, 3), "declared here")])
    assert render_human([diagnostic], SOURCES) == expected("""
        error[E005]: shape mismatch
         --> model.module:3:22
          |
        2 |   input x: f32[8, 784]
          |                 --- declared here
        3 |   hidden = linear(x, 256)
          |                      ^^^ expects 784 inputs
        """)


def test_labels_on_the_same_line_hang_below():
    diagnostic = error("E006", "mismatched types", at(MODEL, 8, 14, 3), "expected `i32`",
                       secondary=[Label(at(MODEL, 8, 8, 3), "expected due to this"),
                                  Label(at(MODEL, 8, 5, 1), "binding")])
    assert render_human([diagnostic], SOURCES) == expected("""
        error[E006]: mismatched types
         --> model.module:8:14
          |
        8 | let y: i32 = "a"
          |     -  ---   ^^^ expected `i32`
          |     |  |
          |     |  expected due to this
          |     |
          |     binding
        """)


def test_distant_lines_are_elided_and_gutter_is_widest_line():
    source = SourceFile("long.module", "a\n" * 11)
    diagnostic = error("E007", "far apart", at(source, 11, 1), "here",
                       secondary=[Label(at(source, 2, 1), "and here")])
    assert render_human([diagnostic], {"long.module": source}) == expected("""
        error[E007]: far apart
          --> long.module:11:1
           |
        2  | a
           | - and here
        ...
        11 | a
           | ^ here
        """)


def test_multi_line_span_marks_first_line_to_its_end():
    diagnostic = error("E004", "graph has no output", between(MODEL, (1, 7), (5, 2)),
                       "this graph")
    assert render_human([diagnostic], SOURCES) == expected("""
        error[E004]: graph has no output
         --> model.module:1:7
          |
        1 | graph encoder {
          |       ^^^^^^^^^ this graph
        """)


def test_zero_width_span_at_end_of_line_gets_one_caret():
    diagnostic = error("E001", "expected `]`", at(MODEL, 2, 23, 0), "expected `]` here")
    assert render_human([diagnostic], SOURCES) == expected("""
        error[E001]: expected `]`
         --> model.module:2:23
          |
        2 |   input x: f32[8, 784]
          |                       ^ expected `]` here
        """)


def test_tab_indented_source_aligns_carets():
    source = SourceFile("tabs.module", "graph g {\n\t\tx = relu(\ty)\n}\n")
    diagnostic = error("E002", "undefined name `y`", at(source, 2, 13), "not defined")
    rendered = render_human([diagnostic], {"tabs.module": source})
    assert rendered == expected("""
        error[E002]: undefined name `y`
         --> tabs.module:2:13
          |
        2 |         x = relu(    y)
          |                      ^ not defined
        """)
    code_line, mark_line = rendered.splitlines()[3:5]
    assert "\t" not in rendered
    assert code_line[mark_line.index("^")] == "y"


def test_labels_in_other_and_unknown_files():
    library = SourceFile("std/nn.module", "def linear(x, n)\n")
    diagnostic = error("E008", "wrong argument count", at(MODEL, 3, 12, 6), "called here",
                       secondary=[Label(at(library, 1, 5, 6), "defined here"),
                                  Label(Span("gone.module", 0, 1, 3, 2, 3, 3), "lost")])
    sources = {**SOURCES, "std/nn.module": library}
    assert render_human([diagnostic], sources) == expected("""
        error[E008]: wrong argument count
         --> model.module:3:12
          |
        3 |   hidden = linear(x, 256)
          |            ^^^^^^ called here
          |
         ::: std/nn.module:1:5
          |
        1 | def linear(x, n)
          |     ------ defined here
          |
         ::: gone.module:3:2
        """)


def test_primary_in_unknown_file_shows_location_only():
    diagnostic = error("E009", "cannot read", Span("gone.module", 0, 1, 2, 4, 2, 5), "here",
                       notes=["the file was deleted"])
    assert render_human([diagnostic], SOURCES) == expected("""
        error[E009]: cannot read
         --> gone.module:2:4
          |
          = note: the file was deleted
        """)


def test_diagnostics_are_separated_by_a_blank_line():
    first = warning("W010", "unused", at(MODEL, 3, 3, 6))
    second = error("E003", "no span", None, help=["add an output"])
    assert render_human([first, second], SOURCES) == expected("""
        warning[W010]: unused
         --> model.module:3:3
          |
        3 |   hidden = linear(x, 256)
          |   ^^^^^^

        error[E003]: no span
          |
          = help: add an output
        """)
    assert render_human([], SOURCES) == ""


def test_plain_output_has_no_escapes_and_takes_no_markup():
    diagnostic = error("E002", "name [bold]x[/bold]", at(MODEL, 1, 1, 5), "[red]label")
    plain = render_human([diagnostic], SOURCES, color=False)
    assert "\x1b" not in plain
    assert "error[E002]: name [bold]x[/bold]" in plain
    assert "^^^^^ [red]label" in plain


def test_color_output_styles_the_header():
    colored = render_human([undefined_name()], SOURCES, color=True)
    assert "\x1b[1;31merror[E002]" in colored
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored) == render_human([undefined_name()], SOURCES)


def test_control_characters_in_source_are_neutralised():
    source = SourceFile("ctl.module", "a\x1b[2J = b\n")
    rendered = render_human([error("E1", "m", at(source, 1, 9), "b")], {"ctl.module": source})
    assert "\x1b" not in rendered
    code_line, mark_line = rendered.splitlines()[3:5]
    assert code_line[mark_line.index("^")] == "b"


@pytest.mark.parametrize(("severities", "line"), [
    ("", "no problems found"), ("e", "1 error emitted"), ("w", "1 warning emitted"),
    ("ee", "2 errors emitted"), ("eew", "2 errors, 1 warning emitted"),
    ("eww", "1 error, 2 warnings emitted"),
])
def test_summary_line(severities, line):
    make = {"e": error, "w": warning}
    assert summary_line([make[s]("X", "m", None) for s in severities]) == line


def test_json_lines_one_object_per_diagnostic_with_all_fields():
    diagnostics = [undefined_name(), warning("W010", "unused", at(MODEL, 3, 3, 6))]
    output = render_json_lines(diagnostics, SOURCES)
    objects = [json.loads(line) for line in output.splitlines()]
    assert output.endswith("\n") and len(objects) == 2
    required = {"$message_type", "code", "level", "message", "spans", "children", "rendered"}
    for obj, diagnostic in zip(objects, diagnostics):
        assert required <= obj.keys() and obj["$message_type"] == "diagnostic"
        assert (obj["code"], obj["message"]) == (diagnostic.code, diagnostic.message)
        assert obj["rendered"] == render_human([diagnostic], SOURCES)
    assert [obj["level"] for obj in objects] == ["error", "warning"]
    assert output == render_json_lines(diagnostics, SOURCES)  # deterministic


def test_json_span_fields():
    obj = to_json_dict(undefined_name(), SOURCES)
    [span] = obj["spans"]
    assert span == {
        "file_name": "model.module", "byte_start": span["byte_start"],
        "byte_end": span["byte_start"] + 6, "line_start": 4, "column_start": 29,
        "line_end": 4, "column_end": 35, "is_primary": True, "label": "not defined in this graph",
        "text": [{"text": "  out = hidden -> relu() -> hiden2",
                  "highlight_start": 29, "highlight_end": 35}],
        "suggested_replacement": None, "suggestion_applicability": None, "expansion": None,
    }
    assert MODEL.text[span["byte_start"]:span["byte_end"]] == "hiden2"


def test_json_is_primary_label_and_unknown_source():
    diagnostic = error("E005", "shape mismatch", at(MODEL, 3, 22, 3),
                       secondary=[Label(at(MODEL, 2, 17, 3), "declared here"),
                                  Label(Span("gone.module", 0, 1, 1, 1, 1, 2))])
    spans = to_json_dict(diagnostic, SOURCES)["spans"]
    assert [s["is_primary"] for s in spans] == [True, False, False]
    assert [s["label"] for s in spans] == [None, "declared here", None]
    assert spans[2]["text"] == []


def test_json_multi_line_span_text_covers_each_line():
    diagnostic = error("E004", "graph has no output", between(MODEL, (3, 3), (4, 6)))
    [span] = to_json_dict(diagnostic, SOURCES)["spans"]
    assert (span["line_start"], span["line_end"]) == (3, 4)
    assert span["text"] == [
        {"text": "  hidden = linear(x, 256)", "highlight_start": 3, "highlight_end": 26},
        {"text": "  out = hidden -> relu() -> hiden2", "highlight_start": 1,
         "highlight_end": 6},
    ]


def test_json_children_are_notes_then_helps():
    children = to_json_dict(undefined_name(), SOURCES)["children"]
    empty = {"code": None, "spans": [], "children": [], "rendered": None}
    assert children == [
        {"message": "names are scoped to their graph", "level": "note", **empty},
        {"message": "did you mean `hidden`?", "level": "help", **empty},
    ]
