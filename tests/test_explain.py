"""The pages of docs/errors/ (one per diagnostic code) and `modulec explain`.

Every page's example must fail with exactly its code, its fixed program must check clean,
and its `text` block must be what `modulec check` prints today (page layout and the
`file=` convention: docs/errors/README.md). `MODULEC_BLESS=1` rewrites the `text` blocks
from the compiler's actual output.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from modulec.cli import explain_cmd
from modulec.cli.main import modulec
from modulec.diagnostics.codes import CODES, all_codes

ROOT = Path(__file__).resolve().parent.parent
ERRORS = ROOT / "docs" / "errors"
EXAMPLE = "example.module"
BLESS = os.environ.get("MODULEC_BLESS", "") not in ("", "0")
# A fenced block: ```info\n body ```; the body may be empty.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SECTION = re.compile(r"§[\d.]*\d|Appendix [A-Z]")


# ============================================================================ pages
@dataclass
class Page:
    code: str
    path: Path
    text: str
    example: str | None = None
    fixed: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # `file=` blocks: name -> text
    rendered: str | None = None
    rendered_span: tuple[int, int] | None = None  # the `text` block's body in `text`


def read_page(code: str) -> Page:
    path = ERRORS / f"{code}.md"
    page = Page(code, path, path.read_text(encoding="utf-8"))
    programs = []
    for match in FENCE.finditer(page.text):
        words = match[1].split()
        lang, options = (words[0], words[1:]) if words else ("", [])
        if lang == "module":
            named = [o.split("=", 1)[1] for o in options if o.startswith("file=")]
            if named:
                page.files[named[0]] = match[2]
            else:
                programs.append(match[2])
        elif lang == "text" and page.rendered is None:
            page.rendered, page.rendered_span = match[2], match.span(2)
    page.example, page.fixed = (programs + [None, None])[:2]
    return page


def write_program(folder: Path, page: Page, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in page.files.items():
        target = folder / name
        assert target.resolve().is_relative_to(folder.resolve()), f"{name}: outside the folder"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    (folder / EXAMPLE).write_text(source, encoding="utf-8")
    return folder


def check(folder: Path, *args: str):
    """`modulec check ARGS example.module`, run in `folder` (so paths print as
    `example.module`)."""
    previous = Path.cwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(modulec, ["check", *args, EXAMPLE])
    finally:
        os.chdir(previous)


NO_EFFECT_YET = "W006"


def json_codes(folder: Path) -> tuple[int, list[str]]:
    result = check(folder, "--format", "json")
    assert result.exit_code in (0, 1), f"check crashed or failed to run:\n{result.output}"
    codes = [json.loads(line).get("code") for line in result.stdout.splitlines()
             if line.startswith("{")]
    return result.exit_code, codes


def human_rendering(folder: Path) -> str:
    """What `modulec check --color never example.module` prints: stderr, then stdout."""
    result = check(folder, "--color", "never")
    assert result.exit_code in (0, 1), f"check crashed or failed to run:\n{result.output}"
    out, err = result.stdout, result.stderr
    text = err + ("\n" if err and out else "") + out
    return text.replace(str(folder.resolve()) + os.sep, "").replace(str(folder) + os.sep, "")


PAGES = [info.code for info in all_codes()]


# ============================================================================ the pages
def test_every_code_has_a_page_and_every_page_a_code():
    pages = {p.stem for p in ERRORS.glob("*.md")} - {"README"}
    assert sorted(set(CODES) - pages) == [], "codes without a page in docs/errors/"
    assert sorted(pages - set(CODES)) == [], "pages in docs/errors/ for no code"


@pytest.mark.parametrize("code", PAGES)
def test_page_layout(code):
    page = read_page(code)
    info = CODES[code]
    lines = page.text.splitlines()
    assert lines[0] == f"# {code}: {info.title}", "the title line is `# CODE: title`"
    assert page.example, "no example (the first ```module block without file=)"
    assert page.fixed, "no fixed program (the second ```module block without file=)"
    assert page.rendered is not None, "no ```text block with the compiler's output"
    assert "## Example" in lines and "## How to fix it" in lines
    see_also = [line for line in lines if line.startswith("See also:")]
    assert len(see_also) == 1, "one `See also:` line"
    cited = set(SECTION.findall(see_also[0]))
    wanted = set(SECTION.findall(info.spec))
    assert wanted <= cited, f"`See also` should cite {sorted(wanted - cited)}"


@pytest.mark.parametrize("code", PAGES)
def test_example_fails_with_exactly_its_code(code, tmp_path):
    page = read_page(code)
    status, codes = json_codes(write_program(tmp_path, page, page.example))
    # W006 (an annotation without effect yet) is true of the annotation, not of the
    # page's problem: E025's pipeline stages are `@partition`s, which no runtime runs yet.
    codes = [c for c in codes if c == code or c != NO_EFFECT_YET]
    assert codes and set(codes) == {code}, (
        f"docs/errors/{code}.md: the example must report {code} and nothing else; "
        f"`modulec check` reports {', '.join(codes) if codes else 'no diagnostics'}")
    assert status == (1 if code.startswith("E") else 0)


@pytest.mark.parametrize("code", PAGES)
def test_fixed_example_checks_clean(code, tmp_path):
    page = read_page(code)
    status, codes = json_codes(write_program(tmp_path, page, page.fixed))
    codes = [c for c in codes if c == code or c != NO_EFFECT_YET]  # as above
    assert codes == [] and status == 0, (
        f"docs/errors/{code}.md: the fixed program must check clean; "
        f"`modulec check` reports {', '.join(codes)}")


@pytest.mark.parametrize("code", PAGES)
def test_rendered_output_is_current(code, tmp_path):
    page = read_page(code)
    actual = human_rendering(write_program(tmp_path, page, page.example))
    expected = page.rendered.rstrip("\n")
    actual = actual.rstrip("\n")
    if actual != expected and BLESS and f"[{code}]" in actual:
        start, end = page.rendered_span
        page.path.write_text(page.text[:start] + actual + "\n" + page.text[end:],
                             encoding="utf-8")
        return
    assert actual == expected, (
        f"docs/errors/{code}.md: the ```text block differs from what `modulec check "
        f"--color never {EXAMPLE}` prints (MODULEC_BLESS=1 rewrites it)")


def test_file_blocks_are_written_next_to_the_example(tmp_path):
    page = read_page("E023")
    assert page.files, "E023's example imports helper files given as `file=` blocks"
    folder = write_program(tmp_path, page, page.example)
    for name in page.files:
        assert (folder / name).is_file()


# ============================================================================ explain
def explain(*args: str):
    return CliRunner().invoke(modulec, ["explain", *args])


def test_explain_prints_the_page():
    result = explain("E004")
    assert result.exit_code == 0, result.output
    assert result.stdout == (ERRORS / "E004.md").read_text(encoding="utf-8")


def test_explain_is_case_insensitive():
    assert explain("w004").stdout == explain("W004").stdout != ""
    assert explain("w004").exit_code == 0


def test_explain_plain_prints_markdown():
    result = explain("--plain", "E017")
    assert result.exit_code == 0
    assert result.stdout.startswith("# E017: Tensor redefinition")
    assert "```module" in result.stdout


def test_explain_renders_markdown_on_a_terminal():
    out = io.StringIO()
    explain_cmd.render_markdown((ERRORS / "E017.md").read_text(encoding="utf-8"), out,
                                force_terminal=True)
    text = out.getvalue()
    assert "E017: Tensor redefinition" in text and "\x1b[" in text
    assert "```" not in text and "# E017" not in text


def test_unknown_code_exits_2_with_suggestions_and_the_list():
    result = explain("E099")
    assert result.exit_code == 2
    assert "no diagnostic code `E099`" in result.stderr
    assert "did you mean " in result.stderr and "`E009`" in result.stderr
    assert "E001, E002" in result.stderr and "W005" in result.stderr
    assert result.stdout == ""


def test_short_code_is_not_accepted_but_suggested():
    result = explain("E4")
    assert result.exit_code == 2
    assert "did you mean `E004`?" in result.stderr


def test_missing_code_is_a_usage_error():
    assert explain().exit_code == 2
    assert explain("--list", "E004").exit_code == 2


def test_list_prints_code_severity_and_title():
    result = explain("--list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert len(lines) == len(CODES)
    for line, info in zip(lines, all_codes()):
        assert line.split()[:2] == [info.code, info.severity.value]
        assert line.endswith(info.title)


def test_pages_are_found_where_the_package_looks():
    # `modulec.paths.data_dir("docs")`: modulec/_data/docs in a wheel, docs/ in a checkout
    assert explain_cmd.page_text("E001") == (ERRORS / "E001.md").read_text(encoding="utf-8")


def test_a_code_without_a_page_falls_back_to_the_table(monkeypatch, tmp_path):
    monkeypatch.setattr(explain_cmd, "errors_dir", lambda: tmp_path)
    result = explain("E017")
    assert result.exit_code == 0
    assert result.stdout.startswith("# E017: Tensor redefinition")
    assert CODES["E017"].explanation in result.stdout
