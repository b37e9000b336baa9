"""The `modulec` command line: commands, output streams, exit statuses, crash reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from modulec import __version__
from modulec.cli.main import modulec
from modulec.diagnostics import error, warning
from modulec.syntax import parser
from modulec.syntax.parser import ParseResult, parse_text

REPO = Path(__file__).resolve().parent.parent

VALID = textwrap.dedent("""\
    module M(d: int):
      params:
        w: [d, d]
      forward:
        in: [B, d]
        out: [B, d]
        graph:
          in -> matmul(w, transpose=NT) -> out
    """)
INVALID = "module M(:\n"
MISSING_DESTINATION = VALID.replace("-> out\n", "->\n")


def run(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(modulec, [str(a) for a in args])


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def fake_parser(monkeypatch, make):
    """Replace parse_source; `make(source)` returns the diagnostics of each file."""
    def parse_source(source, *rest):
        return ParseResult(None, tuple(make(source)))
    monkeypatch.setattr(parser, "parse_source", parse_source)


def e001(source):
    return [error("E001", "unexpected `:`", source.span(9, 10), "unexpected here")]


def real_parser_reports_e001(text: str) -> None:
    """Use the real parser, but xfail (not fail) while its error recovery is unfinished."""
    try:
        result = parse_text(text, "probe.module")
    except Exception as exc:  # noqa: BLE001
        pytest.xfail(f"parser raises on invalid input: {type(exc).__name__}")
    assert not result.ok


# ====================================================================== version, help, startup
def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout == f"modulec {__version__}\n"


def test_python_dash_m_version():
    done = subprocess.run([sys.executable, "-m", "modulec", "--version"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "modulec 0.1.0\n"


def test_help_shows_examples():
    result = run("--help")
    assert result.exit_code == 0
    for example in ["modulec check model.module", "modulec check --format json std/",
                    "modulec parse --emit ast examples/llama.module"]:
        assert example in result.stdout
    assert "--path DIR" in run("check", "--help").stdout


def test_startup_imports_no_heavy_modules(tmp_path):
    path = write(tmp_path, "m.module", VALID)
    code = textwrap.dedent(f"""\
        import sys
        import modulec.cli.main as m
        print(sorted(k for k in ("lark", "rich", "torch") if k in sys.modules))
        from click.testing import CliRunner
        assert CliRunner().invoke(m.modulec, ["check", {str(path)!r}]).exit_code == 0
        print("torch" in sys.modules)
        """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "False"]


# ====================================================================== parse
def test_parse_valid_file(tmp_path):
    result = run("parse", write(tmp_path, "m.module", VALID))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout == "parsed 1 file: no problems found\n"


def test_emit_ast_reparses(tmp_path):
    result = run("parse", "--emit", "ast", write(tmp_path, "m.module", VALID))
    assert result.exit_code == 0, result.output
    again = parse_text(result.stdout)
    assert again.ok
    assert again.program == parse_text(VALID).program


def test_emit_ast_several_files_has_headers(tmp_path):
    a, b = write(tmp_path, "a.module", VALID), write(tmp_path, "b.module", VALID)
    result = run("parse", "--emit", "ast", a, b)
    assert result.exit_code == 0
    headers = [line for line in result.stdout.splitlines() if line.startswith("# file:")]
    assert headers == [f"# file: {a}", f"# file: {b}"]
    assert parse_text(result.stdout).ok  # the headers are comments


def test_emit_tree_prints_dataclasses(tmp_path):
    result = run("parse", "--emit", "tree", write(tmp_path, "m.module", VALID))
    assert result.exit_code == 0
    assert result.stdout.startswith("Program(")


def test_emit_with_json_is_a_usage_error(tmp_path):
    result = run("parse", "--emit", "ast", "--format", "json", write(tmp_path, "m.module", VALID))
    assert result.exit_code == 2
    assert "--emit cannot be combined" in result.stderr


@pytest.mark.parametrize("text", [INVALID, MISSING_DESTINATION], ids=["paren", "flow"])
def test_syntax_error_with_real_parser(tmp_path, text):
    real_parser_reports_e001(text)
    result = run("parse", write(tmp_path, "bad.module", text))
    assert result.exit_code == 1
    assert "error[E001]" in result.stderr and " --> " in result.stderr
    assert result.stdout == ""


def test_syntax_error_human_layout(tmp_path, monkeypatch):
    fake_parser(monkeypatch, e001)
    path = write(tmp_path, "bad.module", INVALID)
    result = run("check", "--color", "never", path)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error[E001]: unexpected `:`\n")
    assert f" --> {path}:1:10" in result.stderr
    assert result.stderr.endswith("\n\nerror: could not check 1 file: 1 error emitted\n")


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_json_lines(tmp_path, monkeypatch, fake):
    if fake:
        fake_parser(monkeypatch, e001)
    else:
        real_parser_reports_e001(INVALID)
    paths = [write(tmp_path, name, INVALID) for name in ("a.module", "b.module")]
    result = run("check", "--format", "json", *paths)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) >= 2
    for line in lines:
        obj = json.loads(line)
        assert obj["code"] == "E001" and obj["level"] == "error"
        assert obj["message"] and obj["spans"]
    files = [json.loads(line)["spans"][0]["file_name"] for line in lines]
    assert files[0] == str(paths[0]) and files[-1] == str(paths[1])
    assert "error:" not in result.stderr  # no summary line in json mode


def test_warnings_only_exit_zero(tmp_path, monkeypatch):
    fake_parser(monkeypatch, lambda s: [warning("W001", "shadows a primitive", s.span(0, 6))])
    result = run("check", write(tmp_path, "m.module", VALID))
    assert result.exit_code == 0
    assert "warning[W001]" in result.stderr
    assert result.stdout == "checked 1 file: 1 warning emitted\n"


def test_color_choice(tmp_path, monkeypatch):
    fake_parser(monkeypatch, e001)
    path = write(tmp_path, "bad.module", INVALID)
    assert "\x1b[" in run("check", "--color", "always", path).stderr
    assert "\x1b[" not in run("check", "--color", "never", path).stderr
    assert "\x1b[" not in run("check", path).stderr  # auto: stderr is not a terminal


# ====================================================================== check: inputs, passes
def test_folder_recursion_is_sorted_and_skips_hidden(tmp_path, monkeypatch):
    fake_parser(monkeypatch, e001)
    for name in ["z.module", "a/b/deep.module", "a/x.module", "a/.hidden/h.module",
                 "a/notes.txt", ".h.module"]:
        write(tmp_path, name, INVALID)
    result = run("check", "--format", "json", tmp_path)
    files = [json.loads(line)["spans"][0]["file_name"] for line in result.stdout.splitlines()]
    rel = [Path(f).relative_to(tmp_path).as_posix() for f in files]
    assert rel == ["a/b/deep.module", "a/x.module", "z.module"]


def test_folder_of_valid_files(tmp_path):
    write(tmp_path, "one.module", VALID)
    write(tmp_path, "sub/two.module", VALID)
    result = run("check", tmp_path, tmp_path / "one.module")  # each file checked once
    assert result.exit_code == 0, result.output
    assert result.stdout == "checked 2 files: no problems found\n"


def test_search_path_option(tmp_path):
    path = write(tmp_path, "m.module", VALID)
    assert run("check", "--path", tmp_path, "--path", tmp_path, path).exit_code == 0
    result = run("check", "--path", tmp_path / "nope", path)
    assert result.exit_code == 2


@pytest.mark.parametrize("command", ["parse", "check"])
def test_missing_file_is_usage_error(tmp_path, command):
    result = run(command, tmp_path / "nope.module")
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


def test_unreadable_file_is_an_error(tmp_path):
    path = tmp_path / "latin1.module"
    path.write_bytes(b"module M\xe9\n")
    result = run("check", path)
    assert result.exit_code == 1
    assert f"cannot read {path}: not valid UTF-8" in result.stderr


def test_unknown_sections_and_syntax_errors_are_reported_together(tmp_path):
    text = ("module M():\n  forwrd:\n    graph:\n      x -> y\n"
            "module N():\n  forward:\n    graph:\n      x -> ->\n")
    result = run("check", "--format", "json", write(tmp_path, "m.module", text))
    assert result.exit_code == 1
    messages = [json.loads(line)["message"] for line in result.stdout.splitlines()]
    assert messages == ["unexpected `->`", "unknown section `forwrd` in module `M`"]


# ====================================================================== internal errors
def crash(monkeypatch):
    def parse_source(source, *rest):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(parser, "parse_source", parse_source)


@pytest.mark.parametrize("command", ["parse", "check"])
def test_internal_error_is_short(tmp_path, monkeypatch, command):
    crash(monkeypatch)
    path = write(tmp_path, "m.module", VALID)
    result = run(command, path, env={"MODULEC_BACKTRACE": None})
    assert result.exit_code == 101
    assert result.stderr.startswith("error: internal compiler error: RuntimeError: boom\n")
    assert "note: this is a bug in modulec; please report it" in result.stderr
    assert f"note: while processing {path}" in result.stderr
    assert re.search(r"modulec/[\w/]+\.py:\d+", result.stderr)
    assert "Traceback" not in result.output and "second line" not in result.stderr


def test_internal_error_backtrace_on_request(tmp_path, monkeypatch):
    crash(monkeypatch)
    result = run("check", write(tmp_path, "m.module", VALID), env={"MODULEC_BACKTRACE": "1"})
    assert result.exit_code == 101
    assert "Traceback (most recent call last)" in result.stderr
    assert "error: internal compiler error: RuntimeError: boom" in result.stderr


def test_console_script_entry_point():
    from modulec.cli.main import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0


def test_a_submodule_called_like_a_method_gets_a_submodule_hint():
    result = run("check", "tests/ui/check/e014_submodule_attribute_call.module")
    assert result.exit_code == 1
    assert "`ln` is a parameter of `Block`, not an imported module" in result.output
    assert "import std.modules.linear as L" not in result.output


@pytest.mark.parametrize("args, named", [
    (["--set", "n=3"], "--set is read only"),
    (["--shape", "B=3", "--epsilon", "1e-3"], "--shape, --epsilon are read only"),
    (["--tolerance", "1"], "--tolerance is read only"),
])
def test_check_verify_options_without_the_flag_are_usage_errors(tmp_path, args, named):
    """`check --set n=3` (no --verify-backward) set nothing and said nothing."""
    path = write(tmp_path, "m.module", "module M():\n  let:\n    k = 1\n")
    result = run("check", path, *args)
    assert result.exit_code == 2 and f"{named} with --verify-backward" in result.output
