"""`modulec plan`: the memory plan of a training step, per region."""

from __future__ import annotations

import json
from pathlib import Path

import click

from modulec.cli.build_cmd import _pairs

REGION_TITLES = {"weights": "weights", "gradients": "gradients",
                 "optimizer_state": "optimizer state", "saved_activations": "saved activations",
                 "transient_activations": "transient activations", "workspace": "workspace"}


def plan_command(output_options, guarded):
    @click.command("plan")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--model", help="The model declaration (when the file has several).")
    @click.option("--set", "settings", multiple=True, metavar="NAME=VALUE")
    @click.option("--shape", "shapes", multiple=True, metavar="DIM=SIZE",
                  help="Sizes of the free dims of the inputs (e.g. B=8, T=2048): required.")
    @click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--path", "search_path", multiple=True, metavar="DIR",
                  type=click.Path(exists=True, file_okay=False, path_type=Path))
    @output_options
    @guarded
    def plan(file, model, settings, shapes, config, search_path, fmt, color):
        """Plan the memory of one training step: bytes per region, lower bound, baselines."""
        from modulec.cli.inputs import FileResult
        from modulec.cli.output import Output, use_color
        from modulec.lower.build import BuildRequest, build
        from modulec.plan.from_graph import ShapeUnknown, plan_step

        request = BuildRequest(file, tuple(search_path), model, _pairs(settings, "--set", False),
                               _pairs(shapes, "--shape", True), config)
        result = build(request)
        Output(fmt, use_color(color)).show(FileResult(str(file), result.source, None,
                                                      result.diagnostics))
        if result.graph is None:
            return 1
        try:
            summary = plan_step(result.graph).summary()
        except ShapeUnknown as exc:
            raise click.UsageError(str(exc)) from None
        if fmt == "json":
            click.echo(json.dumps(summary, sort_keys=True))
        else:
            _table(summary, result.graph.model)
        return 0
    return plan


def _table(summary: dict, model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memory plan of one training step: {model}")
    for column in ("region", "arena", "lower bound", "naive", "TFLite greedy", "ORT exact"):
        table.add_column(column, justify="left" if column == "region" else "right")
    for row in summary["regions"] + [dict(summary, region="total")]:
        table.add_row(REGION_TITLES.get(row["region"], row["region"]),
                      *(_mib(row[k]) for k in ("arena_bytes", "lower_bound_bytes", "naive_bytes",
                                               "greedy_by_size_bytes",
                                               "exact_size_reuse_bytes")))
    Console().print(table)


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"
