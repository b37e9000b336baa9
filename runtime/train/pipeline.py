"""The trainer of a pipeline-parallel run (`torchrun --nproc-per-node D x P -m modulec
train MODEL --pp P --microbatches M`): rank r holds stage r % P's parameters (the IR's
`pipeline` section lists them) in pipeline r // P and runs its 1F1B op list
(runtime.dist.pipeline) on the interpreter: on the CPU (gloo) in the model's dtype with
the reference kernels; on a GPU (NCCL) with bf16 compute copies of fp32 masters through
the GPU step's kernels (runtime/train/pipeline_precision.py), the whole step captured in
one CUDA graph from step 3 where it can be (runtime/train/pipeline_graph.py).

A step takes M micro-batches of --batch rows per pipeline: the loss and the gradients are
the mean over every pipeline's micro-batches (each stage's gradients averaged over its D
replicas by the section's all-reduces), as one process with `--grad-accum D x M` computes
them; each stage then steps AdamW on its own parameters. Global gradient-norm clipping
sums the squares of one pipeline's stages (an all-reduce); the loss sums every pipeline's
last stage's (an all-reduce), so that rank 0 reports the mean. Under the section's ZeRO-1
(`--zero 1`) a replica steps only the buckets it owns, at the section's `optimizer_step`
op, and keeps only their moments; the section's broadcasts then hand the weights on.

Packed (--doc-sep), every stage computes each micro-batch's documents from its rows and
the last stage leaves the ignored targets out (data-parallel pipelines divide by
runtime.train.packing.denominators, as data-parallel ranks do); --eval-data runs each
eval batch forward through the stages (`evaluate`). docs/pipeline.md "Packed sequences
and evaluation".

With --lora the stages run the LoRA program (its base frozen: no gradient, no moments):
the model is built and its adapters drawn whole, as one process draws them, before each
stage drops the other stages' parameters, so a stage trains its layers' adapters, and
`state()` gathers them with the base for the PEFT adapter file (docs/pipeline.md "LoRA").

A parameter the section's `shared` list names (a tied LM head's embedding, a `tied_to`
target) is kept by each of its stages under the owner's name, its tied paths reading
that copy; the runner sums the copies' gradients over their stages, so each steps alike,
the clipping norm counts it on its first stage only, and `state()` joins the stages by
path, the owner once (docs/pipeline.md "Shared and tied parameters").
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.errors import RuntimeUserError
from runtime.inputs import fed_inputs, sized_inputs
from runtime.interpreter import Interpreter
from runtime.model import Model
from runtime.train.backends import owned_paths
from runtime.train.optim import AdamW
from runtime.train.pipeline_graph import WARMUP, PipelineGraph, capturable
from runtime.train.pipeline_precision import (DeviceAdamW, StagePrecision, convert_shared,
                                              load_moments)
from runtime.train.param_groups import (clip_coefficient, clip_gradient, frozen_parameters,
                                        hyperparameters, lr_scale)


def check_launch(request, context) -> None:
    """--pp and --microbatches against the launch, before anything is built; with --pp
    the step's micro-batches are its accumulation (request.grad_accum = M), so a
    pipeline step is one process's `--grad-accum M` step and checkpoints resume across."""
    pp, micro = request.pp, request.microbatches
    if pp == 1:
        if micro is not None:
            raise RuntimeUserError("--microbatches is the pipeline's: it needs --pp P",
                                   help=["use --grad-accum K to accumulate on one "
                                         "pipeline-less run"])
        return
    if not context.distributed:
        raise RuntimeUserError(f"--pp {pp} runs one stage per process; this is one process",
                               help=[f"launch torchrun --nproc-per-node {pp} -m modulec "
                                     "train ..."])
    for flag, given in (("--zero", request.zero not in (None, 0, 1)),
                        ("--memory-budget", getattr(request, "memory_budget", None) is not None)):
        if given:
            raise RuntimeUserError(f"{flag} with --pp: not supported yet",
                                   help=["pipeline runs train every parameter (with --lora "
                                         "the adapters), one stage a process (or --tp M "
                                         "processes), the pipelines data parallel (ZeRO 0 "
                                         "or 1: each stage's gradients all-reduced)"])
    group = pp * request.tp
    if context.world % group:
        raise RuntimeUserError(f"the {context.world} processes are not a multiple of --pp "
                               f"{pp} x --tp {request.tp} = {group}: each data-parallel "
                               f"replica is one pipeline of {group} processes",
                               help=[f"launch a multiple of {group}: torchrun "
                                     f"--nproc-per-node {group} (or {2 * group}, ...)"])
    if request.zero == 1 and context.world == group:
        raise RuntimeUserError(f"--zero 1 with --pp shards each stage's optimizer state over "
                               f"its data-parallel replicas; these {context.world} "
                               "processes are one pipeline",
                               help=[f"launch {2 * group} processes or more, or leave out "
                                     "--zero"])
    if request.grad_accum != 1:
        raise RuntimeUserError("--grad-accum with --pp: the pipeline's micro-batches are "
                               "its accumulation", help=["use --microbatches M"])
    if micro is None:  # an IR document's own, else 4 x P
        micro = ir_microbatches(request.file) if request.file.suffix == ".ir" else 4 * pp
    if micro < pp:
        raise RuntimeUserError(f"--microbatches {micro} is fewer than the {pp} pipeline "
                               "stages: some stage would never overlap another",
                               help=[f"give --microbatches {pp} or more (4 x {pp} keeps "
                                     "the idle share under 20%)"])
    request.microbatches = request.grad_accum = micro


def pipeline_replica(request, context) -> tuple[int, int]:
    """(data-parallel size, this rank's data-parallel index) of a pipeline run: rank r is
    in pipeline r // (P x TP), which reads its own rows as a data-parallel rank does;
    (1, 0) without --pp."""
    if request.pp == 1 or not context.distributed:
        return 1, 0
    group = request.pp * request.tp
    return context.world // group, context.rank // group


def ir_microbatches(path) -> int:
    """The micro-batch count of an IR document's pipeline section."""
    import json

    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeUserError(f"cannot read {path}: {exc}") from None
    schedule = document.get("schedule") if isinstance(document, dict) else None
    section = schedule.get("pipeline") if isinstance(schedule, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("microbatches"), int):
        raise RuntimeUserError(f"{path} has no pipeline section",
                               help=["build it with `modulec build ... --pp P "
                                     "--microbatches M -o FILE.ir`"])
    return section["microbatches"]


def with_pipeline(model: Model, stages: int, microbatches: int, dp: int = 1,
                  zero: int = 0) -> Model:
    """The model rebuilt with a `pipeline` section of `stages` stages in its IR, for `dp`
    data-parallel pipelines (`zero` 1: their optimizer state sharded by bucket)."""
    from modulec.plan.pipeline import Pipeline

    model.source = replace(model.source, pipeline=Pipeline(stages, microbatches, dp, zero),
                           _built={}, _declared=None)
    return model


class PipelineTrainer:
    def __init__(self, model: Model, batch: int, seq: int, adamw: AdamW, context,
                 stages: int, microbatches: int, device: str = "cpu",
                 zero: int | None = None, packing=None, mixed: bool | None = None,
                 graph: bool = True):
        """`zero`: --zero (0 or 1; None: an IR document's own, else 0); `packing`:
        --doc-sep's (runtime.train.packing.Packing; None: unpacked); `mixed`:
        bf16 compute copies of fp32 masters through the GPU step's kernels
        (runtime/train/pipeline_precision.py; None: on cuda, not on the CPU); `graph`:
        capture the step in one CUDA graph where it can be (runtime/train/
        pipeline_graph.py; False: every step eager)."""
        from modulec.plan.pipeline import pipeline_zero
        from runtime.dist.pipeline import StageRunner

        self.context, self.batch, self.seq, self.adamw = context, batch, seq, adamw
        self.device, self.microbatches, self.packing = device, microbatches, packing
        from runtime.program import IRSource

        from runtime.dist.mesh import PipelineMesh

        tp = getattr(model.source, "tensor_parallel", 1)  # each stage a TP rank program
        if not isinstance(model.source, IRSource):  # an IR document has its own section
            dp = max(context.world // (stages * tp), 1)
            with_pipeline(model, stages, microbatches, dp, pipeline_zero(zero, dp))
        names = model.source.program(planned=False).input_names()
        program = model.source.program_for(sized_inputs(names, batch, seq))
        section = _section(program, stages, microbatches, zero)
        context.same_program(program.document)
        _refuse_unsupported(model, program, section)
        self.model, self.program, self.inputs = model, program, names
        self.section = section  # the per-rank shards' layout (runtime/train/pipeline_shards.py)
        self.mesh = mesh = PipelineMesh.of(context, section["mesh"], summed_shared(section))
        from runtime.kernels.comm import set_tp_group

        set_tp_group(mesh.tp_group)  # the stage's tp_copy / tp_all_reduce (None: tp 1)
        from runtime.tensor_parallel import sharded_paths

        self.sharded = sharded_paths(program)  # path -> its shard (TP x PP), else {}
        self.stage = mesh.stage
        shared = [e for e in section["shared"] if self.stage in e["stages"]]
        own = set(section["stages"][self.stage]["params"]) | {e["param"] for e in shared}
        self.names = [p for p in owned_paths(model) if p in own]
        for path in [p for p in model.params if p not in own]:
            del model.params[path]  # another stage's
        convert_shared(model.params, lambda value: value.to(device))
        # a shared parameter's gradient is summed over its stages: the norm counts it once
        self.counted_elsewhere = {e["param"] for e in shared if e["stages"][0] != self.stage}
        self.frozen = frozen_parameters(program)
        self.precision = precision = StagePrecision.of(device, model.dtype, mixed)
        precision.refuse_own_dtypes(program, self.names)
        precision.hold(model.params, [p for p in self.names if p not in self.frozen],
                       [p for p in self.names if p in self.frozen])
        interpreter = Interpreter(program.graph, model.params, precision.compute,
                                  check_finite=model.check_finite and not precision.mixed,
                                  kernels=precision.kernels(),
                                  keep_only_saved=precision.mixed)
        self.runner = StageRunner(program.graph, section, self.stage, interpreter, device,
                                  precision, mesh)
        # mixed: the rate and the step count on the device, which a captured step reads
        self.device_adamw = DeviceAdamW(adamw, device) if precision.mixed else None
        self.eager_because = capturable(self) if graph else "asked for (graph=False)"
        self.graph = None if self.eager_because else PipelineGraph(self._step_body, device)
        self.owned = owned_buckets(section, mesh)
        self.grad_norm = None

    def train_step(self, window: Tensor, denominators: list[float] | None = None) -> float:
        """One step on this pipeline's M x B rows. Packed (--doc-sep), each micro-batch's
        documents are held around its forward and backward on every stage (each computes
        them from the rows), and the last stage's loss leaves the ignored targets out: a
        micro-batch's mean over its counted targets, or with `denominators`
        (runtime.train.packing.denominators, data-parallel pipelines) its summed loss
        divided by micro-batch m's, as packed data parallel does."""
        if window.shape[0] != self.batch * self.microbatches:
            raise RuntimeUserError(f"a pipeline step takes {self.microbatches} micro-batches "
                                   f"of {self.batch} rows; got {window.shape[0]} rows")
        if self.graph is not None:  # the rows into the static window, then a replay
            loss = self.graph(window)
        else:
            loss = self._step_body(window, denominators)
        if self.device_adamw is not None:
            self.adamw.step += 1  # the host's count; the device counted in the update
        return float(loss) / (self.microbatches * self.mesh.dp * self.mesh.tp)

    def _step_body(self, window: Tensor, denominators: list[float] | None = None) -> Tensor:
        """The step on `window`'s rows (on the host or, captured, in the static device
        window): the losses' sum over every pipeline (a device tensor)."""
        parts = window.split(self.batch)
        batches = [self._batch(part) for part in parts]
        inputs = [inputs for inputs, _, _ in batches]
        labels = [labels for _, labels, _ in batches]
        self.runner.documents_of = lambda m: batches[m][2]
        # dropout masks seeded as one process seeds them: replica d's micro-batch m is
        # micro-batch d x M + m of the step's rows
        step, first = self.adamw.step, self.mesh.dp_index * len(parts)
        self.runner.seed_of = lambda m: step * 65_536 + first + m
        stepped = []

        def update(total: dict) -> None:  # the section's optimizer_step, or after it all
            self._update({p: g / len(parts) for p, g in total.items() if p in self.names})
            stepped.append(True)

        def loss_of(m: int, outputs: list):
            shared = {} if denominators is None else {"denominator": denominators[m]}
            return _loss(outputs, labels[m], self._loss_fn(shared))

        try:
            losses, total = self.runner.step(inputs, loss_of, update)
        finally:
            self.runner.documents_of = None
        if not stepped:
            update(total)
        return self._loss_sum(losses)

    def _batch(self, rows: Tensor) -> tuple[dict, Tensor, object]:
        """A micro-batch's rows -> (the entry's inputs by input id, the labels (packed:
        the ignored targets marked), its documents (None: unpacked)), on the device."""
        from runtime.kernels.documents import Documents
        from runtime.train.packing import split_batch

        tokens, labels, documents = split_batch(rows, self.packing)
        if documents is not None:
            documents = Documents(documents.segments.to(self.device),
                                  documents.positions.to(self.device))
        fed = fed_inputs(self.inputs, tokens.to(self.device),
                         documents.positions if documents is not None else None)
        entry = self.program.graph.function(self.program.graph.entry)
        return ({i.id: fed[n] for i, n in zip(entry.inputs, self.inputs)},
                labels.to(self.device), documents)

    def _loss_fn(self, shared: dict):
        """The last stage's loss of the logits: vocab-parallel on a `@shard(vocab)`
        head's slice (runtime.tensor_parallel.logits_loss), packed: the ignored targets
        left out (`shared`: a denominator)."""
        from runtime.tensor_parallel import logits_loss

        loss_fn = logits_loss(self.program, self.program.output_names()[0])
        ignore = -100 if self.packing is None else self.packing.ignore_index
        return lambda logits, labels: loss_fn(logits, labels, ignore_index=ignore, **shared)

    def evaluate(self, data) -> float:
        """The mean eval loss of `data`'s batches (runtime.train.evaluate.EvalData; a
        collective: every rank calls it) on every rank: pipeline d runs batches i with
        i % D == d, each one forward through the stages (StageRunner.forward_only: no
        dropout, nothing kept), the last stage's loss; one all_reduce over every rank
        sums the last stages' sums (one TP rank's each)."""
        total = 0.0
        for index in range(self.mesh.dp_index, data.batches, self.mesh.dp):
            inputs, labels, documents = self._batch(data.batch_at(index))
            outputs = self.runner.forward_only(inputs, documents)
            if outputs is not None:  # the cross-entropy alone, as one process evaluates
                total += float(self._loss_fn({})(outputs[0], labels)[0])
        counted = self.runner.plan.last and self.mesh.tp_index == 0
        value = torch.tensor([total if counted else 0.0], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(value)
        return float(value) / data.batches

    def _update(self, total: dict) -> None:
        settings = {p: hyperparameters(self.program, p, self.adamw) for p in total}
        total = {p: clip_gradient(g, settings[p][2]) for p, g in total.items()
                 if p not in self.frozen}
        square = self._square(total)
        # every stage's share of the global norm (the replicas' gradients are equal)
        dist.all_reduce(square, group=self.mesh.pp_group)
        self.grad_norm = square.sqrt()
        scale = None if self.adamw.clip_grad is None else \
            clip_coefficient(self.grad_norm, self.adamw.clip_grad)
        if self.owned is not None:  # ZeRO-1: the buckets this replica steps
            total = {p: g for p, g in total.items() if p in self.owned}
        weights = self.precision.weights(self.model.params)
        if self.device_adamw is not None:
            self.device_adamw.update(
                weights, total, lambda p: (lr_scale(self.program, p), settings[p][1]), scale)
        else:
            self.adamw.update(weights, total, lambda p: settings[p][:2], scale)
        self.precision.refresh(self.model.params, total)

    def _square(self, total: dict) -> Tensor:
        """This stage's squared gradient norm (0-d): under TP its slices' summed over the
        TP group, the replicated parameters' once (runtime/dist/tp_norm.py); a shared
        parameter's on the first of its stages only."""
        from runtime.dist.tp_norm import squares, tp_squares

        total = {p: g for p, g in total.items() if p not in self.counted_elsewhere}
        if self.mesh.tp == 1:
            return squares(total.values(), torch.float64, self.device).reshape(())
        return tp_squares(total, self.sharded, self.mesh.tp_group, torch.float64,
                          self.device).reshape(())

    def _loss_sum(self, losses: list[Tensor]) -> Tensor:
        """The sum of every pipeline's micro-batch losses (their last stages', each TP
        rank's the same), on every rank, on the device (train_step reads it once)."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        for loss in losses:  # in order, as a Python sum of the floats would add them
            value += loss.to(torch.float64)
        dist.all_reduce(value)
        return value

    def graph_note(self) -> str:
        """What the run says of its steps on the GPU: captured, or eager and why."""
        if self.eager_because is None:
            return ("--pp on the GPU: bf16 stages with fp32 masters; from step "
                    f"{WARMUP + 1} each rank replays its whole step as one CUDA graph")
        return f"--pp on the GPU: bf16 stages with fp32 masters, every step eager: " \
               f"{self.eager_because}"

    def set_lr(self, lr: float) -> None:
        self.adamw.lr = lr
        if self.device_adamw is not None:  # what the (captured) update reads
            self.device_adamw.lr.fill_(float(lr))

    def step_metrics(self) -> dict:
        return {} if self.grad_norm is None else {"grad_norm": float(self.grad_norm)}

    def stage_state(self) -> dict:
        """This stage's state (its parameters only)."""
        weights = self.precision.weights(self.model.params)
        return {"masters": {p: weights[p] for p in self.names},
                "exp_avg": self.adamw.exp_avg, "exp_avg_sq": self.adamw.exp_avg_sq,
                "step": self.adamw.step}

    def state(self, moments: bool = True) -> dict:
        """The whole state, every stage's joined (a collective in the first pipeline: each
        rank's goes through the host to each of its ranks, pickled; see docs/pipeline.md
        "Checkpoints"). The other pipelines' replicas hold the same state, and rank 0
        writes it: they return the step alone. `moments=False`: the masters alone. (A
        checkpoint does not take this whole state: runtime/train/pipeline_shards.py's
        PipelineSource streams the masters to rank 0 one at a time.)"""
        mine = {part: {p: t.detach().cpu() for p, t in values.items()}
                for part, values in self.stage_state().items()
                if part != "step" and (moments or part == "masters")}
        if self.owned is not None and moments:  # ZeRO-1: the replicas' moments joined
            replicas = [None] * self.mesh.dp
            dist.all_gather_object(replicas, mine, group=self.mesh.dp_group)
            mine = {part: {p: t for r in replicas for p, t in r[part].items()}
                    for part in mine}
        if self.mesh.dp_index:
            return {"step": self.adamw.step}
        if self.mesh.tp > 1:  # the stage's TP slices joined into whole tensors
            mine = self._whole(mine)
            if self.mesh.tp_index:
                return {"step": self.adamw.step}
        stages = [None] * self.mesh.pp
        dist.all_gather_object(stages, mine, group=self.mesh.pp_group)
        joined = {part: {p: t for s in stages for p, t in s[part].items()} for part in mine}
        return {"exp_avg": {}, "exp_avg_sq": {}} | joined | {"step": self.adamw.step}

    def checkpoint_source(self, moments: bool = False):
        """Every stage's masters streamed to rank 0 for `model.safetensors`
        (runtime/train/pipeline_shards.py); the shards hold the optimizer state."""
        from runtime.train.pipeline_shards import PipelineSource

        if moments:  # the shards replace optimizer.safetensors (shards.replaces_optimizer)
            raise ValueError("a pipeline's checkpoint streams the masters alone")
        return PipelineSource(self)

    def shard_state(self) -> dict:
        """What this rank's shard keeps (runtime/train/pipeline_shards.py)."""
        from runtime.train.pipeline_shards import held_state

        return held_state(self)

    def load_shard(self, state: dict) -> None:
        """This rank's shard back (the same layout; a collective over the stage's
        replicas)."""
        from runtime.train.pipeline_shards import load_held

        load_held(self, state)

    def _whole(self, mine: dict) -> dict:
        """This stage's state with its TP slices joined with the TP group's (a
        collective over it)."""
        from runtime.tensor_parallel import unshard_tensors

        ranks = [None] * self.mesh.tp
        dist.all_gather_object(ranks, mine, group=self.mesh.tp_group)
        return {part: {p: unshard_tensors([r[part][p] for r in ranks], self.sharded[p])
                       if p in self.sharded else t for p, t in values.items()}
                for part, values in mine.items()}

    def load_state(self, state: dict) -> None:
        """A whole state (a checkpoint's; under TP this rank's slices of it, as
        runtime.train.data_parallel.rank_state cuts them): this stage takes its
        parameters' part."""
        with torch.no_grad():
            for path in self.names:
                self.precision.load(self.model.params, path, state["masters"][path])
        mine = self.names if self.owned is None else \
            [p for p in self.names if p in self.owned]
        for part in ("exp_avg", "exp_avg_sq"):  # into the tensors a captured step updates
            load_moments(getattr(self.adamw, part), state[part], mine, self.device)
        self.adamw.step = int(state["step"])
        if self.device_adamw is not None:
            self.device_adamw.sync()

    def memory(self) -> dict:
        import resource

        if self.device == "cuda":
            return {"peak_bytes": torch.cuda.max_memory_allocated(), "what": "GPU"}
        return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "what": "host RSS"}


def summed_shared(section: dict) -> dict[int, list[int]]:
    """The shared entries whose copies' gradients the section's ops sum (index -> their
    stages): each needs a process group."""
    summed = {op["shared"] for ops in section["ops"] for op in ops
              if op.get("group") == "shared"}
    return {i: section["shared"][i]["stages"] for i in sorted(summed)}


def _loss(outputs: list, labels: Tensor, loss_fn=None):
    """The cross-entropy of the logits (`loss_fn`: runtime.tensor_parallel.logits_loss's,
    vocab-parallel on a `@shard(vocab)` head's slice; None: whole logits) plus the
    auxiliary losses (0-d outputs: the MoE load-balancing loss, seed 1), and the seeds of
    the last stage's outputs."""
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.train.aux_loss import auxiliary_seeds

    logits = outputs[0]
    loss, d_logits = (loss_fn or logits_cross_entropy)(logits, labels)
    aux_seeds, _ = auxiliary_seeds(list(outputs[1:]))
    for value, seed in zip(outputs[1:], aux_seeds):  # each in the loss's dtype, in order,
        if seed is not None:                         # as one process adds them
            loss = loss + value.to(loss.dtype)
    # the loss stays on the device (no host sync per micro-batch: the GPU keeps queueing)
    return loss.detach(), [d_logits.to(logits.dtype)] + aux_seeds


def owned_buckets(section: dict, mesh) -> set[str] | None:
    """Under the section's ZeRO-1, the parameter paths this replica steps (its stage's
    buckets it owns); None: it steps every parameter of its stage."""
    if section.get("zero", 0) != 1:
        return None
    buckets = section["stages"][mesh.stage].get("grad_buckets", [])
    return {row["path"] for b in buckets if b["owner"] == mesh.dp_index
            for row in b["params"]}


def _section(program, stages: int, microbatches: int, zero: int | None = None) -> dict:
    section = program.document.get("schedule", {}).get("pipeline")
    if section is None:
        raise RuntimeUserError("the IR has no pipeline section",
                               help=["build it with `modulec build ... --pp P "
                                     "--microbatches M -o FILE.ir`"])
    if len(section["stages"]) != stages or section["microbatches"] != microbatches:
        raise RuntimeUserError(f"the IR's pipeline has {len(section['stages'])} stages and "
                               f"{section['microbatches']} micro-batches; this run asks for "
                               f"{stages} and {microbatches}")
    if section.get("schedule") != "1f1b":
        raise RuntimeUserError(f"pipeline schedule `{section.get('schedule')}` is not one "
                               "this runtime runs (1f1b)")
    for key in ("mesh", "shared"):
        if key not in section:
            raise RuntimeUserError(f"the IR's pipeline section has no `{key}` (built by an "
                                   "older modulec)",
                                   help=["rebuild it with `modulec build ... --pp P`"])
    if zero is not None and section.get("zero", 0) != zero:
        raise RuntimeUserError(f"the IR's pipeline was built for ZeRO-{section.get('zero', 0)}"
                               f"; this run asks for --zero {zero}",
                               help=["leave out --zero, or rebuild with `modulec build ... "
                                     f"--pp P --dp N --zero {zero}`"])
    distributed = program.document["schedule"].get("distributed")
    if distributed is not None:
        raise RuntimeUserError(f"--zero with --pp: not supported yet (the IR has a "
                               f"`distributed` section, ZeRO-{distributed.get('zero')}; the "
                               "pipelines' gradients are all-reduced per stage, unsharded)",
                               help=["build it without --zero: modulec build ... --pp P "
                                     "--dp N"])
    return section


def _refuse_unrecorded_sharing(ties: dict, section: dict) -> None:
    """A tie (`tied_to`) or a parameter two stages hold that the section's `shared` list
    does not record (a tie inside repeated layers, which the build does not record): an
    error, never two copies trained apart."""
    recorded = {p for entry in section["shared"] for p in entry["paths"]}
    held: dict[str, list[int]] = {}
    for stage in section["stages"]:
        for path in stage["params"]:
            held.setdefault(path, []).append(stage["stage"])
    unrecorded = sorted(p for p in ties if p not in recorded)
    if unrecorded:
        raise RuntimeUserError(f"--pp with tied weights inside repeated layers "
                               f"({', '.join(unrecorded[:3])}) is not supported yet: the "
                               "IR's pipeline section records entry-level ties only",
                               help=["train it data parallel (--zero) or on one process"])
    apart = sorted(p for p, stages in held.items() if len(stages) > 1 and p not in recorded)
    if apart:
        raise RuntimeUserError(f"the IR's pipeline section has parameters two stages hold "
                               f"({', '.join(apart[:3])}) but no `shared` entry for them",
                               help=["rebuild it with `modulec build ... --pp P`"])


def _refuse_unsupported(model: Model, program, section: dict) -> None:
    """What the pipeline does not run yet: an error, never a wrong step."""
    from runtime.hf_weights.schema import tied_targets

    built_tp = section["mesh"].get("tp", 1)
    if built_tp != getattr(model.source, "tensor_parallel", 1):  # `modulec ir verify`'s too
        raise RuntimeUserError(f"the IR's pipeline mesh says tp {built_tp}, but its stages "
                               f"are rank programs of tp "
                               f"{getattr(model.source, 'tensor_parallel', 1)}",
                               help=[f"rebuild it with `modulec build ... --pp "
                                     f"{len(section['stages'])} --tp {built_tp}`"])
    _refuse_unrecorded_sharing(tied_targets(program.weight_schema), section)
    _refuse_outputs(program, section)


def _refuse_outputs(program, section: dict) -> None:
    """The last stage's loss takes the logits and the auxiliary losses (the section's
    `outputs`); another output (not a 0-d float) is not trained under --pp yet."""
    names = program.output_names()
    rows = section.get("outputs")
    if rows is None and len(names) > 1:  # a document built before `outputs`
        raise RuntimeUserError(f"the IR's pipeline section does not say how its loss takes "
                               f"the outputs {', '.join(names)}",
                               help=["rebuild it with `modulec build ... --pp P`"])
    other = [r["name"] for r in rows or () if r["loss"] not in ("cross_entropy", "auxiliary")]
    if other:
        raise RuntimeUserError(f"--pp trains the logits and auxiliary losses (0-d float "
                               f"outputs); this model's output {', '.join(other)} is neither "
                               "and is not supported yet",
                               help=["train it on one process or data parallel (--zero)"])
