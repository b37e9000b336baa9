"""`TrainStep`: one training step of a `.module` language model on the GPU (forward,
backward, AdamW), captured in one CUDA graph and replayed.

    step = TrainStep.from_module("std/models/llama.module", settings, batch=4, seq=2048)
    step.load(params_fp32_by_path)          # or step.init_random(seed)
    loss = step(token_ids, labels)          # a [] fp32 CUDA tensor; no host sync

- Optimizer settings (`AdamWConfig`): the learning rate is a device scalar (`lr_now`)
  the updates read, so `set_lr` changes it between graph replays (a schedule); each
  parameter's weight decay and lr factor come from runtime.train.param_groups (norms,
  biases and embeddings undecayed unless `decay_all`); `grad_norm` is the step's global
  gradient norm, and with `clip_grad` every gradient is scaled by min(1, clip /
  (norm + 1e-6)) inside the update (on one process the gradients are then held to the
  end of the backward, not updated inside it; under ZeRO the shards are, runtime/dist).
- Weights: fp32 master copies with fp32 AdamW moments, and bf16 compute copies the
  interpreter reads. `optimizer="fused"` (default): one kernel per tensor
  (csrc/kernels/adamw.cu) reads the backward's bf16 gradient and updates master, moments
  and compute copy, so no fp32 gradient buffer exists; the master is held split, its
  top half the compute copy and its low half an int16 (runtime/cuda/state.py), so master
  and compute copy take 4 bytes a parameter, not 6 (`masters` joins them on lookup);
  `optimizer="torch"`: `torch.optim.AdamW(fused=True, capturable=True)` on fp32 `.grad`
  buffers the bf16 gradients are copied into, then the masters copied to the compute
  copies (4 more bytes per parameter). A 1-d parameter stored in fp32 (`@dtype(fp32)`)
  has an fp32 compute copy that is its master (runtime/cuda/param_dtypes.py).
- `update_in_backward` (fused optimizer only, default on): the parameters of a repeated
  layer are updated as soon as that layer's backward has produced their gradients, which
  are then dropped, so at most one layer's gradients exist at a time (the entry's own
  parameters, embedding / final norm / LM head, are updated after the backward).
- Forward and backward: the reference interpreter over the program's Graph IR with
  `TRAIN_KERNELS` (runtime/cuda/train_kernels.py) and `keep_only_saved` (only what a
  backward reads outlives its function); no finiteness checks (they sync).
- Loss: mean next-token cross-entropy; when the graph ends in the LM-head matmul, that
  node is cut off and LM head + cross-entropy run fused in chunks (runtime/cuda/lm_head.py).
- LoRA (`from_module(..., lora=dict(rank=16, alpha=32, targets=[...]))`, or a program
  built with LoRA): the base weights are frozen (`frozen`): each has only its bf16 compute
  copy (no fp32 master, no moments, no gradient, no optimizer work); the adapters
  (`W.lora_A`, `W.lora_B`) are trained as above. The backward computes no frozen
  weight's gradient (the derived backward leaves their d_B unwanted, `train_kernels.Matmul`
  skips it; the fused LM head skips d_head). LoRA's `dropout=p` draws its masks from the
  device counter `rng_step` (runtime/cuda/dropout.py): a new mask each step (each replay),
  micro-batch and data-parallel rank.
- Activations (`arena`, default on for bf16): the transient and saved regions are one
  allocation each, sized by the memory plan (runtime/arena.py); every planned value is a
  view at its offset (kernels with `out` write there, other results are copied in).
- CUDA graph: after `warmup` eager steps on a side stream, one step is captured; each call
  copies the batch into the static input buffers and replays it.
- Memory budget (`from_module(..., memory_budget=bytes)`): the program is built with the
  budget planner (`PlanOptions(budget=..., device="h200-noswap")`; the budget handed to the
  planner is this step's budget plus what the planner counts as fixed beyond this step's
  fixed state, see `planner_budget`), and its keep / recompute decisions
  (runtime.decisions) run here with early release: when a forward function run returns,
  each value decided `recompute` in that run is dropped at once (not at the end of the
  forward as the reference runtime does); the backward that first reads it replays it
  (the op, or `apply_saved` for a norm's output). Swap decisions are kept on the GPU
  (counted in `swaps_kept`): the `-noswap` device profile makes the planner choose none.
- FP8 (a program with `metadata.precision`): the recipe's matmuls run as FP8 GEMMs with
  device amax histories (`fp8`, runtime/cuda/fp8_step.py), pushed at each step's end.
- Tensor parallel (`dist`): the backward collectives the IR marks `stream=comm` (the
  tp_overlap pass) run on a communication stream of the step's own (not ZeRO's) beside
  the weight gradients' GEMMs, joined at their `wait` nodes (runtime/cuda/async_comm.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from runtime.cuda import slot_refresh
from runtime.cuda.async_comm import InFlight, step_streams
from runtime.cuda.attention import DEFAULT_ORDER
from runtime.cuda.graph_nodes import finish as finish_graph, new_graph
from runtime.cuda.lm_head import lm_head_cross_entropy, split_head
from runtime.cuda.packed import packed_buffers, set_documents
from runtime.cuda.param_dtypes import own_dtypes, whole_update
from runtime.cuda.state import random_params  # noqa: F401 (TrainStep.init_random; callers)
from runtime.cuda.step_memory import (budget_programs, frozen_paths,  # noqa: F401 (callers)
                                      planner_budget, runtime_fixed_bytes)
from runtime.cuda.step_optim import AdamWBatch, NormSquares
from runtime.cuda.train_kernels import allocating_ops, train_kernels
from runtime.cuda.step_interpreter import _StepInterpreter
from runtime.cuda.swaps import GpuSwaps
from runtime.decisions import Decisions
from runtime.tensor_parallel import logits_loss, vocab_outputs
from runtime.errors import RuntimeUserError
from runtime.hf_weights.schema import tied_targets
from runtime.train.aux_loss import auxiliary_seeds
from runtime.inputs import fed_inputs, positions_like, sized_inputs, unfed
from runtime.interpreter import Interpreter
from runtime.kernels.documents import packed
from runtime.model import parameter_shapes
from runtime.program import ModuleSource, Program


@dataclass
class AdamWConfig:
    lr: float = 1e-4  # the current rate; `TrainStep.set_lr` changes it between replays
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_all: bool = False  # False: norms, biases, embeddings get none (param_groups)
    clip_grad: float | None = None  # global gradient-norm clipping (None: off)


@dataclass
class TrainStep:
    program: Program
    batch: int
    seq: int
    dtype: torch.dtype = torch.bfloat16
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    fused_head: bool = True
    chunk_rows: int = 2048
    keep_only_saved: bool = True
    optimizer: str = "auto"  # "fused" (bf16 compute), "torch"; auto: fused for bf16
    update_in_backward: bool = True  # with the fused optimizer
    # keep / recompute decisions to run: "auto" (the program's schedule, if it has any:
    # a build with a memory budget), None (keep everything), or a runtime Decisions
    decisions: object = "auto"
    # runtime.hooks.Hooks: observe / modify / replace hooks, probes and trace lines on the
    # GPU; they are Python per op, so a step with any of them runs eagerly (never captured)
    hooks: object = None
    # micro-batches of `batch` samples per optimizer step (gradient accumulation): the
    # static inputs hold accumulation x batch rows; gradients are summed in fp32
    accumulation: int = 1
    # execute the planner's swap decisions (runtime/cuda/swaps.py); False keeps them on the GPU
    execute_swaps: bool = True
    # attention backends tried in order (runtime/cuda/attention.py BACKENDS): FA4's
    # backward at head dim 64 where flash-attn-4 is installed, cuDNN's fused attention
    # (1.5x FlashAttention-2's speed on an H200: benchmarks/kernels/bench_attention.py),
    # FlashAttention-2 for what cuDNN does not cover (windows)
    attention: tuple = DEFAULT_ORDER
    # activations at the plan's offsets (runtime/arena.py): the transient and saved regions
    # one allocation each, the saved records holding what each run keeps (a budget's
    # recompute / swap decisions take no bytes there); kernels with `out` write into their
    # planned bytes, the others' results are copied in. False (and any compute dtype but
    # bf16, the plan's): torch's caching allocator
    arena: bool = True
    # runtime.dist.DataParallelRun: tensor parallel (the program built with --tp, its
    # collectives the TP pair's kernels) and data parallel with ZeRO sharding across the TP
    # slices, executed from the program's `distributed` section (runtime/dist/zero.py)
    dist: object = None
    # packed sequences (runtime/cuda/packed.py): each batch comes with its documents
    # (set_batch); labels equal to `ignore_index` leave the loss
    packed: bool = False
    ignore_index: int = -100

    @classmethod
    def from_module(cls, path, settings: dict | None = None, *, batch: int, seq: int,
                    derive_written: bool = False, memory_budget: int | None = None,
                    plan_device: str = "h200-noswap", lora=None, precision=None,
                    precision_overrides=None, **options) -> "TrainStep":
        """`lora`: LoRA on (a dict `rank=16, alpha=32, targets=[...]` or
        modulec.lower.lora.LoraOptions; base weights frozen). `derive_written`: ignore the
        source's written backward sections (derive every backward instead).
        `memory_budget` (bytes of GPU memory for the whole step): build with the budget
        planner on `plan_device`'s cost model and run its recompute decisions."""
        from modulec.lower.build_plan import PlanOptions

        settings = {k: str(v) for k, v in (settings or {}).items()}
        if lora is not None:
            from modulec.lower.lora import LoraOptions

            lora = LoraOptions.of(lora)
        dist = options.get("dist")
        parallel = dict(distributed=dist.options() if dist is not None else None,
                        tensor_parallel=dist.tp if dist is not None else 1,
                        sequence_parallel=getattr(dist, "sp", False),
                        tp_overlap=getattr(dist, "tp_overlap", True),  # --no-tp-overlap
                        precision=precision,  # "fp8": the std FP8 recipe
                        precision_overrides=precision_overrides)  # and its --fp8-* changes
        source = ModuleSource(Path(path), settings, derive_written=derive_written, lora=lora,
                              **parallel)
        tokens = sized_inputs(source.program(planned=False).input_names(), batch, seq)
        program = source.program_for(tokens)
        if memory_budget is None:
            return cls(program, batch, seq, **options)
        from runtime.cuda.step_optim import clipped

        offset = planner_budget(program, 0, options.get("optimizer", "auto"),
                                clipped(options))
        planned = ModuleSource(Path(path), settings, derive_written=derive_written,
                               planning=PlanOptions(budget=int(memory_budget) + offset,
                                                    device=plan_device, budget_offset=offset),
                               lora=lora, **parallel)
        step = cls(planned.program_for(tokens), batch, seq, **options)
        step.memory_budget, step.budget_offset = int(memory_budget), offset
        if step.fp8 is not None:  # the planner does not count an FP8 wgrad's kept x^T
            step.fp8.casts.keep_transposed = False
        step.unplanned, step.plan_device = program, plan_device
        return step

    def __post_init__(self):
        from runtime.cuda.fp8_step import head_covered, step_fp8

        # an FP8 recipe: its matmuls as FP8 GEMMs (what the GPU cannot run: refused)
        self.fp8 = step_fp8(self.program, self.dist)
        # logits split over the vocabulary (`--tp`, a `@shard(vocab)` head) are made whole
        # and take the vocab-parallel loss (runtime.kernels.vocab_parallel, torch ops),
        # never the fused head's kernel, which would see one rank's slice as every token
        output = self.program.output_names()[0]
        self.vocab_sharded = output in vocab_outputs(self.program)
        self.logits_loss = logits_loss(self.program, output)
        self.split = split_head(self.program.graph) if self.fused_head and not \
            self.vocab_sharded and not head_covered(self.fp8, self.program.graph) else None
        self.graph = self.split.graph if self.split else self.program.graph
        if isinstance(self.decisions, str) and self.decisions == "auto":
            self.decisions = Decisions.from_schedule(self.program.document.get("schedule", {}))
        if self.fp8 is not None and self.decisions is not None and self.decisions.table:
            # a value recomputed or swapped is another tensor in the backward: no wgrad x^T
            # kept from the forward's cast (fp8_step.KEEP_TRANSPOSED) would be read
            self.fp8.casts.keep_transposed = False
        self.swaps_kept = 0
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, not {self.accumulation}")
        rows = self.accumulation * self.batch
        self.tokens = torch.zeros(rows, self.seq, dtype=torch.int32, device="cuda")
        self.input_names = self.program.input_names()
        if unfed(self.input_names):
            raise ValueError(f"the training step feeds token_ids and position_ids only; the "
                             f"model takes {', '.join(self.input_names)}")
        self.positions = positions_like(self.tokens)
        self.packing = packed_buffers(self)  # packed: the documents' static buffers
        self.labels = torch.full((rows, self.seq), -100, dtype=torch.int64, device="cuda")
        self.loss = torch.zeros((), dtype=torch.float32, device="cuda")
        # the learning rate the updates read (set_lr writes it between replays) and the
        # step's global gradient norm (before clipping), device scalars the graph keeps
        self.lr_now = torch.full((1,), float(self.adamw.lr), dtype=torch.float32,
                                 device="cuda")
        self._lr_set = self.adamw.lr
        self.grad_norm = torch.zeros(1, dtype=torch.float32, device="cuda")
        # dropout's device counter (runtime/cuda/dropout.py): one more at each step's start
        self.rng_step = torch.zeros((), dtype=torch.int64, device="cuda")
        self._norms = NormSquares("cuda")
        self._adamw_batch = AdamWBatch()  # small split-master updates, 16 a launch
        self.held: dict[str, Tensor] = {}  # with clipping: the step's gradients
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.graph_fills = 0  # memset nodes of the captured graph made kernel nodes
        # fp32 masters by path: a dict (optimizer="torch") or SplitMasters (fused)
        self.masters: dict[str, Tensor] = {}
        self.lows: dict[str, Tensor] = {}  # the split masters' low halves (fused)
        self.kernels = train_kernels(attention=self.attention)
        # the plan sizes activations in its dtypes (bf16 compute): another compute dtype
        # (fp32 for the CPU comparisons) runs on torch's allocator
        self.arena = self.arena and self.dtype == torch.bfloat16
        self.activations = None  # the arena's regions, made when the step first runs (a
        # load's temporary fp32 weights are gone by then)
        self.zero = None  # runtime.dist.zero.ZeroRun under data parallel (made by load)
        # `--tp`: the streams the backward collectives are overlapped on (None: no async op)
        self.tp_streams = step_streams(self.graph)

    def _activations(self):
        """The arena (runtime/arena.py), made on first use; None off the arena."""
        if self.arena and self.activations is None:
            self.activations = self._arena()
        return self.activations

    def _arena(self):
        from runtime.arena import Arena

        layout = self.program.document.get("schedule", {}).get("layout", {})
        # no NaN over released and transient bytes (the CPU tests' check): a memset a step
        return Arena(self.graph, layout, "cuda", poison=False,
                     own_bytes=allocating_ops(self.kernels),  # their saved values: own bytes
                     # the weights region's parameters stay put (not ZeRO's gathered ones)
                     parameter_views=self.zero is None)

    # ------------------------------------------------------------------ weights
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(self.program.graph)

    def frozen(self) -> set[str]:
        """The parameters not trained: with LoRA, every one but the adapters."""
        if not hasattr(self, "_frozen"):
            self._frozen = frozen_paths(self.program)
        return self._frozen

    def ties(self) -> dict[str, str]:
        """Tied parameters (`tied_to`) -> their targets. The target owns the master, the
        moments and the update; a tied path's compute copy is its target's, and its
        gradient is added to the target's before the update."""
        if not hasattr(self, "_ties"):
            self._ties = tied_targets(self.program.weight_schema)
            layered = sorted(p for p in self._ties if "[" in p)
            if layered:  # their gradients would reach the per-layer update alone
                raise ValueError(f"the GPU step ties parameters outside repeated layers only: "
                                 f"{', '.join(layered[:3])}")
        return self._ties

    def init_random(self, seed: int = 0, std: float = 0.02, on: str = "cuda") -> "TrainStep":
        """Random weights (`random_params`), drawn on `on`: "cpu" keeps the whole fp32
        draw off the GPU (an 8B model's is 32 GB; under data parallel each rank then takes
        its shards bucket by bucket)."""
        return self.load(random_params(self.shapes(), seed, std, on))

    def load(self, params: dict[str, Tensor]) -> "TrainStep":
        """Take the weights (by path, any dtype/device): fp32 masters, bf16 compute copies,
        a fresh optimizer; a captured graph is dropped. Frozen weights (LoRA's base) get
        their compute copy only; `names` are the trained ones. With the fused optimizer
        the state lives in the plan's regions (`regions`, runtime/cuda/state.py)."""
        ties = self.ties()
        missing = set(self.shapes()) - set(params) - set(ties)
        if missing:
            raise KeyError(f"no value for {sorted(missing)[:5]}")
        frozen = self.frozen()
        self._drop_state()
        self.names = sorted(p for p in self.shapes() if p not in frozen and p not in ties)
        own = own_dtypes(self)  # `@dtype(fp32)` parameters (runtime/cuda/param_dtypes.py)
        a = self.adamw
        if self.optimizer == "auto":
            self.optimizer = "fused" if self.dtype == torch.bfloat16 else "torch"
        if self.dist is not None:
            from runtime.dist.zero import refuse_parameter_settings

            refuse_parameter_settings(self.program)
            self.dist.use_tensor_parallel_group()
        if self.optimizer == "fused" and self.dist is not None and self.dist.dp > 1:
            self._load_sharded(params, frozen)
        elif self.optimizer == "fused":
            self._load_regions(params, frozen)
        elif self.dist is not None and self.dist.dp > 1:
            raise ValueError("data parallel runs with the fused optimizer (bf16 compute)")
        else:  # torch.optim needs leaf tensors of their own: no regions
            self.masters = {p: params[p].detach().to("cuda", torch.float32).clone()
                            for p in self.names}
            self.compute = {p: params[p].detach().to("cuda", own.get(p, self.dtype),
                                                     copy=True) for p in sorted(frozen)}
            self.compute.update({p: m.to(own.get(p, self.dtype))  # fp32: the master itself
                                 for p, m in self.masters.items()})
        self.compute.update({p: self.compute[t] for p, t in ties.items()})
        if self.zero is not None:  # ZeRO-3's entry buffers come and go in this dict
            self.zero.attach(self.compute, ties)
        if self.optimizer == "torch":
            for master in self.masters.values():
                master.grad = torch.zeros_like(master)
            self.torch_optimizer = torch.optim.AdamW(
                self._param_groups(), lr=a.lr, betas=a.betas, eps=a.eps,
                weight_decay=a.weight_decay, fused=True, capturable=True)
        elif self.optimizer == "fused":
            if self.dtype != torch.bfloat16:
                raise ValueError("optimizer='fused' writes bf16 compute copies: use "
                                 "optimizer='torch' for other compute dtypes")
            self.step_count = torch.zeros((), dtype=torch.float32, device="cuda")
        else:
            raise ValueError(f"optimizer must be 'fused' or 'torch', not {self.optimizer!r}")
        self.cuda_graph = None
        return self

    def _param_groups(self) -> list[dict]:
        from runtime.cuda.step_optim import param_groups

        return param_groups(self)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps: written into the device scalars the
        updates read (a captured graph included; no re-capture, no host sync)."""
        self.adamw.lr = self._lr_set = lr
        self.lr_now.fill_(lr)
        if getattr(self, "torch_optimizer", None) is not None:
            for group in self.torch_optimizer.param_groups:
                group["lr"].fill_(lr * group["lr_scale"])

    def _drop_state(self) -> None:
        """Let go of a previous load's weights, optimizer state and captured graph before
        allocating the new ones: a resume (load, then the checkpoint's load) would hold
        both (28.7 GiB against 19.5 at the TinyLlama shape). Views of them that `params`
        still holds keep their storage until the copy is done."""
        self.regions, self.compute, self.masters, self.lows = {}, {}, {}, {}
        self.sides = {}  # {"sides": {path: slot}, "tails": {path: slot}} (_load_regions)
        self.exp_avg, self.exp_avg_sq, self.grad_sum = {}, {}, {}
        self.torch_optimizer, self.cuda_graph, self.zero = None, None, None

    def _load_regions(self, params: dict, frozen: set) -> None:
        """The fixed state in the plan's regions (runtime/cuda/state.py): bf16 compute
        copies in `weights`; each trained parameter's fp32 master split between its compute
        copy and its low half, then the moments, in `optimizer_state`; with accumulation,
        fp32 gradient sums in `gradient_sums`. A parameter stored in fp32 (`own_dtypes`)
        has an fp32 compute copy in `weights`, which is its master (no low half)."""
        from runtime.cuda.lora_kcat import lay_sides, lay_tails, one_gemm_sides, one_gemm_tails
        from runtime.cuda.state import (SplitMasters, region, region_of, split_master,
                                        stacked_order)

        shapes, own = self.shapes(), own_dtypes(self)
        owned = stacked_order(self.program.graph,
                              sorted(p for p in shapes if p not in self.ties()))
        sides = one_gemm_sides(self.program, shapes, frozen)
        tails = one_gemm_tails(self.program, shapes, frozen)
        weights, views = region_of(shapes, [(self.dtype, [p for p in owned if p not in own]),
                                            (torch.float32, [p for p in owned if p in own])],
                                   sides=sides, tails=tails)
        self.compute = {**views[0], **views[1]}
        # LoRA's one-GEMM projections' side slots and the backward's one-GEMM d_x's tail
        # slots, held here (lora_kcat registers them weakly); a weight may have both
        self.sides = {"sides": lay_sides(self.compute, sides),
                      "tails": lay_tails(self.compute, tails)}
        state, (self.lows, self.exp_avg, self.exp_avg_sq) = region_of(
            shapes, [(torch.int16, [p for p in self.names if p not in own]),
                     (torch.float32, self.names), (torch.float32, self.names)])
        self.regions = {"weights": weights, "optimizer_state": state}
        for path, view in self.compute.items():
            if path in self.lows:
                split_master(params[path], view, self.lows[path])
            else:
                view.copy_(params[path].detach())
        self.masters = SplitMasters(self.compute, self.lows,
                                    whole={p: self.compute[p] for p in self.names if p in own})
        self.grad_sum = {}  # the running sum of the micro-batches' gradients (fp32)
        if self.accumulation > 1:
            self.regions["gradient_sums"], (self.grad_sum,) = region(
                shapes, self.names, (torch.float32,))

    def _load_sharded(self, params: dict, frozen: set) -> None:
        """Data parallel (runtime/dist/zero.py): the trained parameters in the ZeRO state of
        the program's `distributed` section; the others (frozen) as compute copies in
        their own region."""
        from runtime.cuda.state import region
        from runtime.dist.streams import CudaStreams
        from runtime.dist.tp_norm import tp_norm_options
        from runtime.dist.zero import Precision, ZeroRun, check_group

        section = self.program.document["schedule"].get("distributed")
        if section is None:
            raise ValueError("the program has no distributed section: build it with "
                             "TrainStep.from_module(..., dist=...) or `modulec build --dp`")
        check_group(section["mesh"]["dp"], self.dist.dp_group)
        gradient = torch.float32 if self.accumulation > 1 else self.dtype
        precision = Precision(self.dtype, gradient, split=True, update=self._shard_update)
        self.zero = ZeroRun(section, self.dist.dp_rank, precision, "cuda", CudaStreams(),
                            self.dist.dp_group, decay_of=self._decay_of,
                            clip=self.adamw.clip_grad,
                            **tp_norm_options(self.program, self.dist))
        self.compute = self.zero.load({p: params[p] for p in self.zero.paths})
        rest = sorted(p for p in self.shapes() if p not in self.ties() and
                      p not in self.compute)
        unsharded = [p for p in rest if p not in frozen]
        if unsharded:
            raise ValueError(f"trained parameters outside the distributed section: "
                             f"{unsharded[:3]}")
        weights, (views,) = region(self.shapes(), rest, (self.dtype,))
        for path, view in views.items():
            view.copy_(params[path].detach())
        self.compute.update(views)
        self.regions = {"weights": weights}
        self.grad_sum = {}
        if self.accumulation > 1:
            self.regions["gradient_sums"], (self.grad_sum,) = region(
                self.shapes(), self.names, (torch.float32,))

    def _shard_update(self, hi: Tensor, lo: Tensor, grad: Tensor, m: Tensor, v: Tensor,
                      decay: float, scale: Tensor | None, norm: Tensor | None = None):
        """ZeroRun's update of a shard's run of parameters with one weight-decay factor
        (`decay`), the gradient multiplied by `scale` (clipping's, or None); `norm` (fp64
        device scalar or None) gets the gradient's squares."""
        from runtime.cuda.kernels import _extension

        a = self.adamw
        _extension().adamw_split_step(hi, lo, grad, m, v, self.step_count, 1.0,
                                      a.betas[0], a.betas[1], a.eps, a.weight_decay * decay,
                                      self.lr_now, scale, norm)

    def _decay_of(self, path: str) -> float:
        from runtime.train.param_groups import decay_scale

        return decay_scale(self.program, path, self.adamw)

    # ------------------------------------------------------------------ one step
    def interpreter(self, on_gradient=None) -> Interpreter:
        run = _StepInterpreter(self.graph, self.compute, self.dtype, check_finite=False,
                               kernels=self.kernels, keep_only_saved=self.keep_only_saved,
                               decisions=self.decisions, on_gradient=on_gradient,
                               hooks=self.hooks, arena=self._activations(),
                               frame_events=self.zero)
        run.step, run.fp8_run = self, self.fp8
        # the backward work nobody reads left out (runtime/prune.py: the first layer's d_x
        # under a frozen embedding); MODULEC_PRUNE_DEAD=0 runs every node (A/B runs)
        run.prune_dead = os.environ.get("MODULEC_PRUNE_DEAD", "1") != "0"
        if self.tp_streams is not None:  # compute: the stream current now (warm-up's,
            self.tp_streams.begin_step()  # capture's)
            run.in_flight = InFlight(self.tp_streams)
        if self.decisions is not None and self.execute_swaps:
            if getattr(self, "swaps", None) is None:
                self.swaps = GpuSwaps()
            run.swaps = self.swaps
        return run

    def predicted_peak(self) -> int:
        """The planner's predicted peak of this step's memory (its fixed state replaced
        by this step's, `budget_offset`): with `memory_budget`, re-planned from the
        unbudgeted graph (the same problem when no module carries memory annotations, as
        in std's models); without, everything kept. An FP8 recipe's buffers outside the
        arena (fp8 weights, the wgrad's x^T where kept, cast buffers, scales) are counted
        (modulec.plan.fp8_memory), as the budget planner counts them."""
        from modulec.plan.budget import make_problem, no_recompute, plan_budget
        from modulec.plan.devices import device

        base = getattr(self, "unplanned", self.program)
        problem = make_problem(base.graph, None, "full",
                               device(getattr(self, "plan_device", "h200-noswap")),
                               precision=base.metadata.get("precision"),
                               fp8_held=self.fp8 is not None and self.fp8.casts.keep_transposed)
        offset = getattr(self, "budget_offset", None)
        if offset is None:
            from runtime.cuda.step_optim import clipped

            held = clipped({"adamw": self.adamw, "accumulation": self.accumulation})
            return no_recompute(problem).peak_bytes - planner_budget(
                self.program, 0, self.optimizer, held)
        return plan_budget(problem, self.memory_budget + offset).outcome.peak_bytes - offset

    def loss_and_gradients(self, on_gradient=None, micro: int = 0):
        with packed(self.packing.micro(micro) if self.packing is not None else None):
            return self._loss_and_gradients(on_gradient, micro)

    def _loss_and_gradients(self, on_gradient=None, micro: int = 0
                            ) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward, loss and backward on the static inputs: (loss, gradients by path).
        `on_gradient(path, grad)`: called with each repeated layer's parameter gradients
        as soon as they are final, and with an untied LM head's before the backward runs
        (its fp32 gradient would otherwise be held through the backward's peak); those are
        not in the returned dict. `micro`: which micro-batch of the static inputs."""
        run = self.interpreter(on_gradient)
        rank = self.dist.dp_rank if self.dist is not None else 0
        run.rng = (self.rng_step, f"{rank}/{micro}")  # dropout: a mask per rank and micro
        rows = slice(micro * self.batch, (micro + 1) * self.batch)
        tokens, labels = self.tokens[rows], self.labels[rows]
        inputs = fed_inputs(self.input_names, tokens, self.positions[rows])
        (out, *others), frame = run.forward([inputs[n] for n in self.input_names])
        # auxiliary losses (0-d outputs: the MoE load-balancing loss) join the loss, seed 1;
        # summed into a tensor of their own before the head's scratch can reuse memory
        aux_seeds, aux = auxiliary_seeds(others)
        if run.swaps is not None:
            run.swaps.forward_done()
        d_head = None
        # packed data parallel: the micro-batch's denominator (runtime/cuda/packed.py)
        denominator = self.packing.denominator(micro) if self.packing is not None else None
        loss_options = {} if denominator is None else {"denominator": denominator}
        if self.split is not None:
            head = self.split.head_param
            trained = head not in self.frozen()
            loss, seed, d_head = lm_head_cross_entropy(
                out, self.compute[head], labels, self.chunk_rows, self.ignore_index,
                head_grad=trained, scratch=self._head_scratch(on_gradient, trained, out),
                **loss_options)
            if d_head is not None and on_gradient is not None and not self._head_tied():
                on_gradient(head, d_head)
                d_head = None
        else:
            loss, seed = self.logits_loss(out, labels, self.chunk_rows,
                                          ignore_index=self.ignore_index, **loss_options)
        del out
        if aux is not None:
            loss = loss + aux.to(loss.dtype)
        _, grads = run.backward(frame, [seed] + aux_seeds)
        if run.swaps is not None:
            run.swaps.finish()
        if d_head is not None:
            grads[head] = grads[head] + d_head if head in grads else d_head
        for path, target in self.ties().items():  # a tied parameter's gradient: its target's
            if path in grads:
                grad = grads.pop(path)
                grads[target] = grads[target] + grad if target in grads else grad
        return loss, grads

    def _head_scratch(self, on_gradient, trained: bool, out: Tensor) -> Tensor | None:
        """On the arena, the transient region's bytes, free between the forward and the
        backward but for the forward's output `out` (xF: transient where no backward reads
        it, as under a frozen head): they hold the LM head's logits chunk and, for a trained
        head, its gradient, which `on_gradient` takes before the backward starts (an untied
        head only). The larger free side of `out` where it lies in the region."""
        if self.activations is None or trained and (on_gradient is None or self._head_tied()):
            return None
        from modulec.plan.memory import TRANSIENT
        from modulec.plan.memory.model import round_up
        from runtime.cuda.train_kernels import byte_span

        region = self.activations.regions[TRANSIENT]
        if not self.activations.in_transient(out):
            return region
        start, end = (at - region.data_ptr() for at in byte_span(out))
        return max(region[:start // 256 * 256], region[round_up(end, 256):],
                   key=lambda part: part.numel())

    def _head_tied(self) -> bool:
        """The LM head's parameter gets gradient in the backward too (tied embeddings), or
        is tied to a parameter that does (`tied_to`)."""
        backward = self.graph.function(self.graph.backward)
        head = self.split.head_param
        return head in self.ties() or head in {p for p, _ in backward.param_grads}

    def _step(self) -> None:
        self.rng_step.add_(1)  # new dropout masks (captured: each replay)
        if self.fp8 is not None:  # the step's delayed scales; its amaxes recorded
            self.fp8.begin_step()
        # the LoRA slots' s B and A from the parameters, in one launch (slot_refresh.py)
        slot_refresh.refresh([s for slots in self.sides.values() for s in slots.values()])
        try:
            self._fused_step() if self.optimizer == "fused" else self._torch_step()
        finally:
            slot_refresh.finish()
        if self.fp8 is not None:  # pushed into the amax histories (in the graph)
            self.fp8.end_step()

    def _torch_step(self) -> None:
        losses = []
        for micro in range(self.accumulation):
            loss, grads = self.loss_and_gradients(micro=micro)
            names = [p for p in self.names if p in grads]
            into = [self.masters[p].grad for p in names]
            if micro == 0:
                torch._foreach_copy_(into, [grads[p] for p in names])
            else:
                torch._foreach_add_(into, [grads[p].float() for p in names])
            del grads
            losses.append(loss)
        if self.accumulation > 1:
            torch._foreach_div_([m.grad for m in self.masters.values()], self.accumulation)
        self._clip_torch_grads()
        self.torch_optimizer.step()
        torch._foreach_copy_([self.compute[p] for p in self.names],
                             [self.masters[p] for p in self.names])
        self.loss.copy_(torch.stack(losses).mean())

    def _clip_torch_grads(self) -> None:
        from runtime.cuda.step_optim import clip_torch_grads

        clip_torch_grads(self)

    def _fused_step(self) -> None:
        """One optimizer step over `accumulation` micro-batches: all but the last add
        their gradients to `grad_sum` (a layer's as soon as it is final); the last one's
        complete the sum, and each parameter is updated from the mean at once. With
        global clipping (`adamw.clip_grad`, one process) the gradients are held until
        the backward ends (the norm needs them all): the update leaves the backward."""
        self.step_count.add_(1)  # before the backward: updates may run inside it
        self._norms.zero()
        if self.zero is not None:
            self.zero.step_begin()
        in_backward = self.update_in_backward and not (self._holds() and
                                                       self.accumulation == 1)
        losses = []
        try:
            for micro in range(self.accumulation):
                handle = self._gradient_handler(micro)
                loss, grads = self.loss_and_gradients(handle if in_backward else None, micro)
                for p in [p for p in self.names if p in grads]:  # no gradient: no update
                    handle(p, grads.pop(p))
                losses.append(loss)
        except BaseException:
            # a step that failed midway (a notebook may go on with this step) leaves no
            # queued update or norm term for the next step to run on stale gradients
            self._adamw_batch.discard()
            raise
        if self.zero is not None:
            self.zero.step_end()
            self.grad_norm.copy_(self.zero.grad_norm)
        elif self._holds():
            self._clip_and_update()
        self._adamw_batch.flush(self)  # the queued small updates (AdamWBatch)
        if self.zero is None and not self._holds():  # the update kernels summed the squares
            self._norms.norm_into(self.grad_norm)
        self.loss.copy_(torch.stack(losses).mean())

    def _holds(self) -> bool:
        """Gradients are held to the end of the backward: global clipping on one process
        (ZeroRun holds the reduced shards itself)."""
        return self.adamw.clip_grad is not None and self.zero is None

    def _hold(self, path: str, grad: Tensor) -> None:
        from runtime.train.param_groups import clip_gradient, hyperparameters

        self.held[path] = clip_gradient(grad, hyperparameters(self.program, path,
                                                              self.adamw)[2])

    def _clip_and_update(self) -> None:
        """The global norm of the held gradients, then every parameter's update with
        them scaled by min(1, clip / (norm + 1e-6)) inside the AdamW kernel."""
        from runtime.cuda.step_optim import step_norm
        from runtime.train.param_groups import clip_coefficient

        self.grad_norm.copy_(step_norm(self, self.held))  # --tp: the whole model's
        scale = clip_coefficient(self.grad_norm, self.adamw.clip_grad)
        for path in [p for p in self.names if p in self.held]:
            self._apply(path, self.held.pop(path), scale)
        self.held = {}

    def _gradient_handler(self, micro: int):
        """What micro-batch `micro` does with a final gradient: update (a single
        micro-batch), start or add to the sum, or complete it and update (the last)."""
        if self.accumulation == 1:
            return self._hold if self._holds() else self._update
        if micro == self.accumulation - 1:
            return self._update_from_sum

        def add(path: str, grad: Tensor) -> None:
            (self.grad_sum[path].copy_ if micro == 0 else self.grad_sum[path].add_)(grad)
        return add

    def _update_from_sum(self, path: str, grad: Tensor) -> None:
        total = self.grad_sum[path].add_(grad)
        (self._hold if self._holds() else self._update)(path, total.div_(self.accumulation))

    def _update(self, path: str, grad: Tensor) -> None:
        """One AdamW step of `path` with its own settings (`@trainable`: learning rate and
        weight decay scaled, its gradient's norm clipped); its squares added to the
        step's gradient norm."""
        if self.zero is not None:  # reduced with its bucket, then its shard updated
            return self.zero.gradient(path, grad)
        from runtime.train.param_groups import clip_gradient, hyperparameters

        grad = clip_gradient(grad, hyperparameters(self.program, path, self.adamw)[2])
        # its squares into the step's gradient norm, summed by the AdamW kernel itself
        self._apply(path, grad, None, norm=self._norms.fused)

    def _apply(self, path: str, grad: Tensor, scale: Tensor | None, norm=None) -> None:
        """The fused AdamW kernel on `path`: the rate is lr_now times its lr_scale, the
        weight decay its own (param_groups), the gradient times `scale` (or 1); `norm` (a
        fp64 device scalar or None) gets the gradient's squares (before `scale`)."""
        from runtime.cuda.kernels import _extension
        from runtime.train.param_groups import decay_scale, lr_scale

        a = self.adamw
        if path not in self.lows:  # stored in fp32: its compute copy is its master
            return whole_update(self, path, grad, scale, lr_scale(self.program, path),
                                a.weight_decay * decay_scale(self.program, path, a), norm)
        if grad.numel() <= AdamWBatch.SMALL:  # LoRA's adapters: 16 a launch
            return self._adamw_batch.add(self, path, grad.contiguous(), scale, norm)
        _extension().adamw_split_step(self.compute[path], self.lows[path],
                                      grad.contiguous(), self.exp_avg[path],
                                      self.exp_avg_sq[path], self.step_count,
                                      lr_scale(self.program, path), a.betas[0], a.betas[1],
                                      a.eps, a.weight_decay * decay_scale(self.program, path,
                                                                          a),
                                      self.lr_now, scale, norm)

    def use_hooks(self):
        """The step's hook registry (made on first use, checked against the model's hook
        points): `step.use_hooks().observe("AfterAttention", fn)`; eager steps only."""
        if self.hooks is None:
            from runtime.hooks import Hooks

            self.hooks = Hooks(points=list(self.program.metadata.get("hook_points", [])))
        return self.hooks

    def set_batch(self, token_ids: Tensor, labels: Tensor | None = None,
                  documents=None, denominators=None) -> None:
        """Copy a batch into the static buffers; labels default to the next tokens. A
        packed step takes the batch's `documents` (runtime.kernels.documents.Documents),
        under data parallel with its micro-batches' `denominators` (packed.py)."""
        set_documents(self, documents, denominators)
        self.tokens.copy_(token_ids)
        if labels is None:
            labels = next_token_labels(token_ids)
        self.labels.copy_(labels)

    def capture(self, warmup: int = 2) -> None:
        """`warmup` eager steps on a side stream (they update the weights), then capture."""
        if self.hooks is not None and self.hooks.active():
            raise RuntimeUserError(
                "hooks, probes or trace lines are registered: they are Python run per op, "
                "which a captured CUDA graph replays without",
                help=["run the step eagerly (step(tokens) without capture()), or clear "
                      "the hooks and disable probes and trace before capturing"])
        self._sync_lr()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        # fill kernels for memsets where measured to pay: one-process steps with a frozen
        # base (LoRA); full fine-tuning measured none (graph_nodes.py)
        self.cuda_graph = new_graph(fills=self.dist is None and bool(self.frozen()))
        with torch.cuda.graph(self.cuda_graph):
            self._step()
        self.graph_fills = finish_graph(self.cuda_graph)  # memset nodes as kernel nodes

    def _sync_lr(self) -> None:
        """`adamw.lr` assigned directly (tests, notebooks) reaches the device scalar."""
        if self.adamw.lr != self._lr_set:
            self.set_lr(self.adamw.lr)

    def __call__(self, token_ids: Tensor, labels: Tensor | None = None,
                 documents=None, denominators=None) -> Tensor:
        self._sync_lr()
        self.set_batch(token_ids, labels, documents, denominators)
        if self.cuda_graph is None:
            self._step()
        else:
            self.cuda_graph.replay()
        return self.loss


def next_token_labels(token_ids: Tensor, ignore_index: int = -100) -> Tensor:
    labels = torch.full(token_ids.shape, ignore_index, dtype=torch.int64, device=token_ids.device)
    labels[:, :-1] = token_ids[:, 1:]
    return labels
