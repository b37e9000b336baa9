"""What `modulec train` does: load the model and its HF weights (or a checkpoint to
resume), read batches from a token file, run the steps with progress, save checkpoints.
Every user mistake is a RuntimeUserError (the CLI prints it; no traceback)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.errors import RuntimeUserError
from runtime.inputs import sized_inputs, unfed
from runtime.model import Model
from runtime.train.backends import CPUTrainer, CUDATrainer, check_device, now
from runtime.train.checkpoint import find_checkpoint, read_optimizer, read_trainer, save_checkpoint
from runtime.train.data import check_batch_fits, TokenData, default_token_dtype
from runtime.train.optim import AdamW
from runtime.train.pipeline import pipeline_replica
from runtime.train.progress import Progress, gib

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESUME_KEYS = ("batch", "seq", "seed", "repeat_batch", "grad_accum", "doc_sep")
RESUME_DEFAULTS = {"grad_accum": 1, "doc_sep": None}  # checkpoints saved before the key
FP8_FLAGS = {"scaling": "--fp8-scaling", "gradient": "--fp8-gradient",
             "history_len": "--fp8-history"}  # Request.precision_overrides' options


@dataclass
class Request:
    file: Path
    data: Path
    seq: int
    batch: int
    steps: int
    grad_accum: int = 1  # micro-batches of `batch` samples per optimizer step
    hf_weights: Path | None = None
    dtype_tokens: str | None = None
    lr: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0
    save: Path | None = None
    save_every: int | None = None
    save_dtype: str = "auto"
    max_shard_size: int | None = None  # --save: HF's sharded form above it (None: 5GB)
    resume: Path | None = None
    device: str = "cuda"
    memory_budget: int | None = None
    repeat_batch: bool = False
    fmt: str = "human"
    settings: dict = field(default_factory=dict)
    model: str | None = None
    search_path: tuple = ()
    lora: object = None  # modulec.lower.lora.LoraOptions: adapters trained, base frozen
    precision: str | None = None  # "fp8": the std FP8 recipe (runtime/fp8.py)
    precision_overrides: dict | None = None  # --fp8-*: its scaling / gradient format
    zero: int | None = None  # data parallel under torchrun: the ZeRO stage (default 2)
    # tensor parallel: consecutive ranks split each layer (the rest is data parallel); None:
    # 1, or an IR document's own size (document_parallel)
    tp: int | None = 1
    sp: bool = False  # sequence parallel with --tp: the norms on T / tp rows a rank
    no_tp_overlap: bool = False  # with --tp: the backward collectives in order
    dist_timeout: int = 600  # seconds a collective may take before every rank stops
    # the optimizer (runtime.train.optim_options, docs/training.md "Optimizer")
    lr_schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None  # wsd: the decay's steps (or decay_fraction of steps)
    decay_fraction: float | None = None
    decay_shape: str | None = None  # wsd: linear (default), cosine, 1-sqrt
    clip_grad: float | None = None  # global gradient-norm clipping
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    decay_all: bool = False  # weight decay on norms, biases and embeddings too
    init: str | None = None  # "random": from scratch (runtime/train/init.py)
    config: Path | None = None  # with --init random: the HF config.json sizing the model
    max_memory: int | None = None  # --max-memory: the host bytes the model may need
    eval_data: Path | None = None  # evaluation (runtime/train/evaluate.py)
    eval_every: int | None = None
    eval_batches: int | None = None
    log_dir: Path | None = None  # metrics.jsonl + TensorBoard (runtime/train/metrics.py)
    log_every: int = 1  # a record every K steps, their means (runtime/train/log_window.py)
    pp: int = 1  # pipeline stages, one process each (runtime/train/pipeline.py)
    microbatches: int | None = None  # with --pp: micro-batches per step (default 4 x pp)
    doc_sep: int | None = None  # packed sequences: the end-of-document id (packing.py)
    ignore_index: int = -100  # packed: the label of the targets left out of the loss
    built_lora: bool = False  # an IR document built with --lora (document_parallel)


def train_model(**kwargs) -> str:
    request = Request(**kwargs)
    check_device(request.device)
    document_parallel(request)
    _check_numbers(request)
    context = _context(request)
    try:
        summary = _train(request, context)
        if context.backend == "gloo":  # every rank past its last collective before any
            context.barrier()  # leaves the group
    finally:
        context.close()  # gloo: leave the group; the command line then ends a torchrun
        # rank's process at once (end_joined_process: torch's teardown at exit can abort)
    if context.backend == "nccl":  # its shutdown can hang after captured collectives
        print(summary if context.is_main else "", flush=True)
        context.exit_now()
    return summary if context.is_main else ""


def _train(request: Request, context) -> str:
    resumed = _resumed(request.resume)
    weights = resumed[0] if resumed else request.hf_weights
    if weights is None and request.init is None:
        raise RuntimeUserError("give the weights to start from: --hf-weights DIR (or "
                               "--resume DIR), or train from scratch: --init random")
    check_batch_fits(request.data, request.dtype_tokens, request.seq,
                     request.batch * request.grad_accum)
    _check_eval(request, context)
    model = _model(request, weights, context.rank % request.tp)
    sizes = _sizes(model, request)
    parallel = _parallel(request, context, model)
    dp = parallel.dp if parallel is not None else pipeline_replica(request, context)[0]
    data = TokenData(request.data, request.dtype_tokens or default_token_dtype(sizes[0]),
                     request.seq, request.batch * request.grad_accum * dp,
                     request.seed, sizes[0], request.repeat_batch)
    run = Run(request, model, data, weights, context, parallel)
    if resumed:
        run.resume(*resumed)
    return run.train()


def _check_eval(request: Request, context) -> None:
    """The evaluation options, and the eval file's size, before the model is built."""
    from runtime.train.evaluate import check_eval_options

    check_eval_options(request.eval_data, request.eval_every, request.eval_batches)
    if request.eval_data is not None:
        check_batch_fits(request.eval_data, request.dtype_tokens, request.seq,
                         request.batch)


def _context(request: Request):
    """The process group torchrun set up (one process: none). Data parallel takes every
    rank: the data-parallel size is the world size."""
    from runtime.dist import DistContext
    from runtime.dist.context import launch_world

    check_lora_parallel(request, launch_world())  # before any CUDA or NCCL work
    context = DistContext.from_env(request.device, timeout_s=request.dist_timeout)
    check_zero(request, context)
    if request.file.suffix == ".ir" and context.world % request.tp:
        raise RuntimeUserError(f"{request.file} is a tensor-parallel rank program of size "
                               f"{request.tp} (its tensor_parallel section); this launch has "
                               f"{context.world} process{'es' if context.world > 1 else ''}",
                               help=[f"launch a multiple of {request.tp}: torchrun "
                                     f"--nproc-per-node {request.tp} -m modulec train ..."])
    from runtime.dist.context import check_tensor_parallel
    from runtime.train.pipeline import check_launch

    check_tensor_parallel(request.tp, request.sp, context.world)

    check_launch(request, context)  # --pp: the micro-batches become the accumulation
    return context


def document_parallel(request: Request) -> None:
    """The run's tensor-parallel size: --tp (default 1), or an IR document's own (the IR
    is the contract: a document built with `modulec build --tp M [--sp]` is one rank's
    program of M, and says so in its `tensor_parallel` section). A --tp, --sp or
    --no-tp-overlap that says otherwise is an error naming both."""
    if request.file.suffix != ".ir":
        request.tp = 1 if request.tp is None else request.tp
        return
    from modulec.ir.load import read_document
    from runtime.program import tp_overlapped, tp_sequence_parallel, tp_size

    document, problems = read_document(request.file)
    if problems:
        raise RuntimeUserError(f"cannot read IR: {problems[0]}")
    size, sp = tp_size(document), tp_sequence_parallel(document)
    if request.tp not in (None, size):
        raise RuntimeUserError(f"{request.file} was built with --tp {size}; this run asks "
                               f"for --tp {request.tp}",
                               help=[f"leave out --tp (the document's {size} is used), or "
                                     f"rebuild it with --tp {request.tp}"])
    if request.sp and not sp:
        raise RuntimeUserError(f"--sp: {request.file} was built without --sp",
                               help=["leave out --sp, or rebuild it with --tp M --sp"])
    if request.no_tp_overlap and (size == 1 or tp_overlapped(document)):
        raise RuntimeUserError(f"--no-tp-overlap: {request.file} was built "
                               + ("without --tp" if size == 1 else "with the overlap"),
                               help=["leave out --no-tp-overlap, or rebuild it with --tp M "
                                     "--no-tp-overlap"])
    request.tp, request.sp = size, sp
    request.built_lora = bool(document.get("metadata", {}).get("lora"))


def check_zero(request: Request, context) -> None:
    """--zero needs data-parallel ranks to shard across: more than one process, and with
    --tp M more processes than M (one TP group builds no `distributed` section, so the
    stage would be dropped)."""
    if request.zero is None:
        return
    if not context.distributed:
        raise RuntimeUserError(f"--zero {request.zero} shards across data-parallel "
                               "processes; this is one process",
                               help=["launch several: torchrun --nproc-per-node N -m "
                                     "modulec train ..., or leave out --zero"])
    if request.tp > 1 and context.world == request.tp:
        raise RuntimeUserError(f"--zero {request.zero} shards across data-parallel "
                               f"processes; --tp {request.tp} makes the {context.world} "
                               "processes one tensor-parallel group",
                               help=[f"launch a multiple of {request.tp} processes (each "
                                     f"{request.tp} more is one more data-parallel rank), or "
                                     "leave out --zero"])


def check_lora_parallel(request: Request, world: int) -> None:
    """--lora with --tp M under data parallel (more processes than M x --pp) on the GPU:
    refused until the four-GPU run trains (device run D9: rank 0 exited 101 there;
    docs/distributed.md "LoRA under tensor parallel"). The CPU (gloo) runs it. A launch
    --tp does not divide is check_tensor_parallel's error; with --pp the pipeline's own
    trainer runs (runtime.train.pipeline), LoRA included. An IR
    document built with --lora counts as --lora (document_parallel reads it)."""
    lora = request.lora is not None or request.built_lora
    if request.device != "cuda" or not lora or request.tp <= 1:
        return
    if request.pp > 1 or world <= request.tp or world % request.tp:
        return
    raise RuntimeUserError(f"--lora with --tp under data parallel is not supported on the "
                           f"GPU yet (--tp {request.tp} on {world} processes: "
                           f"{world // request.tp} data-parallel replicas)",
                           help=["run it with --device cpu, or with --tp alone "
                                 f"(torchrun --nproc-per-node {request.tp}), or data "
                                 "parallel alone (without --tp)"])


def _parallel(request: Request, context, model):
    """The run's tensor- and data-parallel layout (None: one process); the ZeRO stage is
    --zero's, an IR document's own, or 2."""
    if not context.distributed or request.pp > 1:  # a pipeline: one rank a stage
        return None
    from runtime.train.data_parallel import built_zero

    zero = request.zero if request.zero is not None else built_zero(model)
    return context.data_parallel(2 if zero is None else zero, tp=request.tp, sp=request.sp,
                                 tp_overlap=not request.no_tp_overlap)


def _check_numbers(request: Request) -> None:
    for name in ("seq", "batch", "steps", "grad_accum"):
        if getattr(request, name) < 1:
            raise RuntimeUserError(f"--{name.replace('_', '-')} must be at least 1")
    for option in ("save_every", "max_shard_size"):
        if getattr(request, option) is not None and request.save is None:
            raise RuntimeUserError(f"--{option.replace('_', '-')} needs --save DIR")
    _check_optimizer(request)
    from runtime.train.log_window import check_log_every

    check_log_every(request)
    from runtime.train.init import check_init

    check_init(request.init, request.hf_weights, request.resume, request.config)
    from runtime.train.packing import check_options

    check_options(request)


def _check_optimizer(request: Request) -> None:
    # Checked at start: --lr nan was blamed on the embedding at step 1, --lr -1 ran.
    import math

    from runtime.train.optim_options import check_optimizer_options

    for flag, value in (("--lr", request.lr), ("--weight-decay", request.weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise RuntimeUserError(f"{flag} is {value}: it must be a finite number >= 0",
                                   help=[f"for example {flag} 1e-4" if flag == "--lr"
                                         else f"for example {flag} 0.1"])
    check_optimizer_options(request)


# The fp32 weights are read into host memory on both devices: the CUDA step copies what
# its rank holds (with ZeRO-3 a shard) into its own regions, so an 8B model's 32 GB of fp32
# never sits on the GPU beside the step's state.
HOST = "cpu"


def _resumed(path):
    if path is None:
        return None
    folder = find_checkpoint(path)
    return folder, read_trainer(folder)  # the optimizer state is read by Run.resume


def _model(request: Request, weights: Path, tp_rank: int = 0) -> Model:
    if request.file.suffix == ".ir":
        return _model_from_ir(request, weights, tp_rank)
    model = Model.from_module(request.file, settings=request.settings, hf_weights=weights,
                              config=request.config, dtype=torch.float32, device=HOST,
                              model=request.model, search_path=request.search_path,
                              progress=request.fmt == "human" and sys.stderr.isatty(),
                              memory_budget=request.memory_budget
                              if request.device == "cpu" else None, lora=request.lora,
                              tensor_parallel=request.tp, tp_rank=tp_rank,
                              sequence_parallel=request.sp,
                              tp_overlap=not request.no_tp_overlap,
                              max_memory=request.max_memory, precision=request.precision,
                              precision_overrides=request.precision_overrides)
    names = model.source.program(planned=False).input_names()
    if unfed(names):
        raise RuntimeUserError(f"`modulec train` feeds token_ids (and position_ids 0 .. T-1) "
                               f"only; {request.file}'s model takes {', '.join(names)}")
    # build the program at the run's sizes now: an unmeetable --memory-budget fails here
    # (on the GPU, the trainer plans its own: runtime.train.backends.gpu_program)
    model.source.program_for(sized_inputs(names, request.batch, request.seq))
    return _initialized(request, model)


def _initialized(request: Request, model: Model) -> Model:
    """--init random: the standard init (runtime/train/init.py), seeded by --seed."""
    if request.init == "random":
        from runtime.train.init import init_std, initialize

        config = _config(request.config.parent, request.config.name) \
            if request.config else None
        initialize(model, request.seed, init_std(config))
    return model


def _model_from_ir(request: Request, weights: Path, tp_rank: int = 0) -> Model:
    """An IR document (`modulec build -o`) runs as written: its sizes, its plan's
    decisions and its distributed section; settings that would change it are refused."""
    given = [flag for flag, value in (("--set", request.settings),
                                      ("--memory-budget", request.memory_budget),
                                      ("--lora", request.lora),
                                      ("--precision", request.precision),
                                      ("--model", request.model)) if value]
    given += [FP8_FLAGS[k] for k in request.precision_overrides or {}]
    if given:
        raise RuntimeUserError(f"{', '.join(given)} would change {request.file}, which was "
                               "built with its settings fixed",
                               help=["pass them to `modulec build` and train the new IR, "
                                     "or train the .module"])
    model = Model.from_ir(request.file, hf_weights=weights, dtype=torch.float32,
                          device=HOST, max_memory=request.max_memory, tp_rank=tp_rank)
    names = model.source.program().input_names()
    if unfed(names):
        raise RuntimeUserError(f"`modulec train` feeds token_ids (and position_ids 0 .. T-1) "
                               f"only; {request.file}'s model takes {', '.join(names)}")
    model.source.program_for(sized_inputs(names, request.batch, request.seq))
    return _initialized(request, model)


def _sizes(model: Model, request: Request) -> tuple[int | None, int | None]:
    """(vocab_size, max_seq) of the model, where it has them; T checked against max_seq."""
    params = model.source.program(planned=False).metadata.get("parameters", {})
    vocab, max_seq = (int(params[k]) if str(params.get(k, "")).isdigit() else None
                      for k in ("vocab_size", "max_seq"))
    if max_seq is not None and request.seq > max_seq:
        raise RuntimeUserError(f"--seq {request.seq} is longer than the model's max_seq "
                               f"({max_seq})", help=[f"use --seq {max_seq} or less"])
    return vocab, max_seq


class Run:
    def __init__(self, request: Request, model: Model, data: TokenData, weights: Path,
                 context=None, parallel=None):
        from runtime.dist import DistContext

        self.request, self.model, self.data = request, model, data
        self.context = context or DistContext()
        self.parallel = parallel  # runtime.dist.DataParallelRun, None on one process
        self.dp, self.dp_rank = (parallel.dp, parallel.dp_rank) if parallel else \
            pipeline_replica(request, self.context)  # --pp: one pipeline a replica
        self.schema = model.source.program(planned=False).weight_schema
        self.layout = dict(model.hf_layout)
        if request.tp > 1:  # checkpoints hold the whole tensors (whole_state)
            from runtime.tensor_parallel import whole_layout

            self.layout = whole_layout(self.layout, self.schema)
        self.config = _config(Path(weights)) if weights is not None else \
            _scratch_config(request, model)
        if weights is None and request.save is not None:  # a model never loaded
            from runtime.train.init import scratch_layout

            self.layout = scratch_layout(self.schema, self.config) | self.layout
        self.save_dtype = _save_dtype(request.save_dtype, self.config)
        from runtime.train.packing import packing_for

        self.packing = packing_for(request, data.vocab_size,  # --doc-sep (None: unpacked)
                                   model.source.program(planned=False))
        from runtime.train.optim_options import adamw_of, schedule_for

        self.schedule = schedule_for(request)  # the lr of each step (set before it runs)
        self.trainer = self._trainer(adamw_of(request))
        self.start, self.losses, self.saved = 0, [], None
        self.resumed_from = ""  # which files a resume read (said at the start)
        from runtime.train.log_window import LogWindow

        self.window = LogWindow(request.log_every, request.steps, request.save_every)

    def _trainer(self, adamw: AdamW):
        r, model, parallel = self.request, self.model, self.parallel
        if model.fp8_state() is not None and (r.pp > 1 or parallel is not None):
            raise RuntimeUserError("an FP8 recipe trains on one process for now: the "
                                   "ranks' amax histories are not reduced across processes",
                                   help=["train it without torchrun, or without the recipe"])
        if r.pp > 1:
            from runtime.train.pipeline import PipelineTrainer

            return PipelineTrainer(model, r.batch, r.seq, adamw, self.context, r.pp,
                                   r.grad_accum, r.device, r.zero, self.packing)
        if r.device == "cuda":
            from runtime.fp8 import refuse_on_gpu

            refuse_on_gpu(model.source.program(planned=False).metadata)
            return CUDATrainer(model, r.batch, r.seq, adamw, r.memory_budget, r.grad_accum,
                               dist=parallel, packing=self.packing)
        if parallel is not None and parallel.dp > 1:
            from runtime.train.data_parallel import CPUDataParallelTrainer

            return CPUDataParallelTrainer(model, r.batch, r.seq, adamw, parallel,
                                          r.grad_accum, self.packing)
        if parallel is not None:  # tensor parallel alone: the TP pair's group
            from runtime.dist.zero import refuse_parameter_settings

            refuse_parameter_settings(model.source.program(planned=False))
            parallel.use_tensor_parallel_group()
        return CPUTrainer(model, r.batch, r.seq, adamw, r.grad_accum, self.packing)

    def _tokens_per_step(self) -> int:
        r = self.request
        return r.batch * r.grad_accum * r.seq * self.dp

    def _own_rows(self, window):
        """This rank's rows of the step's window (every rank reads the same window; the
        ranks of one tensor-parallel slice read the same rows)."""
        rows = window.shape[0] // self.dp
        return window[self.dp_rank * rows:(self.dp_rank + 1) * rows]

    def _shared(self, window) -> dict:
        """Packed data parallel: the denominators of the step's micro-batches, from the
        whole window every rank reads (runtime.train.packing.denominators)."""
        if self.packing is None or self.dp == 1:
            return {}
        from runtime.train.packing import denominators

        return {"denominators": denominators(window, self.packing, self.request.batch,
                                             self.dp)}

    def _settings(self) -> dict:
        """What a resume must match. `batch` is the rows of a micro-batch over every rank
        (a checkpoint resumes on another number of processes with the same total)."""
        settings = {key: getattr(self.request, key) for key in RESUME_KEYS}
        settings["batch"] *= self.dp
        return settings

    def resume(self, folder: Path, trainer: dict) -> None:
        settings = self._settings()
        for key in RESUME_KEYS:
            if trainer.get(key, RESUME_DEFAULTS.get(key)) != settings[key]:
                flag = "--" + key.replace("_", "-")
                world = f" x {self.dp} data-parallel ranks" if key == "batch" and \
                    self.dp > 1 else ""
                now, then = (("not given" if v is None else v) for v in
                             (getattr(self.request, key), trainer.get(key)))
                raise RuntimeUserError(f"{flag} is {now}{world}, but {folder} was trained "
                                       f"with {then}",
                                       help=["resume with the settings of the run that "
                                             "saved the checkpoint"])
        from runtime.train.optim_options import check_resume_schedule

        check_resume_schedule(trainer, self.schedule, folder)
        self.start, self.losses = int(trainer["step"]), list(trainer.get("losses", []))
        if self.start >= self.request.steps:
            raise RuntimeUserError(f"{folder} is at step {self.start}: --steps "
                                   f"{self.request.steps} leaves nothing to run",
                                   help=["--steps is the total step count; give more"])
        from runtime.lora import check_resume

        check_resume(folder, self.model if self._lora() else None)
        if self._resume_from_shards(folder):
            return
        state = read_optimizer(folder)
        if self.request.tp > 1:  # this rank's slices of the whole tensors
            from runtime.train.data_parallel import rank_state

            state = rank_state(state, self.model, self.context.rank % self.request.tp)
        self.trainer.load_state(state)

    def _resume_from_shards(self, folder: Path) -> bool:
        """Every rank's own shard when each fits this run's layout (no gathering, the
        state exactly as it was held); else False, and the consolidated files are read."""
        from runtime.train import shards

        shape = self._shard_shape()
        if shape is None:
            why = "ZeRO-0 ranks hold the whole state" if self.context.distributed else \
                "this run is one process"
            index = None
        else:
            index, why = shards.own_shard(folder, shape)
        if not shards.agreed(self.context, index is not None):
            self.resumed_from = f"from the consolidated checkpoint ({why or 'a shard of another rank does not fit'})"
            return False
        shards.load_rank_tensors(self.trainer, shards.read_shard(folder, index),
                                 int(index["step"]))
        shards.load_frozen(self.trainer, folder)
        self.resumed_from = f"from the per-rank shards ({describe_shape(shape)})"
        return True

    def _shard_shape(self) -> dict | None:
        from runtime.train import shards

        if self.request.pp > 1:  # every rank holds a stage (runtime/train/pipeline_shards.py)
            from runtime.train.pipeline_shards import layout

            return layout(self.trainer, self.context)
        if not shards.wants_shards(self.parallel):
            return None
        return shards.layout(self.trainer, self.parallel, self.context)

    def train(self) -> str:
        """The steps; under data parallel a collective that fails (a rank died) or does
        not finish within --dist-timeout (a rank hangs) ends this rank with an error that
        names it, and torchrun ends the others."""
        from runtime.dist.context import collective_failures

        with collective_failures(self.context, self.request.dist_timeout):
            return self._train()

    def _train(self) -> str:
        r = self.request
        times = []
        fmt = r.fmt if self.context.is_main else "none"  # rank 0 reports
        with Progress(fmt, self.start, r.steps) as progress, self._observer() as observer:
            self._notes(progress)
            for note in observer.notes():
                progress.note(note)
            self.observer = observer
            for step in range(self.start, r.steps):
                whole = self.data.batch_at(step)
                self.trainer.set_lr(self.schedule.lr_at(step + 1))
                began = now()
                loss = self.trainer.train_step(self._own_rows(whole), **self._shared(whole))
                times.append(now() - began)
                self._record(progress, step + 1, loss, times[-1], observer)
                if step == self.start:
                    self._attention_note(progress)
                if r.save_every and (step + 1) % r.save_every == 0 and step + 1 < r.steps:
                    self._save(step + 1, progress)
            if r.save is not None:
                self._save(r.steps, progress)
        return self._summary(times)

    def _notes(self, progress: Progress) -> None:
        r = self.request
        if self.start:
            progress.note(f"resumed at step {self.start} {self.resumed_from}".rstrip())
        if self.packing is not None:
            progress.note(f"packed: id {self.packing.sep} ends each document; attention "
                          "and positions stay within a document, the target after it is "
                          "left out of the loss")
        graph_note = getattr(self.trainer, "graph_note", None)
        if graph_note is not None and r.device == "cuda":
            progress.note(graph_note())
        if r.memory_budget is not None and r.device == "cuda":
            counts = _decision_counts(self.trainer.step.decisions)
            progress.note(f"--memory-budget {gib(r.memory_budget)}: the plan recomputes "
                          f"{counts['recompute']} and keeps {counts['keep']} activation "
                          "decisions (no swaps on the GPU)")

    def _attention_note(self, progress: Progress) -> None:
        """After the first step on the GPU: the attention kernels it ran, the GEMM
        algorithms it chose, where ZeRO's weight all-gathers ran."""
        note = getattr(self.trainer, "attention_note", None)
        line = note() if note is not None and self.request.device == "cuda" else None
        if line:
            progress.note(line)
        if self.request.device == "cuda":
            from runtime.cuda.gemm import summary

            if summary():  # the GEMM algorithms the first step timed (runtime/cuda/gemm.py)
                progress.note(summary())
            from runtime.cuda.gated_gemm import summary as gated

            if gated():  # SwiGLU in the GEMMs' epilogues, or why not (gated_gemm.py)
                progress.note(gated())
            zero = getattr(getattr(self.trainer, "step", None), "zero", None)
            if zero is not None and zero.zero in (1, 2):  # runtime/dist/ce_gather.py
                progress.note(f"ZeRO's weight all-gathers run on {zero.gather_transport}")

    def _observer(self):
        """Evaluation and the metrics log (runtime/train/observe.py)."""
        from runtime.train.observe import Observer

        return Observer(self.request, self.trainer, self.data.dtype, self.data.vocab_size,
                        self.start, self._lr_at, self.context.is_main, self.parallel)

    def _lr_at(self, step: int) -> float:
        """The learning rate optimizer step `step` took (a schedule's, where the run has
        one)."""
        schedule = getattr(self, "schedule", None)
        return schedule.lr_at(step) if schedule is not None else self.request.lr

    def _record(self, progress: Progress, step: int, loss: float, seconds: float,
                observer=None) -> None:
        """The step's loss checked and kept; at the end of a --log-every window its
        record (the window's means: runtime/train/log_window.py) reported and logged."""
        if not math.isfinite(loss):  # at the step, not at its window's end
            raise RuntimeUserError(f"the loss is {loss} at step {step}: training diverged",
                                   help=["lower --lr; nothing was saved for this step"])
        self.losses.append(loss)
        window = self.window.add(step, loss, seconds, self._tokens_per_step(),
                                 self.trainer.step_metrics())
        if window is None:
            return
        memory = self.trainer.memory()
        record = {"step": step, "steps": self.request.steps, "loss": window["loss"],
                  "lr": self._lr_at(step), **window, "peak_bytes": memory["peak_bytes"]}
        progress.step(observer.after_step(record) if observer is not None else record)

    def _save(self, step: int, progress: Progress) -> None:
        r = self.request
        trainer = {"step": step,
                   "samples": step * r.batch * r.grad_accum * self.dp,
                   "losses": self.losses,
                   "model": str(r.file), "settings": r.settings,
                   "data": {"path": str(r.data), "dtype": self.data.dtype,
                            "tokens": len(self.data.tokens)}}
        from runtime.train.optim_options import saved_optimizer

        trainer |= saved_optimizer(r, self.schedule) | self._settings()
        shards = self._shard_save(trainer)
        # the moments too unless the ranks' shards hold them (shards.replaces_optimizer)
        optimizer = shards is None or not shards.replaces_optimizer
        source = self._checkpoint_source(optimizer)
        if not self.context.is_main:  # the gathers rank 0 writes from: a collective
            if shards is not None:  # into rank 0's folder, before it is published
                shards.follower(source.drain)
            else:
                source.drain()
            return
        try:
            self.saved = save_checkpoint(r.save, source, trainer,
                                         schema=self.schema, layout=self.layout,
                                         config=self.config, dtype=self.save_dtype,
                                         adapters=self.model if self._lora() else None,
                                         shards=shards, optimizer=optimizer,
                                         max_shard_size=_shard_size(r.max_shard_size))
        except OSError as exc:
            raise RuntimeUserError(f"cannot write the checkpoint of step {step} under "
                                   f"{r.save}: {exc}",
                                   help=["no partial checkpoint was left behind"]) from None
        progress.note(f"saved {self.saved}")

    def _checkpoint_source(self, moments: bool):
        """What rank 0 writes the consolidated files from, one parameter or bucket at a
        time (runtime/train/consolidated.py); under --tp without --pp the slices joined
        over the TP group (a pipeline joins its stages' itself)."""
        source = self.trainer.checkpoint_source(moments)
        if self.request.tp > 1 and self.request.pp == 1:
            from runtime.train.consolidated import tensor_parallel

            source = tensor_parallel(source, self.model, self.parallel, self.context.rank)
        return source

    def _lora(self) -> bool:
        """Whether the program trains LoRA adapters: --lora, or an IR document built with
        it (its `metadata.lora`): the checkpoint then holds PEFT's adapter files too."""
        return self.request.lora is not None or self.request.built_lora

    def _shard_save(self, trainer: dict):
        """The per-rank shards' part of a save (runtime.train.shards), None without."""
        from runtime.train.shards import ShardSave

        shape = self._shard_shape()
        if shape is None:
            return None
        return ShardSave(self.trainer, shape, {"step": trainer["step"],
                                               "samples": trainer["samples"]})

    def _summary(self, times: list[float]) -> str:
        r = self.request
        steady = times[2:] or times
        tokens_per_s = self._tokens_per_step() / statistics.median(steady)
        memory = self.trainer.memory()
        ran = self.losses[self.start:]
        data = {"event": "done", "first_step": self.start + 1, "last_step": r.steps,
                "loss_first": ran[0], "loss_last": ran[-1], "tokens_per_s": tokens_per_s,
                "peak_bytes": memory["peak_bytes"], "memory": memory["what"],
                "saved": str(self.saved) if self.saved else None}
        evaluated = getattr(getattr(self, "observer", None), "last_eval", None)
        if evaluated is not None:
            data["eval_step"], data["eval_loss"] = evaluated
        if r.fmt == "json":
            return json.dumps(data)
        text = (f"trained steps {data['first_step']}..{r.steps}: loss {ran[0]:.4f} -> "
                f"{ran[-1]:.4f}, {tokens_per_s:,.0f} tokens/s (median), peak "
                f"{gib(memory['peak_bytes'])} ({memory['what']})")
        if r.device == "cuda" and r.memory_budget is not None and \
                memory["peak_bytes"] > r.memory_budget:
            text += f"; over the --memory-budget {gib(r.memory_budget)}"
        if evaluated is not None:
            text += f"; eval loss {evaluated[1]:.4f} (step {evaluated[0]})"
        return text + (f"; saved {self.saved}" if self.saved else "")


def describe_shape(shape: dict) -> str:
    from runtime.train.shards import describe

    return describe(shape)


def _decision_counts(decisions) -> dict:
    counts = {"keep": 0, "recompute": 0, "swap": 0}
    for rows in getattr(decisions, "table", {}).values():
        for kind, *_ in rows:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _scratch_config(request: Request, model: Model) -> dict:
    """The config.json of a from-scratch run's checkpoints: --config's, else one made
    from the model's hf_config and parameters (runtime/train/init.py)."""
    from runtime.train.init import init_std, scratch_config

    if request.config is not None:
        return _config(request.config.parent, request.config.name)
    program = model.source.program(planned=False)
    return scratch_config(program, init_std(None))


def _config(weights: Path, name: str = "config.json") -> dict | None:
    path = weights / name
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeUserError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):  # a list crashed the dtype lookup (exit 101)
        raise RuntimeUserError(f"{path} is a JSON {type(config).__name__}, not an object",
                               help=["config.json holds one object of fields"])
    return config


def _shard_size(given: int | None) -> int:
    from runtime.hf_weights.stream import MAX_SHARD_SIZE

    return MAX_SHARD_SIZE if given is None else given


def _save_dtype(choice: str, config: dict | None) -> torch.dtype:
    """`auto`: the dtype the source checkpoint's config declares, else float32."""
    if choice == "auto":
        declared = (config or {}).get("torch_dtype") or (config or {}).get("dtype")
        choice = declared if declared in SAVE_DTYPES else "float32"
    if config is not None:
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = choice
    return SAVE_DTYPES[choice]
