"""What the commands that run models (`run`, `train`) share: calling into the runtime
(imported only then: the compiler never imports torch) and reporting its user errors as
`error: ...` lines with help, exit status 1, never a traceback; and the options that
choose a model."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

import click


def call_runtime(command: str, target: str, request: dict) -> int:
    """Run `target` ("runtime.module:function") with the request's keywords."""
    module_name, _, function = target.partition(":")
    try:
        from runtime.errors import RuntimeUserError
        from runtime.hf_weights import WeightLoadError

        entry = getattr(import_module(module_name), function)
    except ImportError as exc:
        click.echo(f"error: `modulec {command}` needs the runtime (torch, safetensors): "
                   f"{exc}", err=True)
        return 1
    try:
        summary = entry(**request)
    except (RuntimeUserError, WeightLoadError) as exc:
        click.echo(f"error: {exc.message}", err=True)
        for line in exc.help:
            click.echo(f"  = help: {line}", err=True)
        return _ended(1)
    if summary:  # a data-parallel rank other than 0 reports nothing
        click.echo(summary)
    return _ended(0)


def _ended(code: int) -> int:
    """`code`; a torchrun rank's process ends here instead (runtime.dist.context
    .end_joined_process: torch's teardown at the interpreter's exit can abort)."""
    from runtime.dist.context import end_joined_process

    end_joined_process(code)
    return code


def model_choice_options() -> list:
    """--set, --model, --path."""
    return [
        click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
                     help="Set a model parameter (repeatable)."),
        click.option("--model", help="The model declaration (when the file has several)."),
        click.option("--path", "search_path", multiple=True, metavar="DIR",
                     type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="Add DIR to the import search path (repeatable)."),
    ]
