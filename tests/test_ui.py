"""UI tests: each tests/ui/**/*.module file against the diagnostics its annotations expect
(format: tests/ui/README.md; MODULEC_BLESS=1 rewrites the annotations of failing files).
Below them, tests of the harness itself."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import ui_harness as H

UI_ROOT = Path(__file__).resolve().parent / "ui"
UI_FILES = sorted(UI_ROOT.rglob("*.module"))
BLESS = os.environ.get("MODULEC_BLESS", "") not in ("", "0")


@pytest.mark.parametrize("path", UI_FILES,
                         ids=[p.relative_to(UI_ROOT).as_posix() for p in UI_FILES])
def test_ui(path: Path):
    outcome = H.check_file(path)
    if not outcome.ok and BLESS and not outcome.problem:
        H.bless(outcome)
        outcome = H.check_file(path)   # what was written must now hold
        if outcome.ok:
            return
        pytest.fail("blessed, but the file still fails (did the annotation lines change "
                    "the diagnostics?)\n" + outcome.report(), pytrace=False)
    if not outcome.ok:
        pytest.fail(outcome.report(), pytrace=False)


def test_there_are_ui_tests():
    assert len(UI_FILES) >= 10 and any(p.parent.name == "clean" for p in UI_FILES)


# ============================================================================ the harness
def write(tmp_path: Path, text: str, name: str = "t.module") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_annotation_forms(tmp_path):
    path = write(tmp_path, """\
        # path: lib
        # a comment line without a key
        # args: --color never
        abcdefgh
        #  ^^^ E002: undefined
        #  ^! E001
        #^^ W001
        # @1..2 E003: a fragment: with a colon
        # @2..2 E004
          # ^ E005
        """)
    test = H.parse_test_file(path)
    assert [(e.line, e.start, e.end, e.code, e.fragment) for e in test.expected] == [
        (4, 4, 7, "E002", "undefined"), (4, 4, 4, "E001", None), (4, 1, 4, "W001", None),
        (4, 1, 2, "E003", "a fragment: with a colon"), (4, 2, 2, "E004", None),
        (4, 5, 6, "E005", None)]
    assert test.annotation_lines == set(range(5, 11))
    assert test.header == [("path", "lib"), ("args", "--color never")]
    assert test.cli_args() == ["--path", str(tmp_path / "lib"), "--color", "never"]


def test_annotations_point_at_the_nearest_line_that_is_not_one(tmp_path):
    test = H.parse_test_file(write(tmp_path, "a\n\n#^ E001\nbb\n#^ E002\n#^ E003\n"))
    assert [e.line for e in test.expected] == [2, 4, 4]


@pytest.mark.parametrize("line", ["#  ^^ bad", "#  ^^! E001", "#  ^^ E01", "#  @3..1 E001"])
def test_malformed_annotations_are_errors(tmp_path, line):
    with pytest.raises(H.AnnotationError):
        H.parse_test_file(write(tmp_path, f"module M():\n{line}\n"))


def test_an_annotation_needs_a_line_above(tmp_path):
    with pytest.raises(H.AnnotationError, match="line above"):
        H.parse_test_file(write(tmp_path, "#^ E001\n"))


@pytest.mark.parametrize("start, end", [(1, 1), (1, 2), (1, 5), (2, 2), (2, 4), (3, 3),
                                        (3, 4), (7, 12)])
def test_annotation_text_reads_back_as_the_same_span(tmp_path, start, end):
    text = "x" * 12 + "\n" + H.annotation_text(start, end, "E001", "msg") + "\n"
    (e,) = H.parse_test_file(write(tmp_path, text)).expected
    assert (e.line, e.start, e.end, e.code, e.fragment) == (1, start, end, "E001", "msg")


SOURCE = "module M():\n  forward:\n    graph:\n      x -> relu() ->\n      y -> z\n"


def test_a_file_that_matches_passes(tmp_path):
    path = write(tmp_path, SOURCE.replace(
        "->\n", "->\n#                 ^^ E001: missing destination\n", 1))
    outcome = H.check_file(path)
    assert outcome.ok, outcome.report()
    assert len(outcome.matched) == 1


def test_a_mismatch_is_shown_as_a_caret_diff(tmp_path):
    path = write(tmp_path, SOURCE.replace("->\n", "->\n#                ^^ E001: nowhere\n", 1))
    outcome = H.check_file(path)
    assert not outcome.ok
    report = outcome.report()
    assert "-  |                  ^^ E001: nowhere" in report
    assert "+  |                   ^^ E001: missing destination after `->`" in report
    assert " 4 |       x -> relu() ->" in report
    assert "MODULEC_BLESS" in report


def test_a_wrong_fragment_is_a_mismatch(tmp_path):
    path = write(tmp_path, SOURCE.replace("->\n", "->\n#                 ^^ E001: colon\n", 1))
    assert not H.check_file(path).ok


def test_a_file_without_annotations_must_check_clean(tmp_path):
    outcome = H.check_file(write(tmp_path, SOURCE))
    assert not outcome.ok and len(outcome.unexpected) == 1


def test_bless_writes_annotations_that_then_match(tmp_path):
    path = write(tmp_path, "modle M():\n  params:\n    w: [d]]\n#  ^ E009: stale\n")
    H.bless(H.check_file(path))
    assert path.read_text() == ("modle M():\n#^^^^ E001: expected a declaration, found `modle`\n"
                                "  params:\n    w: [d]]\n#         ^ E001: unmatched `]`\n")
    assert H.check_file(path).ok


def test_bless_keeps_the_fragment_of_an_annotation_that_matched(tmp_path):
    text = SOURCE.replace("->\n", "->\n#                 ^^ E001: destination\n", 1)
    path = write(tmp_path, "module B()\n" + text)
    H.bless(H.check_file(path))
    new = path.read_text()
    assert "#         ^! E001: expected `:` after `)`\n" in new
    assert "#                 ^^ E001: destination\n" in new


def test_a_usage_error_is_reported_as_a_problem(tmp_path):
    outcome = H.check_file(write(tmp_path, "# path: no-such-folder\nmodule M():\n"))
    assert outcome.problem and "status 2" in outcome.report()


def test_diagnostics_outside_the_file_are_expected_with_a_question_mark(tmp_path):
    path = write(tmp_path, "module M():\n#? E023: conflict\n#? E002\n")
    test = H.parse_test_file(path)
    assert [(e.line, e.code, e.fragment) for e in test.expected] == [
        (None, "E023", "conflict"), (None, "E002", None)]
    outcome = H.Outcome(test, 1, [H.Actual(None, 0, 0, "E023", "error", "name conflict", "a:1:1"),
                                  H.Actual(4, 1, 1, "E001", "error", "unexpected end of file")])
    H.match(outcome)
    assert len(outcome.matched) == 1 and len(outcome.missing) == 1
    report = outcome.report()
    assert "- (not in this file) E002" in report and " 4 | (end of file)" in report
    assert "  a:1:1 E023: name conflict" in report
    with pytest.raises(H.AnnotationError, match="past the last line"):
        H.bless(outcome)
    outcome.actual.pop()
    outcome.unexpected.pop()
    assert H.bless(outcome) == "module M():\n#? E023: conflict\n"
