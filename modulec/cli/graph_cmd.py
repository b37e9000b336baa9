"""`modulec graph`: the Graph IR as a picture (graphviz DOT, or SVG/PNG laid out by `dot`)."""

from __future__ import annotations

from pathlib import Path

import click

from modulec.cli.build_cmd import pairs, model_options

FORMATS = ("dot", "svg", "png")


def graph_command(guarded):
    @click.command("graph")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--scope", metavar="NAME",
                  help="The function to draw: its name (`CausalSelfAttention#1`, "
                       "`MLP#1.backward`), its scope (`blocks[*].attention`) or its module. "
                       "Default: the model's entry function.")
    @click.option("--phase", type=click.Choice(["both", "forward", "backward"]),
                  help="Draw the forward, the backward, or both (default: both; a backward "
                       "named in --scope: backward).")
    @click.option("--format", "picture", type=click.Choice(FORMATS),
                  help="dot: graphviz text; svg, png: laid out by graphviz's `dot`. "
                       "Default: from the suffix of -o, else dot.")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the picture here (default: stdout, for dot and svg).")
    @model_options
    @click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto",
                  show_default=True, help="Color the diagnostics (on stderr).")
    @guarded
    def graph(file, scope, phase, picture, output, model, settings, shapes, config, search_path,
              color):
        """Draw the Graph IR of a model: forward and backward ops, saved values, recompute
        segments, calls as boxes.

        \b
        Examples:
          modulec graph model.module -o graph.svg
          modulec graph model.module --scope blocks[*].attention --format png -o attn.png
        """
        from modulec.cli.inputs import FileResult
        from modulec.cli.output import Output, use_color
        from modulec.lower.build import BuildRequest, build
        from modulec.cli.shape_options import shapes_refused
        from modulec.pictures import PictureError
        from modulec.pictures.dot import graph_to_dot
        from modulec.pictures.render import SUFFIXES, render, write_bytes
        from modulec.pictures.select import select

        if picture is None:
            picture = SUFFIXES.get(output.suffix.lower(), "dot") if output else "dot"
        if picture == "png" and output is None:
            raise click.UsageError("--format png writes a file: give it with -o FILE")
        if output is not None and not output.parent.is_dir():
            raise click.BadParameter(f"folder `{output.parent}` does not exist",
                                     param_hint="-o")
        request = BuildRequest(file, tuple(search_path), model, pairs(settings, "--set", False),
                               pairs(shapes, "--shape", True), config)
        result = build(request)
        out = Output("human", use_color(color))  # --format names the picture's format
        out.show(FileResult(str(file), result.source, None, result.diagnostics))
        if result.graph is None or shapes_refused(result, request.shapes):
            return 1
        try:
            text = graph_to_dot(result.graph, select(result.graph, scope, phase))
            data = text.encode("utf-8") if picture == "dot" else render(text, picture)
        except PictureError as exc:
            click.echo(f"error: {exc}", err=True)
            return 2
        if output is None:
            click.echo(data.decode("utf-8"), nl=False)
        else:
            write_bytes(output, data)
        return 0
    return graph
