"""The `modulec` command line: `parse` and `check`, with rustc-style exit statuses.

Exit status: 0 success (warnings allowed), 1 error diagnostics, 2 usage error (click's own,
and missing files), 101 internal compiler error: a bug in modulec, reported in a few lines
(MODULEC_BACKTRACE=1 adds the traceback).

Startup stays fast: only click is imported here; the parser (lark) and the diagnostic
renderers (rich) are imported inside the functions that use them, and torch never is.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from modulec import __version__

if TYPE_CHECKING:
    from modulec.diagnostics import Diagnostic
    from modulec.source import SourceFile

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 101
MODULE_SUFFIX = ".module"
BACKTRACE_ENV = "MODULEC_BACKTRACE"
_CURRENT_FILE = "modulec.current_file"  # key in click's ctx.meta, named in crash reports

EPILOG = """\b
Examples:
  modulec check model.module
  modulec check --format json std/
  modulec parse --emit ast examples/llama.module

\b
Exit status: 0 success (warnings allowed), 1 errors found, 2 usage error,
101 internal compiler error (set MODULEC_BACKTRACE=1 to see its backtrace).
"""

_FORMAT = click.Choice(["human", "json"])
_COLOR = click.Choice(["auto", "always", "never"])


@dataclass
class FileResult:
    """One input file: its text (None when it could not be read), tree and diagnostics."""

    name: str
    source: SourceFile | None
    program: object | None
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


@dataclass(frozen=True)
class CheckOptions:
    """Settings of `check` that later passes use (the import resolver reads `search_path`)."""

    search_path: tuple[Path, ...] = ()


# ====================================================================== commands
@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, "-V", "--version", prog_name="modulec",
                      message="%(prog)s %(version)s")
def modulec() -> None:
    """Compiler for the Module DSL."""


def output_options(command):
    """`--format` and `--color`, shared by the commands that report diagnostics."""
    command = click.option(
        "--color", type=_COLOR, default="auto", show_default=True,
        help="Color human output (auto: when stderr is a terminal and NO_COLOR is unset).",
    )(command)
    return click.option(
        "--format", "fmt", type=_FORMAT, default="human", show_default=True,
        help="human: rustc-style text on stderr; json: one JSON object per diagnostic "
             "on stdout (and nothing else there).",
    )(command)


def guarded(command):
    """Run a command that returns its exit status; any unexpected exception becomes a short
    internal-compiler-error report and exit status 101."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        try:
            status = command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # usage errors and explicit exits keep click's handling
        except BrokenPipeError:  # `modulec parse --emit ast x.module | head`
            _silence_stdout()
            status = EXIT_ERRORS
        except Exception as exc:  # noqa: BLE001 - this is the crash handler
            report_internal_error(exc, ctx.meta.get(_CURRENT_FILE))
            status = EXIT_INTERNAL
        ctx.exit(status)

    return wrapper


@modulec.command()
@click.argument("files", metavar="FILE...", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--emit", type=click.Choice(["ast", "tree"]),
              help="Print each tree: ast = canonical source text, tree = dataclass repr.")
@output_options
@guarded
def parse(files: tuple[Path, ...], emit: str | None, fmt: str, color: str) -> int:
    """Parse FILE... and report syntax errors."""
    if emit and fmt == "json":
        raise click.UsageError("--emit cannot be combined with --format json "
                               "(both write to stdout)")
    out = Output(fmt, use_color(color))
    results = []
    for path in files:
        result = out.show(parse_one(path))
        if emit and result.ok:
            emit_tree(result, emit, header=len(files) > 1, first=not results)
        results.append(result)
    out.summary(results, "parse", "parsed", success_to_stdout=not emit)
    return exit_status(results)


@modulec.command()
@click.argument("inputs", metavar="FILE_OR_DIR...", nargs=-1, required=True,
                type=click.Path(exists=True, path_type=Path))
@click.option("--path", "search_path", metavar="DIR", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Add DIR to the import search path (repeatable; searched in order).")
@output_options
@guarded
def check(inputs: tuple[Path, ...], search_path: tuple[Path, ...], fmt: str,
          color: str) -> int:
    """Check FILE_OR_DIR... for errors.

    Folders are searched recursively for *.module files (hidden folders are skipped).
    """
    options = CheckOptions(search_path=search_path)
    out = Output(fmt, use_color(color))
    results = [out.show(check_one(path, options)) for path in collect_module_files(inputs)]
    out.summary(results, "check", "checked")
    return exit_status(results)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`modulec = "modulec.cli.main:main"`)."""
    modulec.main(args=argv, prog_name="modulec")


# ====================================================================== per file
def parse_one(path: Path) -> FileResult:
    from modulec.source import SourceFile
    from modulec.syntax import parser  # looked up per call, so tests can patch parse_source

    click.get_current_context().meta[_CURRENT_FILE] = str(path)
    try:
        source = SourceFile.read(path)
    except (OSError, UnicodeDecodeError) as exc:
        return unreadable(path, exc)
    result = parser.parse_source(source)
    return FileResult(source.name, source, result.program, list(result.diagnostics))


def check_one(path: Path, options: CheckOptions) -> FileResult:
    """Parse, then the passes that exist so far. `options.search_path` awaits the resolver."""
    result = parse_one(path)
    check_sections = section_checker()
    # A recovered tree would only add follow-on errors, so later passes need a clean parse.
    if check_sections is not None and result.ok and result.program is not None:
        result.diagnostics.extend(check_sections(result.program))
    return result


def section_checker():
    """`modulec.syntax.sections.check_sections`, or None while that module does not exist."""
    try:
        from modulec.syntax.sections import check_sections
    except ModuleNotFoundError as exc:
        if exc.name != "modulec.syntax.sections":
            raise  # the module exists but is broken: an internal error, not "absent"
        return None
    return check_sections


def unreadable(path: Path, exc: Exception) -> FileResult:
    from modulec.diagnostics import error

    if isinstance(exc, UnicodeDecodeError):
        reason = f"not valid UTF-8 (byte offset {exc.start})"
    else:
        reason = getattr(exc, "strerror", None) or str(exc)
    return FileResult(str(path), None, None, [error("", f"cannot read {path}: {reason}", None)])


def collect_module_files(inputs: tuple[Path, ...]) -> list[Path]:
    """Files as given, folders expanded (sorted); each file once, at its first mention."""
    seen: set[Path] = set()
    files = []
    for item in inputs:
        for path in module_files_under(item) if item.is_dir() else [item]:
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files


def module_files_under(folder: Path) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names
                  if n.endswith(MODULE_SUFFIX) and not n.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def emit_tree(result: FileResult, kind: str, *, header: bool, first: bool) -> None:
    if header:
        click.echo(("" if first else "\n") + f"# file: {result.name}")
    if kind == "ast":
        from modulec.syntax.printer import print_program

        click.echo(print_program(result.program), nl=False)
    else:
        import pprint

        click.echo(pprint.pformat(result.program, width=100))


def exit_status(results: list[FileResult]) -> int:
    return EXIT_OK if all(r.ok for r in results) else EXIT_ERRORS


# ====================================================================== output
def use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


class Output:
    """Diagnostics as they come (human: stderr, json: stdout), then a summary line."""

    def __init__(self, fmt: str, color: bool) -> None:
        self.json = fmt == "json"
        self.color = color
        self.wrote_stderr = False

    def show(self, result: FileResult) -> FileResult:
        from modulec.diagnostics import render_human, render_json_lines

        if not result.diagnostics:
            return result
        sources = {result.source.name: result.source} if result.source else {}
        if self.json:
            click.echo(render_json_lines(result.diagnostics, sources), nl=False)
        else:
            self.stderr(render_human(result.diagnostics, sources, color=self.color))
        return result

    def summary(self, results: list[FileResult], verb: str, done: str, *,
                success_to_stdout: bool = True) -> None:
        """`error: could not check 2 files: 3 errors emitted` / `checked 3 files: ...`."""
        if self.json:
            return
        from modulec.diagnostics import summary_line

        counts = summary_line(d for r in results for d in r.diagnostics)
        failed = sum(1 for r in results if not r.ok)
        if failed:
            label = click.style("error", fg="red", bold=True) if self.color else "error"
            self.stderr(f"{label}: could not {verb} {plural(failed, 'file')}: {counts}\n")
        elif success_to_stdout:
            click.echo(f"{done} {plural(len(results), 'file')}: {counts}")

    def stderr(self, text: str) -> None:
        # A blank line between blocks, as rustc leaves after each diagnostic.
        click.echo(("\n" if self.wrote_stderr else "") + text, err=True, nl=False,
                   color=self.color)
        self.wrote_stderr = True


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# ====================================================================== crashes
def report_internal_error(exc: BaseException, current_file: str | None) -> None:
    backtrace = os.environ.get(BACKTRACE_ENV, "") not in ("", "0")
    if backtrace:
        import traceback

        click.echo("".join(traceback.format_exception(exc)), err=True, nl=False)
    lines = [f"error: internal compiler error: {describe(exc)}",
             "note: this is a bug in modulec; please report it with the file that triggered it"]
    if current_file:
        lines.append(f"note: while processing {current_file}")
    location = innermost_modulec_frame(exc)
    if location:
        lines.append(f"note: in {location}")
    if not backtrace:
        lines.append(f"note: run with {BACKTRACE_ENV}=1 to see the backtrace")
    click.echo("\n".join(lines), err=True)


def describe(exc: BaseException) -> str:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{name}: {first}" if first else name


def innermost_modulec_frame(exc: BaseException) -> str | None:
    """`modulec/syntax/parser.py:87 (parse_source)`: the deepest frame in this package."""
    import traceback

    from modulec.paths import PACKAGE_DIR

    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(PACKAGE_DIR):
            shown = path.relative_to(PACKAGE_DIR.parent).as_posix()
            return f"{shown}:{frame.lineno} ({frame.name})"
    return None


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
