"""Where diagnostics go: human text on stderr (then a summary line), or JSON lines on stdout."""

from __future__ import annotations

import os
import sys

import click

from modulec.cli.inputs import FileResult


def use_color(choice: str) -> bool:
    """`--color`: auto colors when stderr is a terminal and NO_COLOR is unset (or empty)."""
    if choice != "auto":
        return choice == "always"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


class Output:
    """Diagnostics as each file is done (human: stderr, json: stdout), then a summary line."""

    def __init__(self, fmt: str, color: bool) -> None:
        self.json = fmt == "json"
        self.color = color
        self.wrote_stderr = False

    def show(self, result: FileResult) -> FileResult:
        if not result.diagnostics:
            return result
        from modulec.diagnostics import render_human, render_json_lines

        sources = {result.source.name: result.source} if result.source else {}
        if self.json:
            click.echo(render_json_lines(result.diagnostics, sources), nl=False)
        else:
            self.stderr(render_human(result.diagnostics, sources, color=self.color))
        return result

    def summary(self, results: list[FileResult], verb: str, done: str, *,
                success_to_stdout: bool = True) -> None:
        """`error: could not check 2 files: 3 errors emitted` on stderr, or on success
        `checked 3 files: no problems found` on stdout. Nothing in json mode."""
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
