"""`modulec fmt [--check] FILE_OR_DIR...`: canonical formatting, comments kept."""

from __future__ import annotations

import difflib
from pathlib import Path

import click


def fmt_command(output_options, guarded):
    @click.command("fmt")
    @click.argument("inputs", metavar="FILE_OR_DIR...", nargs=-1, required=True,
                    type=click.Path(exists=True, path_type=Path))
    @click.option("--check", is_flag=True,
                  help="Change nothing; show a diff and exit 1 if a file would change.")
    @output_options
    @guarded
    def fmt(inputs, check, fmt, color):
        """Format .module files in place (canonical layout, comments kept)."""
        from modulec.cli.inputs import collect_module_files, parse_one
        from modulec.cli.output import Output, use_color
        from modulec.syntax.format import format_source

        out = Output(fmt, use_color(color))
        changed, failed = [], False
        for path in collect_module_files(inputs):
            result = out.show(parse_one(path))
            if not result.ok or result.program is None:
                failed = True
                continue
            text = result.source.text
            formatted = format_source(result.program, text)
            if formatted != text:
                changed.append(path)
                if check:
                    click.echo("".join(difflib.unified_diff(
                        text.splitlines(True), formatted.splitlines(True),
                        f"{path} (now)", f"{path} (formatted)")), nl=False)
                else:
                    _write(path, formatted)
        verb = "would reformat" if check else "reformatted"
        click.echo(f"{verb} {len(changed)} file{'s' if len(changed) != 1 else ''}", err=True)
        return 1 if failed or (check and changed) else 0
    return fmt


def _write(path: Path, text: str) -> None:
    from modulec.cli.build_cmd import write_output

    write_output(path, text)
