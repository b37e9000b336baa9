"""`modulec explain CODE`: print the page of a diagnostic code (docs/errors/CODE.md).

The pages ship with the package as `modulec/_data/docs/errors/` (in a checkout: the
repository's `docs/errors/`). On a terminal the page is rendered with rich's Markdown;
otherwise, or with `--plain`, the markdown text is printed as it is. `--list` prints every
code with its severity and title; `--annotations` prints docs/annotations.md (what each
annotation does on each backend, from modulec/check/annotation_status.py).

Exit status: 0 success, 2 an unknown code (with "did you mean" and the list of codes) or a
missing argument.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from modulec.cli.guard import EXIT_OK, EXIT_USAGE, guarded

SHORT_CODE = re.compile(r"([EW])0*(\d{1,3})")


def errors_dir() -> Path:
    """Where the pages are: the packaged copy if there is one, else the checkout's."""
    from modulec.paths import data_dir

    return data_dir("docs") / "errors"


def page_text(code: str) -> str | None:
    """The markdown page of a known `code` ("E004"), or None if it has no page file."""
    path = errors_dir() / f"{code}.md"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def fallback_page(info) -> str:
    """A page built from the code table, for an installation that lacks the pages."""
    spec = f"\n\nSee also: spec {info.spec}." if info.spec else ""
    return f"# {info.code}: {info.title}\n\n{info.explanation}{spec}\n"


def suggestions(word: str, codes: list[str]) -> list[str]:
    """Codes close to `word`: `E4` -> `E004`, `E0044` -> `E004`, `E099` -> `E009`..."""
    import difflib

    upper = word.strip().upper()
    short = SHORT_CODE.fullmatch(upper)
    if short:
        padded = f"{short[1]}{int(short[2]):03}"
        if padded in codes and padded != upper:
            return [padded]
    return difflib.get_close_matches(upper, codes, n=3, cutoff=0.6)


def render_markdown(text: str, file=None, *, force_terminal: bool | None = None) -> None:
    """Print `text` rendered by rich (headings, emphasis, code blocks) to `file`."""
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(file=file, force_terminal=force_terminal, soft_wrap=False)
    console.print(Markdown(text, code_theme="ansi_dark"))


def list_codes() -> str:
    from modulec.diagnostics.codes import all_codes

    rows = [(i.code, i.severity.value, i.title) for i in all_codes()]
    width = max(len(r[1]) for r in rows)
    return "".join(f"{code}  {severity:<{width}}  {title}\n" for code, severity, title in rows)


EPILOG = """\b
Examples:
  modulec explain E004
  modulec explain --list
  modulec explain --annotations > docs/annotations.md
"""


@click.command(short_help="Explain a diagnostic code (E004, W003, ...).", epilog=EPILOG)
@click.argument("code", metavar="CODE", required=False)
@click.option("--list", "list_", is_flag=True,
              help="List every code with its severity and title.")
@click.option("--plain", is_flag=True,
              help="Print the page as markdown text even on a terminal.")
@click.option("--annotations", is_flag=True,
              help="Print what every annotation does on each backend (docs/annotations.md "
                   "is this page).")
@guarded
def explain_command(code: str | None, list_: bool, plain: bool, annotations: bool) -> int:
    """Explain the diagnostic CODE (E001 ... E027, W001 ... W007): what it means, an
    example that produces it, and how to fix it."""
    from modulec.diagnostics.codes import CODES

    if annotations:
        if code is not None or list_:
            raise click.UsageError("give --annotations alone")
        from modulec.check.annotation_doc import annotations_page

        click.echo(annotations_page(), nl=False)
        return EXIT_OK
    if list_:
        if code is not None:
            raise click.UsageError("give either CODE or --list, not both")
        click.echo(list_codes(), nl=False)
        return EXIT_OK
    if code is None:
        raise click.UsageError("missing CODE (or --list to see every code)")
    key = code.strip().upper()
    info = CODES.get(key)
    if info is None:
        lines = [f"error: no diagnostic code `{code}`"]
        close = suggestions(code, list(CODES))
        if close:
            quoted = [f"`{c}`" for c in close]
            either = quoted[0] if len(quoted) == 1 else \
                ", ".join(quoted[:-1]) + " or " + quoted[-1]
            lines.append(f"help: did you mean {either}?")
        lines.append("note: the codes are " + ", ".join(CODES))
        lines.append("note: `modulec explain --list` lists them with their titles")
        click.echo("\n".join(lines), err=True)
        return EXIT_USAGE
    text = page_text(info.code) or fallback_page(info)
    if not plain and sys.stdout.isatty():
        render_markdown(text)
    else:
        click.echo(text, nl=not text.endswith("\n"))
    return EXIT_OK
