"""Hostile programs (issue 16): the seeded token-level fuzz run
(tests/fuzz/: deletions, duplications, swaps, huge numbers, deep nesting, unicode, lines,
repeated tokens over std/ and examples/) through `check`, and `build` for those that check
clean, in-process: never exit 101, never a traceback, each command under its time cap.
CI runs all 3,000 programs (the issue's floor); `tests/fuzz/run_fuzz.py --n N --seed S`
runs others and prints the tally."""

from __future__ import annotations

from tests.fuzz.mutate import gentle_mutant, mutant, tokens
from tests.fuzz.run_fuzz import fuzz
from tests.test_cli import run

SLICE = 3000  # programs in CI: 47 s on an idle 2-core machine, 56 s under load


def test_the_fuzz_run(tmp_path):
    report = fuzz(range(SLICE), seed=0, folder=tmp_path, cap_s=20.0)
    assert report.programs == SLICE
    assert not report.failures, report.summary()
    assert sum(n for k, n in report.tally.items() if k.startswith("built")) > 0, report.tally


def test_mutants_are_a_function_of_index_and_seed():
    assert mutant(7, 0) == mutant(7, 0)
    assert mutant(7, 0).text != mutant(7, 1).text or mutant(7, 0).edits != mutant(7, 1).edits
    text = "module M(d: int = 4):\n  let:\n    k = d * 2  # c\n"
    assert "".join(tokens(text)) == text  # every character belongs to a token


def test_gentle_mutants_edit_models_and_verify_sizes(tmp_path):
    """`run_fuzz.py --gentle`: small-value edits of files that build or verify; the same
    oracle (a build error but E012 after a clean check is a failure)."""
    programs = [gentle_mutant(i, 0) for i in range(20)]
    assert programs[3] == gentle_mutant(3, 0)
    assert all("\nmodel " in m.text or "verify_backward:" in m.text for m in programs)
    report = fuzz(range(20), seed=0, folder=tmp_path, gentle=True)
    assert not report.failures, report.summary()
    # the build-after-a-clean-check oracle ran (all 20 refused by check would test nothing)
    assert sum(n for k, n in report.tally.items() if k.startswith("built")) > 0, report.tally


def test_a_line_of_a_thousand_errors_prints_a_hundred_cut_short(tmp_path):
    """One diagnostic per repeated token, each echoing the whole line, made 60 MB of text
    from a 20 kB line (quadratic); now 100 diagnostics, each line cut to its marks."""
    path = tmp_path / "many.module"
    path.write_text("module M(" + ", ".join(["q: int"] * 1001) + "):\n  forward:\n"
                    "    in: x: [B, q]\n    out: y: [B, q]\n    graph:\n      x -> relu() -> y\n",
                    encoding="utf-8")
    result = run("check", path)
    assert result.exit_code == 1, result.output
    assert "note: 900 more diagnostics not shown (the first 100 are)" in result.output
    assert max(len(line) for line in result.output.splitlines()) < 300
    assert len(result.output) < 100 * 1000


def test_line_lengths_come_from_the_line_index():
    """Respanning every node of a 200 kB line measured the line by copying it each time
    (found by the fuzz run: 9 s for one check); the index gives the same lengths."""
    from modulec.source import SourceFile

    for text in ["", "a", "\n", "ab\ncd", "ab\ncd\n", "x\n\n\ny", "\r\nab\r\n", "é\n" * 3]:
        source = SourceFile("t", text)
        assert [source._line_length(n) for n in range(1, source.line_count + 1)] == \
            [len(source.line_text(n)) for n in range(1, source.line_count + 1)]
