"""`modulec plan`: the memory plan of a training step, per region; with `--memory-budget`,
keep / recompute / swap per activation to fit the budget (modulec.plan.budget)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from modulec.cli.build_cmd import pairs, model_options
from modulec.cli.fp8_options import fp8_options, fp8_overrides
from modulec.cli.parallel import parallel_options, parallel_request, tensor_parallel_request
from modulec.cli.shape_options import shapes_refused

REGION_TITLES = {"weights": "weights", "gradients": "gradients",
                 "optimizer_state": "optimizer state", "saved_activations": "saved activations",
                 "transient_activations": "transient activations", "workspace": "workspace"}
GIB = 2 ** 30
FIXED_REGIONS = ("weights", "gradients", "optimizer_state")


def plan_command(output_options, guarded):
    @click.command("plan")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @model_options
    @click.option("--memory-budget", "budget", metavar="SIZE",
                  help="Plan keep / recompute / swap per activation to fit SIZE "
                       "(20GiB, 512MiB, 80GB); exit status 1 when it cannot be met.")
    @click.option("--training", type=click.Choice(["full", "lora"]), default="full",
                  show_default=True, help="With --memory-budget: full fine-tuning, or LoRA "
                  "(base weights frozen; recompute policy `lora_only` applies).")
    @click.option("--device", type=click.Choice(["h100", "h200"]), default="h100",
                  show_default=True, help="With --memory-budget: the device profile.")
    @click.option("--recompute-policy", "policies", multiple=True, metavar="PATTERN=POLICY",
                  help="With --memory-budget: always | lora_only | never for activations "
                       "matching PATTERN (Module.tensor, tensor, or a primitive such as "
                       "flash_attention); `doc` applies the recompute design doc's table.")
    @click.option("--honor-lists", is_flag=True,
                  help="With --memory-budget: the modules' save: / recompute: lists are "
                       "fixed decisions (by default only annotations are).")
    @click.option("--picture", type=click.Path(dir_okay=False, path_type=Path),
                  help="Also draw the plan to FILE (PNG; SVG for *.svg): offset per step.")
    @click.option("--precision", type=click.Choice(["fp8"]),
                  help="fp8: the std FP8 recipe on the model's matmuls (as `modulec build "
                       "--precision fp8`): the GPU step's FP8 buffers beside the plan (fp8 "
                       "weights, the wgrad's x^T, cast buffers, scales) are counted.")
    @fp8_options
    @parallel_options
    @output_options
    @guarded
    def plan(file, model, settings, shapes, config, search_path, budget, training, device,
             policies, honor_lists, picture, precision, fp8_scaling, fp8_gradient,
             fp8_history, dp, zero, tp, sp, no_tp_overlap, pp, microbatches, interconnect,
             fmt, color):
        """Plan the memory of one training step: bytes per region, lower bound, baselines."""
        from modulec.cli.inputs import FileResult
        from modulec.cli.output import Output, use_color
        from modulec.cli.parallel import (
            print_data_parallel, print_pipeline, tensor_parallel_problems,
        )
        from modulec.lower.build import BuildRequest, build
        from modulec.plan.from_graph import ShapeUnknown, plan_step

        budget_bytes = _budget(budget)
        request = BuildRequest(file, tuple(search_path), model, pairs(settings, "--set", False),
                               pairs(shapes, "--shape", True), config)
        request.precision = precision  # the std FP8 recipe (modulec.lower.fp8_recipe)
        request.precision_overrides = fp8_overrides(precision, fp8_scaling, fp8_gradient,
                                                    fp8_history)
        if precision is not None and (dp or pp or microbatches):
            raise click.UsageError("--precision fp8 with --dp / --pp: the FP8 buffers of a "
                                   "rank or a stage are not counted yet (`modulec train` "
                                   "runs a recipe on one process only)")
        parallel_request(request, dp, zero, pp, microbatches, budget_bytes)
        if zero == "auto":  # the build chooses the stage under the budget
            from modulec.lower.build_plan import PlanOptions

            request.planning = PlanOptions(budget_bytes, training, device, _policies(policies),
                                           honor_lists)
        tensor_parallel_request(request, tp, sp, no_tp_overlap)  # @shard, --tp, --sp
        result = build(request)
        Output(fmt, use_color(color)).show(FileResult(str(file), result.source, None,
                                                      result.diagnostics))
        if result.failure is not None:
            click.echo(f"error: {result.failure}", err=True)
        for note in result.notes:
            click.echo(f"note: {note}", err=True)
        if result.graph is None or result.document is None or \
                shapes_refused(result, request.shapes):
            return 1
        if tensor_parallel_problems(result.graph, tp):
            for problem in tensor_parallel_problems(result.graph, tp):
                click.echo(f"error: {problem}", err=True)
            return 1
        try:
            if picture is not None:  # modulec.pictures.memory: offset against schedule step
                from modulec.pictures.memory import draw_memory_plan

                draw_memory_plan(result.graph, picture)
            section = result.document["metadata"].get("precision")  # an FP8 recipe
            if budget_bytes is not None:
                return _budget_plan(result.graph, file, search_path, budget_bytes, training,
                                    device, _policies(policies), honor_lists, fmt,
                                    result.document["schedule"].get("distributed"), section)
            summary = plan_step(result.graph).summary()
            fp8 = _fp8(result.graph, section)
        except ShapeUnknown as exc:
            raise click.UsageError(str(exc)) from None
        parallel = _parallel(result, summary, interconnect, pp or microbatches)
        if fmt == "json":
            click.echo(json.dumps(summary | fp8 | {k: v["summary"] if k == "pipeline" else v
                                                   for k, v in parallel.items()},
                                  sort_keys=True))
            return 0
        _table(summary, result.graph.model)
        if fp8:
            click.echo(_fp8_line(fp8["fp8_buffers"], summary["arena_bytes"]))
        if fp8 and parallel:
            click.echo("note: the data-parallel and pipeline figures below do not count the "
                       "FP8 buffers", err=True)
        if "data_parallel" in parallel:
            print_data_parallel(parallel["data_parallel"], result.graph.model)
        if "pipeline" in parallel:
            print_pipeline(parallel["pipeline"], result.graph.model)
        return 0
    return plan


def _parallel(result, summary: dict, interconnect: str, asked_pipeline) -> dict:
    """The data-parallel and pipeline predictions of a build made with their options."""
    from modulec.cli.parallel import data_parallel_report, pipeline_report

    schedule = result.document["schedule"]
    found = {}
    if "distributed" in schedule:
        activations = sum(r["arena_bytes"] for r in summary["regions"]
                          if r["region"] not in FIXED_REGIONS)
        found["data_parallel"] = data_parallel_report(result.graph, schedule["distributed"],
                                                      activations)
    if "pipeline" in schedule:
        from modulec.plan.pipeline_memory import stage_memory

        transient = sum(r["arena_bytes"] for r in summary["regions"]
                        if r["region"] in ("transient_activations", "workspace"))
        found["pipeline"] = pipeline_report(schedule["pipeline"], interconnect,
                                            stage_memory(result.graph, schedule, transient))
    return found


def _fp8(graph, section: dict | None) -> dict:
    """{"fp8_buffers": what the GPU step's FP8 recipe holds beside the plan} ({} without
    a recipe): the step without a budget keeps the wgrad's x^T (modulec.plan.fp8_memory)."""
    from modulec.plan.fp8_memory import fp8_memory

    if not section:
        return {}
    return {"fp8_buffers": fp8_memory(graph, section).summary(held=True)}


def _fp8_line(fp8: dict, arena: int) -> str:
    return (f"FP8 buffers beside the plan (GPU step): fp8 weight copies "
            f"{_gib(fp8['weights_bytes'])} + the wgrad's x^T kept forward to backward "
            f"{_gib(fp8['held_transposed_bytes'])} + cast buffers "
            f"{_gib(fp8['transient_bytes'])} + amax histories {_gib(fp8['scales_bytes'])} = "
            f"{_gib(fp8['total_bytes'])}; with the plan's total: "
            f"{_gib(arena + fp8['total_bytes'])}")


def _budget(text: str | None) -> int | None:
    from modulec.cli.build_cmd import parsed_option
    from modulec.plan.budget import parse_size

    return parsed_option(text, parse_size, "--memory-budget")


def _policies(items) -> dict:
    from modulec.plan.recompute import DOC_POLICIES, POLICIES

    found: dict = {}
    for item in items:
        if item == "doc":
            found.update(DOC_POLICIES)
            continue
        pattern, sep, policy = item.partition("=")
        if not sep or policy not in POLICIES:
            raise click.BadParameter(f"`{item}`: expected PATTERN=POLICY with POLICY one of "
                                     f"{', '.join(POLICIES)}, or `doc`",
                                     param_hint="--recompute-policy")
        found[pattern.strip()] = policy
    return found


def _budget_plan(graph, file, search_path, budget: int, training: str, device: str,
                 policies: dict, honor_lists: bool, fmt: str, distributed=None,
                 precision=None) -> int:
    """`distributed` (the build's section, with --dp): the budget is one rank's, its fixed
    state what the rank holds. `precision` (an FP8 recipe): its buffers are fixed too, as
    a budgeted GPU step holds them (no wgrad x^T kept)."""
    from modulec.plan.budget import make_problem, plan_budget, summary
    from modulec.plan.devices import device as device_named
    from modulec.plan.distributed import planner_fixed_bytes
    from modulec.plan.recompute import declarations

    own = planner_fixed_bytes(graph, distributed) if distributed is not None else None
    problem = make_problem(graph, declarations(file, tuple(search_path)), training,
                           device_named(device), policies, binding=5 if honor_lists else 3,
                           precision=precision, fixed_bytes=own)
    data = summary(problem, plan_budget(problem, budget))
    if fmt == "json":
        click.echo(json.dumps(data, sort_keys=True))
    else:
        _budget_table(data, graph.model)
    if not data["feasible"]:
        click.echo(_infeasible(data), err=True)
        return 1
    return 0


def _infeasible(data: dict) -> str:
    fixed = sum(data["fixed_bytes"].values())
    hint = ", or train with --training lora" if data["training"] == "full" else ""
    return (f"error: the memory budget {_gib(data['budget_bytes'])} cannot be met: the lowest "
            f"predicted peak is {_gib(data['minimum_peak_bytes'])} (weights, gradients and "
            f"optimizer state{_and_fp8(data)} alone: {_gib(fixed)}); raise the budget to at least "
            f"{_gib(data['minimum_peak_bytes'])}{hint}")


def _and_fp8(data: dict) -> str:
    from modulec.plan.fp8_memory import FP8_FIXED

    return ", FP8 buffers" if data["fixed_bytes"].get(FP8_FIXED) else ""


def _fp8_part(data: dict) -> str:
    from modulec.plan.fp8_memory import FP8_FIXED

    fp8 = data["fixed_bytes"].get(FP8_FIXED)
    return f", of which the FP8 step's buffers {_gib(fp8)}" if fp8 else ""


def _budget_table(data: dict, model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"keep / recompute / swap per activation: {model} "
                        f"({data['device']['name']}, {data['training']} training)")
    for column in ("function", "tensor", "each", "keep", "recompute", "swap"):
        table.add_column(column, justify="left" if column in ("function", "tensor")
                         else "right")
    for row in data["decisions"]["by_tensor"]:
        views = f" (+{len(row['views'])} views)" if row["views"] else ""
        table.add_row(row["function"], row["tensor"] + views, _mib(row["bytes_each"]),
                      *(str(row[k]) for k in ("keep", "recompute", "swap")))
    console = Console(width=max(100, Console().width))
    console.print(table)
    for line in _budget_lines(data):
        console.print(line, highlight=False)


def _budget_lines(data: dict) -> list[str]:
    d, peak = data["decisions"], data["peak"]
    verdict = "<=" if data["feasible"] else ">"
    lines = [f"decisions: keep {d['keep']['count']} ({_gib(d['keep']['bytes'])}), recompute "
             f"{d['recompute']['count']} ({_gib(d['recompute']['bytes'])} freed), swap "
             f"{d['swap']['count']} ({_gib(d['swap']['bytes'])} offloaded); implicit "
             f"checkpoints {d['implicit_checkpoints']['count']} "
             f"({_gib(d['implicit_checkpoints']['bytes'])}); {d['fixed_by_intent']['count']} "
             f"fixed by annotations",
             f"predicted peak: {_gib(data['predicted_peak_bytes'])} {verdict} budget "
             f"{_gib(data['budget_bytes'])} (fixed {_gib(sum(data['fixed_bytes'].values()))}"
             f"{_fp8_part(data)} + "
             f"activations {_gib(peak['activations'])} + transient {_gib(peak['transient'])}, "
             f"in the {peak['phase']}); without recompute: "
             f"{_gib(data['no_recompute_peak_bytes'])}",
             f"predicted overhead: {data['predicted_overhead_s'] * 1e3:.2f} ms (recompute "
             f"{data['recompute_s'] * 1e3:.2f} ms + swap stalls {data['swap_stall_s'] * 1e3:.2f}"
             f" ms) = {data['overhead_percent']:.1f} % of the step's predicted compute "
             f"({data['compute_s'] * 1e3:.1f} ms)",
             f"the modules' own save: / recompute: lists would give: peak "
             f"{_gib(data['ladder']['peak_bytes'])}, overhead "
             f"{data['ladder']['overhead_s'] * 1e3:.2f} ms"]
    return lines + [f"note: {n}" for n in data["notes"]]


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


def _gib(count: int) -> str:
    from modulec.plan.units import gib_text

    return gib_text(count)
