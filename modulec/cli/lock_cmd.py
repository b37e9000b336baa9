"""`modulec lock FILE`: resolve FILE's imports (transitively) and write `module.lock`."""

from __future__ import annotations

from pathlib import Path

import click

from modulec.cli.guard import CURRENT_FILE, EXIT_ERRORS, EXIT_OK, guarded
from modulec.cli.inputs import FileResult
from modulec.cli.output import Output, use_color


def lock_command(output_options):
    """The `lock` command, with the shared `--format`/`--color` options of `main`."""

    @click.command()
    @click.argument("file", metavar="FILE.module",
                    type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--path", "search_path", metavar="DIR", multiple=True,
                  type=click.Path(exists=True, file_okay=False, path_type=Path),
                  help="Add DIR to the import search path (repeatable; searched in order, "
                       "before $MODULEPATH).")
    @output_options
    @guarded
    def lock(file: Path, search_path: tuple[Path, ...], fmt: str, color: str) -> int:
        """Resolve FILE's imports (transitively) and write module.lock next to FILE.

        The lock file lists every imported module with its version and the first 12 hex
        digits of its SHA-256, sorted, so that the same sources give the same bytes.
        """
        click.get_current_context().meta[CURRENT_FILE] = str(file)
        return write_lock(file, search_path, Output(fmt, use_color(color)))

    return lock


def write_lock(file: Path, search_path: tuple[Path, ...], out: Output) -> int:
    from modulec.diagnostics import summary_line
    from modulec.resolve import Resolver
    from modulec.cli.build_cmd import write_output
    from modulec.resolve.lockfile import LOCK_NAME, lock_text

    resolver = Resolver(list(search_path))
    entry = resolver.load(file)
    results = [out.show(FileResult(f.source.name if f.source else str(f.path), f.source,
                                   f.program, f.diagnostics)) for f in resolver.files()]
    if all(r.ok for r in results):
        text, problems = lock_text(resolver, entry)
        if problems:
            results.append(out.show(FileResult(str(file), None, None, problems)))
    if not all(r.ok for r in results):
        out.summary(results, "lock", "locked")
        return EXIT_ERRORS
    target = file.parent / LOCK_NAME
    write_output(target, text)
    if not out.json:
        counts = summary_line(d for r in results for d in r.diagnostics)
        modules = sum(line.startswith("  ") for line in text.splitlines())
        click.echo(f"wrote {target}: {modules} module{'s' * (modules != 1)} locked; {counts}")
    return EXIT_OK
