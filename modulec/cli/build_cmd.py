"""`modulec build` and `modulec ir verify`."""

from __future__ import annotations

from pathlib import Path

import click

from modulec.check.given import MAX_SIZE  # a size no real model comes near
from modulec.cli.fp8_options import fp8_options, fp8_overrides
from modulec.cli.parallel import parallel_options, parallel_request, tensor_parallel_request
from modulec.files import atomic_text


def pairs(values, what: str, integer: bool) -> dict:
    pairs = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"expected NAME=VALUE, got `{item}`", param_hint=what)
        if name.strip() in pairs:  # a repeated option: the last wins, as click's own do
            click.echo(f"note: {what} `{name.strip()}` is given more than once; the last "
                       f"value, `{value.strip()}`, is used", err=True)
        if integer:
            try:
                pairs[name.strip()] = int(value)
            except ValueError:  # not a number, or thousands of digits
                raise click.BadParameter(f"`{item[:60]}`: the size must be an integer",
                                         param_hint=what) from None
            if not 1 <= pairs[name.strip()] <= MAX_SIZE:
                raise click.BadParameter(f"`{item[:60]}`: a size is from 1 to {MAX_SIZE:,}",
                                         param_hint=what)
        else:
            pairs[name.strip()] = value.strip()
    return pairs


def _pass_names():
    from modulec.lower.pass_names import PASS_NAMES

    return PASS_NAMES


def model_options(command):
    """The options that choose and size a model: shared by build, plan and graph."""
    options = [
        click.option("--model", help="The model declaration (when the file has several)."),
        click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
                     help="Set a model parameter (repeatable)."),
        click.option("--shape", "shapes", multiple=True, metavar="DIM=SIZE",
                     help="Size a free dimension of the inputs, e.g. --shape B=8 --shape T=2048."),
        click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="A HuggingFace config.json, read through hf_config.param_mapping."),
        click.option("--path", "search_path", multiple=True, metavar="DIR",
                     type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="Add DIR to the import search path (repeatable)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def planning_options(command):
    """The options of keep / recompute / swap planning: shared by build and plan."""
    options = [
        click.option("--memory-budget", "budget", metavar="SIZE",
                     help="Plan keep / recompute / swap per activation to fit SIZE "
                          "(20GiB, 512MiB, 80GB); exit status 1 when it cannot be met."),
        click.option("--training", type=click.Choice(["full", "lora"]), default="full",
                     show_default=True, help="With --memory-budget: full fine-tuning, or "
                     "LoRA (base weights frozen; recompute policy `lora_only` applies)."),
        click.option("--device", type=click.Choice(["h100", "h200"]), default="h100",
                     show_default=True, help="With --memory-budget: the device profile."),
        click.option("--recompute-policy", "policies", multiple=True,
                     metavar="PATTERN=POLICY",
                     help="With --memory-budget: always | lora_only | never for activations "
                          "matching PATTERN (Module.tensor, tensor, or a primitive such as "
                          "flash_attention); `doc` applies the recompute design doc's table."),
        click.option("--honor-lists", is_flag=True,
                     help="The modules' save: / recompute: lists are fixed decisions (by "
                          "default only annotations are)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _planning(budget, training, device, policies, honor_lists):
    from modulec.cli.plan_cmd import _budget, _policies
    from modulec.lower.build_plan import PlanOptions

    return PlanOptions(_budget(budget) if budget is not None else None, training, device,
                       _policies(policies) if policies else {}, honor_lists)


def parsed_option(text, parse, hint: str):
    """`parse(text)` for an option's value (None stays None); a ValueError is click's
    usage error, naming the option."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def _lora(text):
    from modulec.lower.lora import parse_lora

    return parsed_option(text, parse_lora, "--lora")


def build_command(output_options, guarded):
    @click.command("build")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the IR document (JSON) here.")
    @model_options
    @click.option("--emit", type=click.Choice(["graph", "schedule", "pipeline"]),
                  help="Print the Graph IR or the Schedule IR as text, or the pipeline's "
                       "stages and simulated 1F1B timeline.")
    @click.option("--dump-after", type=click.Choice(list(_pass_names())), metavar="PASS",
                  help="Print the Graph IR after the named pass: " + ", ".join(_pass_names()))
    @click.option("--lora", "lora", metavar="rank=R,alpha=A,targets=[q,v],dropout=P",
                  is_flag=False,
                  flag_value="", default=None,
                  help="LoRA on: adapt the `@adapter(lora)` matmuls (base weights frozen); "
                       "rank / alpha / targets / dropout override the annotations' "
                       "(docs/training.md, LoRA).")
    @click.option("--precision", type=click.Choice(["fp8"]),
                  help="fp8: the std FP8 recipe on the model's matmuls, written to "
                       "metadata.precision (docs/build-output.md).")
    @fp8_options
    @planning_options
    @parallel_options
    @output_options
    @guarded
    def build(file, output, model, settings, shapes, config, search_path, emit, dump_after,
              lora, precision, fp8_scaling, fp8_gradient, fp8_history, budget, training,
              device, policies, honor_lists, dp, zero, tp, sp, no_tp_overlap, pp, microbatches,
              interconnect, fmt, color):
        """Lower a model to Graph IR (forward and derived backward) and Schedule IR."""
        from modulec.cli.output import Output, use_color
        from modulec.cli.inputs import FileResult
        from modulec.cli.shape_options import shapes_refused
        from modulec.ir.printer import print_graph
        from modulec.ir.serialize import dumps
        from modulec.lower.schedule import print_schedule
        from modulec.lower.build import BuildRequest, build as run_build

        if output is not None and not output.parent.is_dir():  # before a build that may be long
            raise click.BadParameter(f"folder `{output.parent}` does not exist",
                                     param_hint="-o")
        request = BuildRequest(file, tuple(search_path), model, pairs(settings, "--set", False),
                               pairs(shapes, "--shape", True), config, dump_after,
                               lambda name, graph: click.echo(f"# after {name}\n"
                                                              + print_graph(graph), nl=False))
        request.lora = _lora(lora)
        request.precision = precision  # the std FP8 recipe (modulec.lower.fp8_recipe)
        request.precision_overrides = fp8_overrides(precision, fp8_scaling, fp8_gradient,
                                                    fp8_history)
        if request.lora is not None and budget is not None:
            training = "lora"
        request.planning = _planning(budget, training, device, policies, honor_lists)
        parallel_request(request, dp, zero, pp, microbatches, budget)
        tensor_parallel_request(request, tp, sp, no_tp_overlap)  # @shard, --tp, --sp
        result = run_build(request)
        out = Output(fmt, use_color(color))
        for notice in result.notices:
            click.echo(f"warning: {notice}", err=True)
        for note in result.notes:
            click.echo(f"note: {note}", err=True)
        out.show(FileResult(str(file), result.source, None, result.diagnostics))
        if result.failure is not None:
            click.echo(f"error: {result.failure}", err=True)
        shape_errors = shapes_refused(result, request.shapes)
        if result.document is None or shape_errors or not _tensor_parallel_ok(result.graph, tp):
            return 1
        if emit == "pipeline":
            _emit_pipeline(result, interconnect)
        if emit == "graph":
            click.echo(print_graph(result.graph), nl=False)
        if emit == "schedule":
            click.echo(print_schedule(result.document["schedule"]), nl=False)
        if output is not None:  # paths rooted: the same bytes from any working directory
            from modulec.lower.source_paths import normalize_paths

            write_output(output, dumps(normalize_paths(result.document, file)))
        return 0
    return build


def _tensor_parallel_ok(graph, tp) -> bool:
    from modulec.cli.parallel import tensor_parallel_problems

    problems = tensor_parallel_problems(graph, tp)
    if not problems and tp and tp > 1:
        try:  # the tensor-parallel lowering (@shard, issue 17) acts on the graph
            import modulec.lower.tensor_parallel  # noqa: F401
        except ImportError:
            problems = [f"--tp {tp}: this modulec has no tensor-parallel lowering yet"]
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    return not problems


def _emit_pipeline(result, interconnect: str) -> None:
    from modulec.cli.parallel import pipeline_report, print_pipeline
    from modulec.plan.from_graph import ShapeUnknown
    from modulec.plan.pipeline import Pipeline, pipeline_section
    from modulec.plan.pipeline_shared import schema_ties

    try:
        section = result.document["schedule"].get("pipeline") or pipeline_section(
            result.graph, Pipeline(), ties=schema_ties(result.document["weight_schema"]))
    except ShapeUnknown as exc:
        raise click.UsageError(f"--emit pipeline: {exc}") from None
    print_pipeline(pipeline_report(section, interconnect), result.graph.model)


def ir_command(guarded):
    @click.group("ir")
    def ir():
        """Work with IR documents written by `modulec build`."""

    @ir.command("verify")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @guarded
    def verify(file):
        """Check an IR document (possibly hand-edited) and report what is wrong."""
        problems = verify_document(file)
        for problem in problems:
            click.echo(f"error: {problem}", err=True)
        if not problems:
            click.echo(f"{file}: valid IR")
        return 1 if problems else 0
    return ir


def verify_document(path: Path) -> list[str]:
    from modulec.ir.load import load_document

    return load_document(path)[1]


def write_output(path: Path, text: str) -> None:
    """`text` into `path` through modulec.files' atomic writer (`modulec build -o`, `fmt`,
    `lock`); a folder that cannot be written (permissions, a full disk) is the user's
    error, with nothing left behind."""
    try:
        atomic_text(path, text)
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
