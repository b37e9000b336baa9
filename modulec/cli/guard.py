"""Exit statuses, and the crash handler that turns any unexpected exception into a short
internal-compiler-error report (exit status 101) instead of a raw traceback."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 101
BACKTRACE_ENV = "MODULEC_BACKTRACE"
CURRENT_FILE = "modulec.current_file"  # key in click's ctx.meta, named in crash reports


def guarded(command):
    """Wrap a command that returns its exit status: usage errors keep click's handling, any
    other exception is reported as an internal compiler error (exit status 101)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        try:
            status = command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:  # `modulec parse --emit ast x.module | head`
            silence_stdout()
            status = EXIT_ERRORS
        except Exception as exc:  # noqa: BLE001 - this is the crash handler
            report_internal_error(exc, ctx.meta.get(CURRENT_FILE))
            status = EXIT_INTERNAL
        ctx.exit(status)

    return wrapper


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
    """`RuntimeError: first line of the message` (non-builtin types with their module)."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 200:
        first = first[:197] + "..."
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


def silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
