"""The `modulec` command line: `parse` and `check`, with rustc-style exit statuses.

Exit status: 0 success (warnings allowed), 1 error diagnostics, 2 usage error (click's own,
and missing files), 101 internal compiler error: a bug in modulec, reported in a few lines
(MODULEC_BACKTRACE=1 adds the traceback).

Startup stays fast: only click is imported at startup; the parser (lark) and the diagnostic
renderers (rich) are imported inside the functions that use them, and torch never is.
"""

from __future__ import annotations

from pathlib import Path

import click

from modulec import __version__
from modulec.cli.guard import EXIT_ERRORS, EXIT_OK, guarded
from modulec.cli.inputs import (
    CheckOptions, FileResult, check_one, collect_module_files, parse_one,
)
from modulec.cli.output import Output, use_color

EPILOG = """\b
Examples:
  modulec check model.module
  modulec check --format json std/
  modulec parse --emit ast examples/llama.module

\b
Exit status: 0 success (warnings allowed), 1 errors found, 2 usage error,
101 internal compiler error (set MODULEC_BACKTRACE=1 to see its backtrace).
"""


class LazyGroup(click.Group):
    """Subcommands are imported when used, so `modulec check` loads none of the others."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS and name not in self.commands:
            self.add_command(LAZY_COMMANDS[name](), name)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EPILOG)
@click.version_option(__version__, "-V", "--version", prog_name="modulec",
                      message="%(prog)s %(version)s")
def modulec() -> None:
    """Compiler for the Module DSL."""


def output_options(command):
    """`--format` and `--color`, shared by the commands that report diagnostics."""
    command = click.option(
        "--color", type=click.Choice(["auto", "always", "never"]), default="auto",
        show_default=True,
        help="Color human output (auto: when stderr is a terminal and NO_COLOR is unset).",
    )(command)
    return click.option(
        "--format", "fmt", type=click.Choice(["human", "json"]), default="human",
        show_default=True,
        help="human: rustc-style text on stderr; json: one JSON object per diagnostic "
             "on stdout (and nothing else there).",
    )(command)


@modulec.command()
@click.argument("files", metavar="FILE...", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--emit", type=click.Choice(["ast", "tree"]),
              help="Print each tree: ast = canonical source text, tree = dataclass repr "
                   "(a debug aid). Several files: each after a `# file: NAME` line.")
@output_options
@guarded
def parse(files: tuple[Path, ...], emit: str | None, fmt: str, color: str) -> int:
    """Parse FILE... and report syntax errors."""
    if emit and fmt == "json":
        raise click.UsageError("--emit cannot be combined with --format json "
                               "(both write to stdout)")
    out = Output(fmt, use_color(color))
    results: list[FileResult] = []
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
@click.option("--emit", type=click.Choice(["resolved"]),
              help="Print the checked program with every inferred shape.")
@click.option("--verify-backward", is_flag=True,
              help="Check every backward by finite differences (float64, needs torch).")
@click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
              help="With --verify-backward: set a parameter of each declaration.")
@click.option("--shape", "shapes", multiple=True, metavar="DIM=SIZE",
              help="With --verify-backward: size a free dim (default B=2, T=4, others 3).")
@click.option("--epsilon", type=float, help="With --verify-backward: the step (default 1e-6).")
@click.option("--tolerance", type=float,
              help="With --verify-backward: the max relative error (default 1e-6).")
@output_options
@guarded
def check(inputs: tuple[Path, ...], search_path: tuple[Path, ...], emit: str | None,
          verify_backward: bool, settings, shapes, epsilon, tolerance,
          fmt: str, color: str) -> int:
    """Check FILE_OR_DIR... for errors.

    Folders are searched recursively for *.module files (in sorted order; hidden files
    and folders are skipped). With --verify-backward, every module, block and model that
    checks cleanly is also run forward and backward on random inputs in float64, and each
    gradient is compared with central finite differences.
    """
    from modulec.resolve import Resolver

    _verify_options_need_the_flag(verify_backward, settings, shapes, epsilon, tolerance)
    options = CheckOptions(search_path=search_path)
    out = Output(fmt, use_color(color))
    resolver = Resolver(options.search_path)  # one per run: each file is parsed once
    checked: list | None = [] if emit else None
    results = [out.show(check_one(path, options, resolver, checked))
               for path in collect_module_files(inputs)]
    if emit:
        from modulec.check.resolved import print_resolved

        click.echo(print_resolved(checked), nl=False)
    # with --verify-backward, "no problems found" waits for the gradients
    out.summary(results, "check", "checked", success_to_stdout=not emit and not verify_backward)
    status = exit_status(results)
    if verify_backward:
        from modulec.cli.build_cmd import pairs
        from modulec.cli.verify_cmd import verify_files

        options = {"settings": pairs(settings, "--set", False),
                   "shapes": pairs(shapes, "--shape", True), "epsilon": epsilon,
                   "tolerance": tolerance, "search_path": tuple(search_path)}
        if not verify_files(results, options, fmt, use_color(color)):
            status = EXIT_ERRORS
        elif status == EXIT_OK and not emit:
            out.summary(results, "check", "checked")
    return status


def _verify_options_need_the_flag(verify_backward: bool, settings, shapes, epsilon,
                                  tolerance) -> None:
    """`check --set n=3` without --verify-backward set nothing and said nothing."""
    given = [name for name, value in (("--set", settings), ("--shape", shapes),
                                      ("--epsilon", epsilon), ("--tolerance", tolerance))
             if value not in (None, ())]
    if given and not verify_backward:
        raise click.UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} "
                               "read only with --verify-backward")


def _factory(module: str, name: str, *args):
    def make():
        from importlib import import_module

        command = getattr(import_module(module), name)
        return command(*args) if args else command
    return make


LAZY_COMMANDS = {
    "lock": _factory("modulec.cli.lock_cmd", "lock_command", output_options),
    "explain": _factory("modulec.cli.explain_cmd", "explain_command"),
    "lsp": _factory("modulec.lsp", "lsp_command"),
    "build": _factory("modulec.cli.build_cmd", "build_command", output_options, guarded),
    "ir": _factory("modulec.cli.build_cmd", "ir_command", guarded),
    "plan": _factory("modulec.cli.plan_cmd", "plan_command", output_options, guarded),
    "graph": _factory("modulec.cli.graph_cmd", "graph_command", guarded),
    "fmt": _factory("modulec.cli.fmt_cmd", "fmt_command", output_options, guarded),
    "run": _factory("modulec.cli.run_cmd", "run_command", guarded),
    "train": _factory("modulec.cli.train_cmd", "train_command", guarded),
    "report": _factory("modulec.cli.report_cmd", "report_command", guarded),
    "data": _factory("modulec.cli.data_cmd", "data_command", guarded),
}


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


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`modulec = "modulec.cli.main:main"`)."""
    modulec.main(args=argv, prog_name="modulec")
