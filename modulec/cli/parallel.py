"""The parallel options of `modulec build` and `modulec plan` (--dp, --zero, --tp, --sp,
--no-tp-overlap, --pp, --microbatches, --interconnect; `modulec train` shares
--no-tp-overlap), and what `modulec plan` prints for them: the per-GPU
memory under data parallel with ZeRO (beside one GPU's), and the pipeline's simulated
timeline (docs/distributed.md)."""

from __future__ import annotations

import click

# the model parameters a tensor-parallel split divides (heads by rank, d_ff by columns)
TP_DIVIDES = ("num_heads", "num_kv_heads", "d_ff")
GIB = 2 ** 30


class ZeroStage(click.ParamType):
    """A ZeRO stage 0-3, or `auto`."""
    name = "0|1|2|3|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        if str(value).strip() in ("0", "1", "2", "3"):
            return int(value)
        self.fail(f"`{value}`: expected a ZeRO stage 0, 1, 2 or 3, or auto", param, ctx)


def no_tp_overlap_option():
    """`--no-tp-overlap` (build, plan and train: modulec.lower.tp_overlap)."""
    return click.option("--no-tp-overlap", "no_tp_overlap", is_flag=True,
                        help="With --tp: run each backward all-reduce (or reduce-scatter) "
                             "of an input gradient in order, not on the communication "
                             "stream beside the weight gradient's GEMM (the A/B of the "
                             "overlap).")


def parallel_options(command):
    options = [
        click.option("--dp", type=click.IntRange(min=1), metavar="N",
                     help="Data-parallel ranks: the schedule's distributed section "
                          "(buckets sharded N ways)."),
        click.option("--zero", type=ZeroStage(), metavar="S",
                     help="ZeRO stage 0-3 with --dp (default 2): what each rank holds; "
                          "auto: with --memory-budget, the planner chooses 2 or 3."),
        click.option("--tp", type=click.IntRange(min=1), metavar="M",
                     help="Tensor-parallel ranks (must divide the heads, KV heads and d_ff)."),
        click.option("--sequence-parallel", "--sp", "sp", is_flag=True,
                     help="With --tp: sequence parallel (Megatron-LM's), the norms and "
                          "residual adds on T / M rows a rank, all-gather / reduce-scatter "
                          "around each sharded region instead of the all-reduce."),
        no_tp_overlap_option(),
        click.option("--pp", type=click.IntRange(min=1), metavar="P",
                     help="Pipeline stages (1F1B): the schedule's pipeline section; a model "
                          "with @partition stages gives its own split."),
        click.option("--microbatches", type=click.IntRange(min=1), metavar="M",
                     help="Micro-batches per step for the pipeline (default 4 x stages); "
                          "--shape B= is the micro-batch's size."),
        click.option("--interconnect", type=click.Choice(["nvlink", "ib"]), default="nvlink",
                     show_default=True, help="The link between pipeline stages in the "
                     "simulated timeline: NVLink (450 GB/s) or one 400 Gb/s NIC (50 GB/s)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def parallel_request(request, dp, zero, pp, microbatches, budget=None) -> None:
    """Put the data-parallel and pipeline settings on a BuildRequest."""
    from modulec.plan.distributed import DataParallel
    from modulec.plan.pipeline import Pipeline, pipeline_zero

    if zero is not None and dp is None:
        raise click.BadParameter("--zero needs --dp N: the shards' sizes depend on it",
                                 param_hint="--zero")
    if zero == "auto" and budget is None:
        raise click.BadParameter("--zero auto chooses the stage that fits --memory-budget: "
                                 "give the per-GPU budget, or a stage 0-3",
                                 param_hint="--zero")
    if zero == 1 and pp is not None and dp == 1:
        raise click.BadParameter("--zero 1 with --pp shards each stage's optimizer state "
                                 "over --dp N > 1 pipelines", param_hint="--zero")
    if dp is not None and not (pp is not None and zero in (None, 0, 1)):
        request.distributed = DataParallel(dp, 2 if zero is None else zero)
    # --dp N --pp P: N data-parallel pipelines, their gradients all-reduced per stage (the
    # pipeline section's mesh and ops: ZeRO-0, or ZeRO-1 by bucket); a --zero 2-3 beside
    # it writes the distributed section (its per-stage memory in `modulec plan`), which
    # `modulec train` refuses
    if pp is not None or microbatches is not None:
        request.pipeline = Pipeline(pp, microbatches, dp or 1, pipeline_zero(zero, dp or 1))


def tensor_parallel_request(request, tp: int | None, sp: bool,
                            no_tp_overlap: bool = False) -> None:
    """Put `--tp M` (one rank's program of M), `--sp` and `--no-tp-overlap` on a
    BuildRequest."""
    from modulec.lower.tensor_parallel import sequence_parallel_problem

    problem = sequence_parallel_problem(tp, sp)
    if problem:
        raise click.BadParameter(problem, param_hint="--sp")
    check_no_tp_overlap(tp, no_tp_overlap)
    request.tensor_parallel = tp or 1  # one rank's program (@shard, --tp)
    request.sequence_parallel = sp
    request.tp_overlap = not no_tp_overlap  # modulec.lower.tp_overlap


def check_no_tp_overlap(tp: int | None, no_tp_overlap: bool) -> None:
    """`--no-tp-overlap` needs tensor-parallel collectives to leave in order: `--tp M`."""
    if no_tp_overlap and not (tp and tp > 1):
        raise click.BadParameter("--no-tp-overlap turns off the overlap of the tensor-"
                                 "parallel backward collectives: give --tp M (M of at "
                                 "least 2)", param_hint="--no-tp-overlap")


def tensor_parallel_problems(graph, tp: int | None) -> list[str]:
    """Every model parameter a `--tp M` split must divide, where it does not."""
    if not tp or tp == 1:
        return []
    found: dict = {}  # (parameter, value) -> the first function (callees come first)
    for function in graph.functions:
        for name, value in function.args:
            if name in TP_DIVIDES and value.isdigit() and int(value) % tp \
                    and not function.gradient_of:
                found.setdefault((name, value), function)
    return [f"--tp {tp} does not divide `{name} = {value}` of `{f.name}` ({f.scope}): "
            f"each rank needs a whole share" for (name, value), f in found.items()]


# ---------------------------------------------------------------------- data parallel
def data_parallel_report(graph, section: dict, activations: int) -> dict:
    """Per-rank bytes of `section` beside one GPU's (dp 1, ZeRO 0, the same parameters):
    the fixed state (`total`), the ZeRO-3 entry buffers a step holds at its peak, the
    activations and their sum (`per_gpu`)."""
    from modulec.plan.distributed import (
        DataParallel, bucket_paths, data_parallel_section, entry_buffer_bytes,
        rank_fixed_bytes,
    )

    trained = {p for b in section["buckets"] for i in range(b["instances"])
               for p in bucket_paths(b, i)}
    single = data_parallel_section(graph, DataParallel(1, 0), trained)
    one, per_rank = rank_fixed_bytes(single), rank_fixed_bytes(section)
    for parts, of in ((one, single), (per_rank, section)):
        parts["model_state"] = parts["weights"] + parts["optimizer_state"]
        parts["entry_buffers"] = entry_buffer_bytes(of)  # in a step only: not fixed
        parts["activations"] = activations
        parts["per_gpu"] = parts["total"] + parts["entry_buffers"] + activations
    return {"dp": section["mesh"]["dp"], "zero": section["zero"], "one_gpu": one,
            "per_rank": per_rank}


ROWS = (("weights", "compute weights (bf16)"),
        ("optimizer_state", "split masters' low halves + AdamW moments"),
        ("model_state", "model state (what ZeRO shards)"),
        ("gradient_buffers", "gradient slots (reductions' buffers)"),
        ("gather_slots", "ZeRO-3 gather slots"),
        ("total", "fixed state (model state + slots)"),
        ("entry_buffers", "ZeRO-3 entry weights gathered at the peak"),
        ("activations", "activations (saved + transient, one micro-batch)"),
        ("per_gpu", "per GPU"))


def print_data_parallel(report: dict, model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"per-GPU memory: {model}, data parallel {report['dp']} ranks, "
                        f"ZeRO-{report['zero']}")
    table.add_column("part")
    table.add_column("1 GPU", justify="right")
    table.add_column(f"each of {report['dp']} GPUs", justify="right")
    for key, title in ROWS:
        table.add_row(title, _gib(report["one_gpu"][key]), _gib(report["per_rank"][key]))
    Console(width=100).print(table)
    one, rank = report["one_gpu"], report["per_rank"]
    click.echo(f"model state per GPU: {_gib(rank['model_state'])} against "
               f"{_gib(one['model_state'])} on one GPU "
               f"({rank['model_state'] / max(one['model_state'], 1):.2f}x); with the "
               f"gradient and gather slots (buffers of two layers and the entry's, not "
               f"sharded), fixed state {_gib(rank['total'])} against {_gib(one['total'])} "
               f"({_gib(one['total'] - rank['total'])} less, "
               f"{rank['total'] / max(one['total'], 1):.2f}x)")


# ---------------------------------------------------------------------- pipeline
def pipeline_report(section: dict, interconnect: str, memory: list | None = None) -> dict:
    """The simulated timeline of `section`; `memory`: modulec.plan.pipeline_memory's rows."""
    from modulec.plan.pipeline_sim import LINKS, simulate

    timeline = simulate(section, LINKS[interconnect])
    summary = timeline.summary()
    if memory is not None:
        summary["memory"] = memory
    summary["interconnect"] = interconnect
    summary["split"] = section["split"]
    for row, stage in zip(summary["stages"], section["stages"]):
        row["units"] = [_unit_text(u) for u in stage["units"]]
        row["forward_s"], row["backward_s"] = stage["forward_s"], stage["backward_s"]
    summary["boundary_bytes"] = [b["activation_bytes"] for b in section["boundaries"]]
    summary["dp"] = section.get("mesh", {}).get("dp", 1)
    summary["tp"] = section.get("mesh", {}).get("tp", 1)
    summary["zero"] = section.get("zero", 0)
    return {"summary": summary, "timeline": timeline}


def print_pipeline(report: dict, model: str) -> None:
    from modulec.plan.pipeline_sim import chart

    s = report["summary"]
    dp = s.get("dp", 1)
    replicas = f"; {dp} data-parallel pipelines, each stage's gradients all-reduced over " \
        "its replicas after its last backward" if dp > 1 else ""
    if s.get("zero"):
        replicas += " (ZeRO-1: its optimizer state by bucket owner)"
    click.echo(f"pipeline: {model}, {len(s['stages'])} stages ({s['split']} split), "
               f"{s['microbatches']} micro-batches, 1F1B, {s['interconnect']} between "
               f"stages{replicas}")
    for row in s["stages"]:
        click.echo(f"  stage {row['stage']}: {', '.join(row['units'])}")
        click.echo(f"    per micro-batch forward {row['forward_s'] * 1e3:.2f} ms, backward "
                   f"{row['backward_s'] * 1e3:.2f} ms; busy {row['busy_s'] * 1e3:.1f} ms, "
                   f"idle {row['idle_s'] * 1e3:.1f} ms ({row['idle_fraction']:.1%})")
    for row in s.get("memory", ()):
        click.echo(f"  stage {row['stage']} per GPU: {_gib(row['per_gpu_bytes'])} = fixed "
                   f"{_gib(row['fixed_bytes'])} + activations {_gib(row['activation_bytes'])} "
                   f"({_gib(row['saved_per_microbatch_bytes'])} saved a micro-batch x "
                   f"{row['in_flight']} in flight, + transient)")
    for index, size in enumerate(s["boundary_bytes"]):
        click.echo(f"  stage {index} -> {index + 1}: {size / 2**20:,.1f} MiB of activations "
                   "per micro-batch (and their gradients back)")
    click.echo(f"simulated step: {s['step_s'] * 1e3:.1f} ms; bubble {s['bubble_fraction']:.1%} "
               f"(equal stages, free links: {s['ideal_bubble_fraction']:.1%})")
    for line in chart(report["timeline"]):
        click.echo(line)
    zero = " --zero 1" if s.get("zero") else ""
    tp = s.get("tp", 1)
    flag = f" --tp {tp}" if tp > 1 else ""
    inside = f" (each stage {tp} tensor-parallel ranks: one rank's program timed)" \
        if tp > 1 else ""
    click.echo(f"note: simulated{inside}; `torchrun --nproc-per-node "
               f"{dp * len(s['stages']) * tp} -m modulec train --pp {len(s['stages'])}{flag}"
               f"{zero}` runs it (docs/pipeline.md)")


def _unit_text(unit: dict) -> str:
    if "blocks" in unit:
        a, b = unit["blocks"]
        return f"{unit['target']} blocks {a}-{b}" if a != b else f"{unit['target']} block {a}"
    if "layers" in unit:
        a, b = unit["layers"]
        return f"{unit['target']} x{b - a + 1}"
    return unit["target"]


def _gib(count: int) -> str:
    from modulec.plan.units import gib_text

    return gib_text(count)
