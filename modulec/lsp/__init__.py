"""`modulec lsp`: the language server (pygls) for editors, on stdin/stdout.

Diagnostics on open/change/save (exactly those of `modulec check`, for the unsaved text),
hover (inferred shapes, declaration signatures) and go-to-definition (modules, imports,
tensors). Only click is imported here: pygls is loaded when the command runs.
"""

from __future__ import annotations

from pathlib import Path

import click

from modulec.cli.guard import EXIT_ERRORS, EXIT_OK, guarded


@click.command()
@click.option("--path", "search_path", metavar="DIR", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Add DIR to the import search path (repeatable; searched in order).")
@guarded
def lsp_command(search_path: tuple[Path, ...]) -> int:
    """Run the language server on stdin/stdout (started by an editor)."""
    try:
        from modulec.lsp.server import build_server
    except ImportError as exc:
        if exc.name not in ("pygls", "lsprotocol"):
            raise
        raise click.ClickException(
            f"`modulec lsp` needs {exc.name}: pip install 'modulec[lsp]'") from None
    server = build_server(search_path)
    server.start_io()  # returns on `exit`, or when the editor closes stdin
    return EXIT_OK if server.shut_down else EXIT_ERRORS
