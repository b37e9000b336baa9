"""`modulec report RUN_DIR [-o out.png]`: a training run's loss (train and eval) and
throughput curves, drawn from the `metrics.jsonl` that `modulec train --log-dir RUN_DIR`
wrote (modulec/pictures/curves.py). No torch is imported."""

from __future__ import annotations

from pathlib import Path

import click

FORMATS = {".png": "png", ".svg": "svg"}


def report_command(guarded):
    @click.command("report")
    @click.argument("run_dir", metavar="RUN_DIR", type=click.Path(exists=True, path_type=Path))
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="The picture to write, .png or .svg (default: RUN_DIR/curves.png).")
    @guarded
    def report(run_dir: Path, output: Path | None) -> int:
        """Draw the loss and throughput curves of a `modulec train --log-dir` run.

        \b
        Example:
          modulec train ... --log-dir runs/a
          modulec report runs/a -o runs/a/curves.png
        """
        from modulec.pictures.curves import draw, series
        from modulec.pictures.render import write_bytes
        from runtime.train.metrics import METRICS, read_metrics

        metrics = run_dir / METRICS if run_dir.is_dir() else run_dir
        if not metrics.is_file():
            _fail(f"{run_dir} holds no {METRICS}",
                  f"write one with `modulec train ... --log-dir {run_dir}`")
        output = output or (metrics.parent / "curves.png")
        kind = FORMATS.get(output.suffix.lower())
        if kind is None:
            raise click.BadParameter(f"`{output}`: write a .png or .svg file",
                                     param_hint="-o")
        if not output.parent.is_dir():
            raise click.BadParameter(f"folder `{output.parent}` does not exist",
                                     param_hint="-o")
        records = read_metrics(metrics)
        if not series(records, "loss"):
            _fail(f"{metrics} has no step records with a loss",
                  "the run wrote none yet, or the file is not a training log")
        canvas = draw(records, f"modulec train: {metrics.parent.name or metrics.parent}")
        data = canvas.to_png() if kind == "png" else canvas.to_svg().encode("utf-8")
        write_bytes(output, data)
        click.echo(f"wrote {output} ({len(series(records, 'loss'))} steps)")
        return 0

    return report


def _fail(message: str, hint: str):
    click.echo(f"error: {message}", err=True)
    click.echo(f"  = help: {hint}", err=True)
    raise click.exceptions.Exit(1)
