"""benchmarks/train_step_dist.py's modulec variants: the layout each name asks for, checked
before any process starts, and one variant's run in its processes: the GPU step
(runtime.cuda.step.TrainStep) or, with --device cpu, the CPU trainer on gloo processes
(runtime/train: the same DistContext.data_parallel layout, ZeRO and TP groups; a check
of the code paths and of the token accounting, not a measurement).

    modulec_1gpu[_fp8]            one GPU (the scaling column's denominator)
    modulec_zero{S}[_fp8]         data parallel over every GPU, ZeRO stage S (0-3)
    modulec_zero{S}_tp{M}[_sp][_nooverlap][_fp8]  tensor parallel over M consecutive GPUs
                                  (M >= 2: one TP group), data parallel with ZeRO stage S
                                  across the GPUS / M groups: ctx.data_parallel(zero=S,
                                  tp=M); `_sp`: with sequence parallel (sp=True: the norms
                                  on T / M rows a GPU); `_nooverlap`: built with
                                  `--no-tp-overlap` (the backward all-reduces / reduce-
                                  scatters in order, not beside the weight gradients'
                                  GEMMs: the A/B of modulec.lower.tp_overlap)
    ..._fa4 / ..._cudnn (before _fp8): attention by FlashAttention-4's kernels / by
                                  cuDNN's, both ways; without either suffix the GPU
                                  step's default (FA4's backward at head dim 64 where
                                  flash-attn-4 is installed: runtime/cuda/attention.py)

The M ranks of a TP group read one batch (B x T), so a step trains B x T x GPUS / M
tokens. What the GPU step runs under TP (runtime/cuda/step.py, runtime/dist): ZeRO 0-3
across the TP groups (the IR's `distributed` section over each TP position's DP group),
with `memory_budget` (the build plans one rank's program, its ZeRO share counted as
fixed) and with the FP8 recipe (each rank its own amaxes); DP x TP on the GPU is checked
against one GPU by tests/test_cuda_dist.py::test_dp_x_tp_trains_as_one_gpu (four GPUs).
TP over all the GPUs leaves one data-parallel rank: the build then writes no
`distributed` section and a ZeRO stage would be ignored, so only `modulec_zero0_tp{GPUS}`
names that layout. Under TP the global gradient norm covers the data-parallel group's
shards only (`modulec train` refuses --clip-grad with --tp); these steps do not clip.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from benchmarks.dist_measure import Ranks, batch_for, measure, reset_peak
from benchmarks.train_step import attention_order, modulec_options

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "std/models/llama.module"
MODULEC_BASE = "modulec_norecompute"  # train_step.py's variant the modulec rows mirror
NAME = re.compile(r"modulec_(?:(1gpu)|zero(\d+)(?:_tp(\d+)(_sp)?(_nooverlap)?)?)(_fa4|_cudnn)?(_fp8)?")
GRAMMAR = ("modulec_1gpu, modulec_zero{0..3}, modulec_zero{0..3}_tp{M}[_sp][_nooverlap], "
           "each [_fa4|_cudnn][_fp8]")
# the model sizes tensor parallel splits (docs/distributed.md, "Tensor parallel")
TP_DIVIDES = ("num_heads", "num_kv_heads", "d_ff")


@dataclass(frozen=True)
class Layout:
    """What a modulec variant runs: `gpus` processes as TP groups of `tp`, data parallel
    with ZeRO stage `zero` across them (None: one GPU, no process group); `sp`: sequence
    parallel inside each TP group; `overlap`: the TP backward collectives beside the
    weight gradients (False: `_nooverlap`, the program built with --no-tp-overlap)."""

    gpus: int
    tp: int = 1
    zero: int | None = None
    fp8: bool = False
    sp: bool = False
    overlap: bool = True
    # "fa4": FlashAttention-4's kernels both ways, "cudnn": cuDNN's both ways, "": the
    # GPU step's default (benchmarks/train_step.py attention_order)
    attention: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // self.tp


def parse_variant(name: str, gpus: int, shape: dict | None = None) -> Layout:
    """The layout of modulec variant `name` on `gpus` processes (`shape`: the model, whose
    heads, KV heads and d_ff TP must divide); ValueError saying why a name, a size or a
    combination does not run."""
    match = NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown variant {name!r} ({GRAMMAR}; hf_{{ddp|fsdp2}}[_compile|"
                         "_compilewhole|_compilelayers][_ckpt][_fp8])")
    one, zero, tp, sp, nooverlap, attention, fp8 = match.groups()
    attention = (attention or "_")[1:]
    if one:
        return Layout(1, fp8=bool(fp8), attention=attention)
    zero, tp = int(zero), int(tp or 1)
    if zero > 3:
        raise ValueError(f"{name}: the ZeRO stage is 0, 1, 2 or 3, not {zero}")
    if tp == 1 and match.group(3):
        raise ValueError(f"{name}: TP 1 is plain data parallel: name it "
                         f"modulec_zero{zero}{fp8 or ''}")
    if gpus < 2:
        raise ValueError(f"{name} runs on several GPUs: --gpus {gpus}")
    if gpus % tp:
        raise ValueError(f"{name}: TP {tp} does not divide the {gpus} GPUs (--gpus)")
    if tp == gpus and zero:
        raise ValueError(f"{name}: TP {tp} over all {gpus} GPUs leaves one data-parallel "
                         f"rank, where no ZeRO stage applies (the step builds no "
                         f"`distributed` section): name it modulec_zero0_tp{tp}{fp8 or ''}")
    for key in TP_DIVIDES if shape and tp > 1 else ():
        if shape[key] % tp:
            raise ValueError(f"{name}: TP {tp} does not divide the shape's {key} = "
                             f"{shape[key]}")
    return Layout(gpus, tp, zero, bool(fp8), bool(sp), not nooverlap, attention)


# ------------------------------------------------------------------ the GPU step (child)
def modulec_step(args, shape, layout: Layout):
    """(TrainStep as train_step.py builds `modulec_norecompute`, the DataParallelRun or
    None on one GPU)."""
    from runtime.cuda.step import TrainStep
    from runtime.dist import DistContext

    options = modulec_options(MODULEC_BASE)
    if layout.fp8:
        options["precision"] = "fp8"
    if layout.attention:
        options["attention"] = attention_order({layout.attention})
    if args.budget:
        options["memory_budget"] = int(args.budget * 2 ** 30)
    run = None
    if layout.zero is not None:
        run = DistContext.from_env(device="cuda").data_parallel(
            zero=layout.zero, tp=layout.tp, sp=layout.sp, tp_overlap=layout.overlap)
        options["dist"] = run
    return TrainStep.from_module(LLAMA, shape, batch=args.batch, seq=args.seq,
                                 **options), run


def run_modulec(args, shape, ranks: Ranks, layout: Layout) -> dict:
    """One GPU: train_step.py's weights (the HF checkpoint, where one was written); else
    init_random(0): every rank of a TP position draws the same values (its slices have
    the same shapes), so the replicated parameters (embeddings, norms, head) agree."""
    if args.device == "cpu":
        return run_modulec_cpu(args, shape, ranks, layout)
    import torch

    step, run = modulec_step(args, shape, layout)
    if run is None and args.ckpt:
        from runtime.hf_weights import load_hf_weights

        weights = load_hf_weights(step.program.weight_schema, args.ckpt, dtype=torch.float32,
                                  device="cuda")
        step.load(weights)
        del weights
    else:
        step.init_random(0)
    tokens = batch_for(args, shape["vocab_size"], ranks, run.dp_rank if run else None)
    step.set_batch(tokens)
    reset_peak(ranks)
    step.capture(warmup=2)
    result = measure(lambda: step(tokens), lambda: float(step.loss), ranks, args)
    zero = getattr(step, "zero", None)
    if zero is not None and hasattr(zero, "fixed_bytes"):
        result["fixed_bytes"] = ranks.reduce([float(zero.fixed_bytes())], "max")[0]
    return dict(result, tp=layout.tp, dp=layout.dp)


# ------------------------------------------------------------------ the CPU trainer (child)
def run_modulec_cpu(args, shape, ranks: Ranks, layout: Layout) -> dict:
    """The layout on gloo processes with the CPU trainer, as `modulec train --tp M --zero
    S` builds it (runtime/train/run.py): fp32, each TP group's ranks on one batch."""
    import torch

    from runtime.dist import DistContext
    from runtime.model import Model
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    context = DistContext.from_env(device="cpu")
    run = None if layout.zero is None else context.data_parallel(
        zero=layout.zero, tp=layout.tp, sp=layout.sp, tp_overlap=layout.overlap)
    model = Model.from_module(LLAMA, settings=shape, dtype=torch.float32,
                              tensor_parallel=layout.tp, tp_rank=context.rank % layout.tp,
                              sequence_parallel=layout.sp, tp_overlap=layout.overlap,
                              precision="fp8" if layout.fp8 else None)
    model.init_random(0)
    if run is not None and run.dp > 1:
        from runtime.train.data_parallel import CPUDataParallelTrainer

        trainer = CPUDataParallelTrainer(model, args.batch, args.seq, AdamW(), run)
    else:
        if run is not None:  # tensor parallel alone: the TP pair's all-reduces
            run.use_tensor_parallel_group()
        trainer = CPUTrainer(model, args.batch, args.seq, AdamW())
    generator = torch.Generator().manual_seed(1 + (run.dp_rank if run else 0))
    window = torch.randint(0, shape["vocab_size"], (args.batch, args.seq + 1),
                           generator=generator)
    box = {}

    def step():
        box["loss"] = trainer.train_step(window)

    return dict(measure(step, lambda: box["loss"], ranks, args), tp=layout.tp, dp=layout.dp)
