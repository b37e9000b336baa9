"""`modulec build`: a checked model, instantiated, lowered to one IR document.

Sizes come from the model's defaults, a HuggingFace `config.json` (through
`hf_config.param_mapping`; a null or missing field keeps the default, with a warning),
`--set name=value`, and `--shape B=8` for the free dims of its inputs. The document's
top-level keys: `ir_version`, `graph`, `schedule`, `weight_schema`, `config_schema`,
`metadata`; it is byte-identical across runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from modulec.check.driver import check_program, scopes_of
from modulec.check.given import setting_value, value_problem
from modulec.check.instance import instantiate
from modulec.diagnostics import Diagnostic, error
from modulec.ir.serialize import IR_VERSION, graph_to_data
from modulec.lower.backward import without_written_backward
from modulec.lower.hf_config_fields import (FIELD_ALIASES, tie_problem, unmapped_field_problems,
                                            with_aliases)
from modulec.lower.lowering import lower_model, recording_world
from modulec.lower.passes import PassContext, run_pipeline
from modulec.lower.rope_config import (config_field, is_scaling_field, rope_problems,
                                       unread_by_kind, with_legacy_types)
from modulec.lower.schedule import schedule_data
from modulec.lower.training_settings import training_metadata
from modulec.syntax import ast as A
from modulec.types.dims import Dim



@dataclass
class BuildRequest:
    path: Path
    search_path: tuple[Path, ...] = ()
    model: str | None = None
    settings: dict[str, str] = field(default_factory=dict)  # --set name=value (source text)
    shapes: dict[str, int] = field(default_factory=dict)  # --shape B=8
    config: Path | None = None
    dump_after: str | None = None  # print the IR after this pass (modulec.lower.passes)
    dump: object = None  # (pass name, graph) -> None
    derive_written: bool = False  # derive every backward, also where the source writes one
    planning: object = None  # modulec.lower.build_plan.PlanOptions (None: the defaults)
    lora: object = None  # modulec.lower.lora.LoraOptions: LoRA on (docs/training.md, "LoRA")
    # modulec.plan.distributed.DataParallel: the schedule's `distributed` section
    distributed: object = None
    # modulec.plan.pipeline.Pipeline: the schedule's `pipeline` section (also written, with
    # the defaults, for a model whose forward has `@partition` stages)
    pipeline: object = None
    tensor_parallel: int = 1  # `--tp M`: this rank's program of M (modulec.lower.tensor_parallel)
    sequence_parallel: bool = False  # `--sp`: with --tp, modulec.lower.sequence_parallel
    # with --tp: the backward collectives overlapped with the weight gradients
    # (modulec.lower.tp_overlap); False: `--no-tp-overlap`
    tp_overlap: bool = True
    precision: str | None = None  # "fp8": the std FP8 recipe on the model (modulec.lower.fp8_recipe)
    # with "fp8": the --fp8-* changes to the std recipe (fp8_recipe.std_recipe); None: none
    precision_overrides: dict | None = None


@dataclass
class BuildResult:
    diagnostics: list[Diagnostic]
    document: dict | None = None
    graph: object = None
    source: object = None
    notices: list[str] = field(default_factory=list)  # config fields that kept defaults
    failure: str | None = None  # the memory budget cannot be met (no source location)
    notes: list[str] = field(default_factory=list)  # what the build chose (`--zero auto`)


def build(request: BuildRequest) -> BuildResult:
    from modulec.resolve import Resolver
    from modulec.syntax.sections import check_sections

    resolver = Resolver(request.search_path)
    loaded = resolver.load(request.path)
    from modulec.resolve.lock_check import lock_problems

    diagnostics = list(loaded.diagnostics) + lock_problems(resolver, loaded, str(request.path))
    if loaded.program is None or any(d.is_error for d in diagnostics):
        return BuildResult(diagnostics, source=loaded.source)
    diagnostics += check_sections(loaded.program)
    diagnostics += check_program(loaded.program, loaded.scope, None, scopes_of(resolver),
                                 deep_models=False)
    decl = _model(loaded.program, request.model, diagnostics)
    if decl is None or any(d.is_error for d in diagnostics):
        return BuildResult(diagnostics, source=loaded.source)
    notices: list[str] = []
    args = _arguments(decl, request, diagnostics, notices)
    if args is None:
        return BuildResult(diagnostics, source=loaded.source, notices=notices)
    from modulec.lower.build_plan import PlanFailure
    from modulec.plan.pipeline import PipelineError

    try:
        result = _lower(decl, loaded, resolver, args, request, diagnostics)
    except (PlanFailure, PipelineError) as exc:
        result = BuildResult(diagnostics, source=loaded.source, failure=str(exc))
    result.notices = notices
    return _check_tie(result, decl, request)


def _check_tie(result: BuildResult, decl: A.Decl, request: BuildRequest) -> BuildResult:
    """An unmapped `tie_word_embeddings` of the config against what the program does."""
    if request.config is None or result.document is None:
        return result
    config = json.loads(Path(request.config).read_text(encoding="utf-8"))
    mapped = with_aliases({field_name for _, field_name in _param_mapping(decl)})
    problems = tie_problem(config, mapped, result.document["weight_schema"],
                           Path(request.config))
    if problems:
        result.diagnostics += problems
        result.document = None
    return result


def _lower(decl, loaded, resolver, args, request, diagnostics) -> BuildResult:
    world = recording_world(loaded.scope, scopes_of(resolver))
    world.dims = {"tp_size": Dim.const(request.tensor_parallel),
                  **{k: Dim.const(v) for k, v in request.shapes.items()}}
    instance = instantiate(world, world.definition(decl), args)
    if _sharding_fails(world, instance, request):  # before its shapes fail downstream
        return BuildResult(diagnostics + world.diagnostics, source=loaded.source)
    graph = lower_model(world, instance)  # checks every instance of the tree at these sizes
    from modulec.check.weights import check_weights

    check_weights(instance)
    tensor_parallel = _tensor_parallel(world, instance, request)
    diagnostics += world.diagnostics
    if any(d.is_error for d in diagnostics):
        return BuildResult(diagnostics, source=loaded.source)
    if request.derive_written:
        graph = without_written_backward(graph)
    context = PassContext(sources={loaded.source.name: loaded.source} if loaded.source else {},
                          lora=request.lora, tensor_parallel=tensor_parallel)
    if request.lora is not None:
        context.weight_schema = _weight_schema(instance)
    graph = run_pipeline(graph, request.dump_after, request.dump, context)
    tensor_parallel = context.tensor_parallel  # with what the passes added (the adapters')
    diagnostics += context.diagnostics
    if any(d.is_error for d in context.diagnostics):
        return BuildResult(diagnostics, source=loaded.source)
    precision, problems = _precision(loaded.program, decl, graph, request)
    diagnostics += problems
    if any(d.is_error for d in problems):
        return BuildResult(diagnostics, source=loaded.source)
    from modulec.lower.build_plan import PlanOptions, plan_for_build

    planning, notes = request.planning or PlanOptions(), []
    if precision is not None:  # the planners count the FP8 buffers (plan.fp8_memory)
        planning = replace(planning, precision=precision)
    if request.distributed is not None and planning.budget is not None:
        planning, choice = _rank_planning(planning, graph, instance, world, request, resolver)
        notes += [choice] if choice else []
    plan, decided = plan_for_build(graph, resolver, planning)
    document = {
        "ir_version": IR_VERSION,
        "graph": graph_to_data(graph),
        "schedule": schedule_data(graph, plan, decided),
        "weight_schema": _weight_schema(instance),
        "config_schema": _config_schema(decl),
        "metadata": _metadata(decl, instance, graph, request),
    }
    if context.lora_report is not None:
        document["metadata"]["lora"] = _lora_metadata(request.lora, context.lora_report)
    training = training_metadata(graph, world.param_settings)
    if training is not None:  # @frozen, @trainable(...): what each trainer reads
        document["metadata"]["training"] = training
    if precision is not None:
        document["metadata"]["precision"] = precision
    if tensor_parallel is not None:
        from modulec.lower.tensor_parallel import section, shard_weight_schema

        document["weight_schema"] = shard_weight_schema(document["weight_schema"], graph,
                                                        tensor_parallel)
        document["schedule"]["tensor_parallel"] = section(tensor_parallel)
    from modulec.ir.verify_document import read_by_graph

    document["weight_schema"] = read_by_graph(document["weight_schema"], graph)
    if request.distributed is not None:
        document["schedule"]["distributed"] = _distributed(graph, document, request)
    _pipeline(graph, document, request)
    return BuildResult(diagnostics, document, graph, loaded.source, notes=notes)


def _precision(program, decl, graph, request: BuildRequest) -> tuple[dict | None, list]:
    """(metadata `precision`: the FP8 recipe (`@recipe(...)`, `--precision fp8`) per matmul,
    or None; its diagnostics)."""
    from modulec.lower.fp8_recipe import precision_section, program_recipe

    if request.precision_overrides and request.precision != "fp8":
        raise ValueError("precision_overrides change the std FP8 recipe: precision='fp8' only")
    recipe, covered, problems = program_recipe(program, decl.name, request.precision == "fp8",
                                               request.precision_overrides)
    if recipe is None or any(d.is_error for d in problems):
        return None, problems
    return precision_section(graph, recipe, covered), problems


def _pipeline(graph, document: dict, request: BuildRequest) -> None:
    """The pipeline section, when asked for or when the model has `@partition` stages; the
    distributed section's mesh then counts its stages. It needs every dim sized (the
    split's costs, the boundaries' bytes): without, a model's own stages write none."""
    from modulec.plan.from_graph import ShapeUnknown
    from modulec.plan.pipeline import Pipeline, PipelineError, has_partition, pipeline_section

    if request.pipeline is None and not has_partition(graph):
        return
    options = request.pipeline or Pipeline()
    if request.distributed is not None:  # its data-parallel size is the pipelines'
        options = replace(options, dp=request.distributed.dp, zero=0)
    options = replace(options, tp=request.tensor_parallel)  # each stage a TP rank program
    from modulec.plan.pipeline_shared import schema_ties

    try:  # a tied parameter's stages share its target's tensor
        section = pipeline_section(graph, options,
                                   ties=schema_ties(document["weight_schema"]))
    except ShapeUnknown as exc:
        if request.pipeline is None:
            return
        raise PipelineError(f"the pipeline needs every size: {exc}") from None
    document["schedule"]["pipeline"] = section
    if "distributed" in document["schedule"]:
        document["schedule"]["distributed"]["mesh"]["pp"] = len(section["stages"])


def _sharding_fails(world, instance, request: BuildRequest) -> bool:
    """With `--tp M`: whether a `@shard` cannot split across M (E027 / E008 reported)."""
    if request.tensor_parallel == 1:
        return False
    from modulec.lower.tensor_parallel import shards

    before = len(world.diagnostics)
    shards(world, instance, lambda world, instance: "")
    return any(d.is_error for d in world.diagnostics[before:])


def _tensor_parallel(world, instance, request: BuildRequest):
    """With `--tp M`: the sharded parameters (E027 / E008 into world.diagnostics)."""
    from modulec.lower.tensor_parallel import sequence_parallel_problem, shards

    if request.tensor_parallel == 1:
        problem = sequence_parallel_problem(request.tensor_parallel, request.sequence_parallel)
        if problem:
            world.diagnostics.append(error(
                "E008", problem, None,
                help=["add `--tp 2` (docs/distributed.md, Sequence parallel)"]))
        return None
    from modulec.lower.lowering import function_name

    found = shards(world, instance, function_name)
    found.sequence_parallel = request.sequence_parallel
    found.overlap = request.tp_overlap
    if not found.shards:  # every rank would run the whole model
        world.diagnostics.append(error(
            "E008", f"`--tp {request.tensor_parallel}`: no parameter of `{instance.name}` "
            "is `@shard(column)` or `@shard(row)`, so there is nothing to split", None,
            help=["mark the parameters (docs/distributed.md, Tensor parallel), or build "
                  "without `--tp`"]))
    return found


def _rank_planning(planning, graph, instance, world, request: BuildRequest, resolver):
    """A budget under data parallel is one rank's: the planner counts what a rank holds
    (its ZeRO share of the trained state, communication buffers) as fixed, not one GPU's
    whole fp32 state. `--zero auto` picks the stage here (request.distributed is set to
    it); returns the planning options and the choice in words ("" when given)."""
    from dataclasses import replace

    from modulec.lower.build_plan import choose_zero
    from modulec.plan.distributed import AUTO, DataParallel, planner_fixed_bytes

    training = training_metadata(graph, world.param_settings) or {}
    schema = _weight_schema(instance)
    dp = request.distributed
    if dp.zero != AUTO:
        section = _distributed_section(graph, schema, training, request)
        return replace(planning, fixed_bytes=planner_fixed_bytes(graph, section)), ""
    sections = {z: _distributed_section(graph, schema, training, replace(
        request, distributed=DataParallel(dp.dp, z))) for z in (2, 3)}
    zero, choice = choose_zero(graph, resolver, planning, sections)
    request.distributed = DataParallel(dp.dp, zero)
    return replace(planning, fixed_bytes=planner_fixed_bytes(graph, sections[zero])), choice


def _distributed(graph, document: dict, request: BuildRequest) -> dict:
    return _distributed_section(graph, document["weight_schema"],
                                document["metadata"].get("training", {}), request)


def _distributed_section(graph, weight_schema: list, training: dict,
                         request: BuildRequest) -> dict:
    """The data-parallel section over the parameters the step trains: not a tied one
    (its target owns the update) nor a `@frozen` one, with LoRA only the adapters."""
    from modulec.lower.lora import is_adapter
    from modulec.plan.distributed import data_parallel_section, parameter_paths

    tied = {e["param"]: e.get("target") for e in weight_schema
            if e.get("kind") == "tied" and not e.get("stacks")}
    frozen = set(training.get("frozen", ()))
    trained = {p for p in parameter_paths(graph) if p not in tied and p not in frozen and
               (request.lora is None or is_adapter(p))}
    return data_parallel_section(graph, request.distributed, trained,
                                 {p: t for p, t in tied.items() if t is not None})


# ====================================================================== the model and its sizes
BUILDABLE = ("model", "block", "module")  # a module or block builds only when named


def _model(program: A.Program, name: str | None, diagnostics) -> A.Decl | None:
    models = [d for d in program.decls if d.kind == "model"]
    chosen = [d for d in program.decls if d.kind in BUILDABLE and d.name == name] if name \
        else models
    if len(chosen) == 1:
        return chosen[0]
    listed = ", ".join(d.name for d in models) or "none"
    what = f"no model `{name}`" if name else ("no model" if not models else "several models")
    diagnostics.append(error("E012", f"{what} to build in this file (models: {listed})", None,
                             help=["name one with `--model NAME`"] if models else
                             ["`modulec build` builds a `model` declaration"]))
    return None


def _arguments(decl: A.Decl, request: BuildRequest, diagnostics, notices) -> dict | None:
    known = {p.name: p for p in decl.params or ()}
    args: dict = {}
    if request.config is not None:
        args.update(_from_config(decl, request.config, diagnostics, notices))
    for name, text in request.settings.items():
        if name not in known:
            import difflib
            close = difflib.get_close_matches(name, list(known), n=1)
            diagnostics.append(error("E012", f"`--set {name}`: `{decl.name}` has no parameter "
                                     f"`{name}`", None, help=[f"did you mean `{close[0]}`?"]
                                     if close else [f"parameters: {', '.join(known)}"]))
            continue
        value, problem = setting_value(text)
        if problem is not None:
            shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
            shown = shown.replace("\n", "\\n").replace("\r", "\\r")
            diagnostics.append(error(problem.code, f"`--set {name}={shown}`: {problem.message}",
                                     None, help=[problem.help]))
            continue
        args[name] = value
    for name, value in args.items():
        problem = value_problem(known[name], value) if name in known else None
        if problem is not None:
            where = f"`--set {name}`" if name in request.settings else \
                f"`{name}` from the config"
            diagnostics.append(error(problem.code, f"{where}: {problem.message}", None,
                                     help=[problem.help]))
    return None if any(d.is_error for d in diagnostics) else args


def _from_config(decl: A.Decl, path: Path, diagnostics, notices) -> dict:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        diagnostics.append(error("E010", f"cannot read HuggingFace config {path}: {exc}", None))
        return {}
    if not isinstance(config, dict):  # a list or a number crashed the field lookups (101)
        diagnostics.append(error("E010", f"HuggingFace config {path} is a JSON "
                                 f"{type(config).__name__}, not an object", None,
                                 help=["config.json holds one object of fields"]))
        return {}
    values = {}
    config = with_legacy_types(config, notices, Path(path))
    mapped = with_aliases({field_name for _, field_name in _param_mapping(decl)})
    diagnostics += rope_problems(config, mapped, Path(path))
    diagnostics += unmapped_field_problems(config, mapped, Path(path))
    for param, field_name in _param_mapping(decl):
        raw = config_field(config, field_name)
        for alias in FIELD_ALIASES.get(field_name, ()) if raw is None else ():
            raw = config_field(config, alias) if raw is None else raw
        if raw is None and is_scaling_field(field_name):
            continue  # a RoPE scaling key: absent unless the rope type reads it
        if raw is None:
            how = "is null" if field_name in config else "is missing"
            notices.append(f"{path}: `{field_name}` {how}; `{param}` keeps its default")
            continue
        values[param] = _config_value(raw)
    unread_by_kind(config, list(_param_mapping(decl)), values, notices, Path(path))
    return values


def _config_value(raw):
    """A config.json value as a compile-time value: integers are sizes (Dim), a list a
    tuple of such values (longrope's factor lists)."""
    if isinstance(raw, list):
        return tuple(_config_value(v) for v in raw)
    return Dim.const(raw) if isinstance(raw, int) and not isinstance(raw, bool) else raw


def _param_mapping(decl: A.Decl):
    for item in decl.body:
        if isinstance(item, A.Section) and item.name == "hf_config":
            for sub in item.body:
                if isinstance(sub, A.Section) and sub.name == "param_mapping":
                    for entry in sub.body:
                        if isinstance(entry, A.Entry) and isinstance(entry.value, A.Name):
                            yield entry.key.id, entry.value.id


# ====================================================================== schemas
def _weight_schema(instance) -> list:
    try:
        from modulec.check.weights import hf_plan
    except ImportError:
        return []
    return hf_plan(instance)


def _config_schema(decl: A.Decl) -> dict:
    mapping = dict(_param_mapping(decl))
    defaults = {p.name: _text(p.default) for p in decl.params or () if p.default is not None}
    hf = next((i for i in decl.body if isinstance(i, A.Section) and i.name == "hf_config"), None)
    fields = {e.key.id: e.value.value for e in hf.body if isinstance(e, A.Entry)
              and isinstance(e.value, A.String)} if hf else {}
    return {"hf": fields, "param_mapping": mapping, "defaults": defaults}


def _metadata(decl, instance, graph, request) -> dict:
    entry = graph.function(graph.entry)
    hooks = sorted({args[0] for f in graph.functions for n in f.nodes
                    for name, args in n.annotations if name == "hook" and args})
    return {
        "model": decl.name,
        "source": str(request.path),
        "parameters": {k: str(v) for k, v in sorted(instance.values.items())},
        "inputs": [{"name": v.name or v.id, "shape": list(v.shape), "dtype": v.dtype}
                   for v in entry.inputs],
        "outputs": [{"value": o, "shape": list(entry.value(o).shape), "dtype":
                     entry.value(o).dtype} for o in entry.outputs if entry.value(o)],
        "hook_points": hooks,
        "functions": len(graph.functions),
    }


def _lora_metadata(options, report) -> dict:
    return {"rank": options.rank, "alpha": options.alpha, "targets": list(options.targets),
            "dropout": options.dropout, "adapters": report.adapters}


def _text(node) -> str:
    from modulec.syntax.printer import expr

    return expr(node)
