"""`modulec fmt`: idempotent, meaning-preserving, comments kept, over every corpus."""

import glob

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.paths import REPO_DIR
from modulec.syntax.comments import comments_of
from modulec.syntax.format import format_source
from modulec.syntax.parser import parse_text
from spec_blocks import declaration_blocks

FILES = sorted(glob.glob(str(REPO_DIR / "std/**/*.module"), recursive=True)
               + glob.glob(str(REPO_DIR / "examples/*.module")))
CORPUS = [(path, open(path, encoding="utf-8").read()) for path in FILES] + \
    [(f"spec line {line}", text) for line, text in declaration_blocks()]


@pytest.mark.parametrize("name, text", CORPUS, ids=[c[0].rsplit("/", 1)[-1] for c in CORPUS])
def test_fmt_is_idempotent_meaning_preserving_and_keeps_comments(name, text):
    tree = parse_text(text, name).program
    formatted = format_source(tree, text)
    again = parse_text(formatted, name)
    assert again.ok and again.program == tree
    assert format_source(again.program, formatted) == formatted
    assert [c.text for c in comments_of(formatted)] == [c.text for c in comments_of(text)]
    code = [line.split("  #")[0] for line in formatted.splitlines()
            if not line.lstrip().startswith("#")]
    assert all(len(line) <= 100 or '"' in line for line in code)


SOURCE = ("module   M(d:int):   # the module\n  params:\n      w: [d,d]  # weight\n"
          "  forward:\n    in: x: [B, d]\n    out: [B, d]\n    graph:\n"
          "      (x, w) -> matmul(transpose=NT)\n        -> out\n")


def test_check_shows_a_diff_and_fails(tmp_path):
    path = tmp_path / "m.module"
    path.write_text(SOURCE)
    result = CliRunner().invoke(modulec, ["fmt", "--check", str(path)])
    assert result.exit_code == 1 and "+module M(d: int):  # the module" in result.stdout
    assert path.read_text() == SOURCE


def test_fmt_rewrites_then_check_passes(tmp_path):
    path = tmp_path / "m.module"
    path.write_text(SOURCE)
    assert CliRunner().invoke(modulec, ["fmt", str(path)]).exit_code == 0
    assert "(x, w) -> matmul(transpose=NT) -> out" in path.read_text()
    assert CliRunner().invoke(modulec, ["fmt", "--check", str(path)]).exit_code == 0


def test_syntax_errors_leave_the_file_alone(tmp_path):
    path = tmp_path / "bad.module"
    path.write_text("module M(:\n")
    result = CliRunner().invoke(modulec, ["fmt", str(path)])
    assert result.exit_code == 1 and "error[E001]" in result.stderr
    assert path.read_text() == "module M(:\n"
