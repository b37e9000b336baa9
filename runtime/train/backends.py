"""Where a training step runs: `CPUTrainer` (the reference interpreter in float32, the
planner's recompute/swap decisions executed, AdamW in runtime.train.optim) and
`CUDATrainer` (runtime.cuda.step.TrainStep: bf16 compute, fp32 masters, fused AdamW, one
CUDA graph; an FP8 recipe's matmuls as FP8 GEMMs, its amax histories in `state()["fp8"]`
as the CPU trainer's are). Both take windows of T+1 tokens and hold their state as fp32
tensors by parameter path: `masters`, `exp_avg`, `exp_avg_sq`, and `step` (optimizer
steps taken).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import ChainMap

import torch
from torch import Tensor

from runtime.errors import RuntimeUserError
from runtime.hf_weights.schema import tied_targets
from runtime.inputs import fed_inputs, sized_inputs
from runtime.model import Model
from runtime.train.aux_loss import auxiliary_losses
from runtime.train.optim import AdamW
from runtime.train.param_groups import (clip_coefficient, clip_gradient, frozen_parameters,
                                        global_norm, hyperparameters)


class CPUTrainer:
    def __init__(self, model: Model, batch: int, seq: int, adamw: AdamW,
                 accumulation: int = 1, packing=None):
        self.model, self.batch, self.seq, self.adamw = model, batch, seq, adamw
        self.accumulation = accumulation
        self.packing = packing  # runtime.train.packing.Packing: --doc-sep (None: unpacked)
        self.names = owned_paths(model)
        program = model.source.program(planned=False)
        self.program = program
        self.output, self.inputs = program.output_names()[0], program.input_names()
        self.frozen = frozen_parameters(program)

    def train_step(self, window: Tensor) -> float:
        """One optimizer step on `window` (accumulation x batch rows): the mean of the
        micro-batches' losses and gradients, each parameter's clipped to its `grad_clip`
        and stepped with its own lr and weight decay (`@trainable`); frozen ones not."""
        losses, total = [], {}
        fp8 = self.model.fp8_state()  # an FP8 recipe: this step's amaxes are recorded
        if fp8 is not None:
            fp8.recording = True
        for index, part in enumerate(window.split(self.batch)):
            self.model.rng_seed = self.adamw.step * 65_536 + index  # dropout masks
            loss, grads = self._loss_and_gradients(part)
            losses.append(float(loss))
            for path, grad in grads.items():
                total[path] = total[path] + grad if path in total else grad
        self.model.rng_seed = None  # outside a step: inference, no dropout
        if fp8 is not None:
            fp8.recording = False
        if len(losses) > 1:
            total = {p: g / len(losses) for p, g in total.items()}
        settings = {p: hyperparameters(self.program, p, self.adamw) for p in total}
        total = {p: clip_gradient(g, settings[p][2]) for p, g in total.items()
                 if p not in self.frozen}
        self.grad_norm = self._global_norm(total)
        scale = None if self.adamw.clip_grad is None else \
            clip_coefficient(self.grad_norm, self.adamw.clip_grad)
        self.adamw.update(self.model.params, total, lambda p: settings[p][:2], scale)
        if fp8 is not None:  # the step's amaxes join their histories
            fp8.end_step()
        return sum(losses) / len(losses)

    def _global_norm(self, total: dict) -> Tensor:
        """The whole model's gradient norm: under tensor parallel the slices' squares
        summed over the TP group, the replicated parameters' once (runtime/dist/tp_norm.py)."""
        if not sliced(self.model) or not total:
            return global_norm(total.values())
        from runtime.dist.tp_norm import tp_global_norm
        from runtime.kernels.comm import group_named

        dtype = torch.promote_types(next(iter(total.values())).dtype, torch.float32)
        return tp_global_norm(total, self.program, group_named("tp"), dtype).reshape(())

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step (a schedule's, runtime.train.schedule)."""
        self.adamw.lr = lr

    def step_metrics(self) -> dict:
        """The last step's global gradient norm (before clipping; under tensor parallel
        the whole model's), for its record."""
        norm = getattr(self, "grad_norm", None)
        if norm is None:
            return {}
        return {"grad_norm": float(norm)}

    def _loss_and_gradients(self, window: Tensor, denominator: float | None = None):
        """The micro-batch's mean loss over its targets (packed: those not ignored) and
        its gradients; a packed batch's documents held for both passes. `denominator`:
        the summed loss divided by it instead (packed data parallel: packing.py)."""
        from runtime.kernels.documents import packed
        from runtime.tensor_parallel import logits_loss
        from runtime.train.packing import split_batch

        tokens, labels, documents = split_batch(window, self.packing)
        ignore = -100 if self.packing is None else self.packing.ignore_index
        with packed(documents):
            outputs = self.model.forward(**fed_inputs(
                self.inputs, tokens, documents.positions if documents else None))
            logits = outputs[self.output]
            shared = {} if denominator is None else {"denominator": denominator}
            loss, d_logits = logits_loss(self.program, self.output)(  # vocab-parallel
                logits, labels, ignore_index=ignore, **shared)  # on a `@shard(vocab)` slice
            seeds = {self.output: d_logits.to(logits.dtype)}
            for name, aux in auxiliary_losses(outputs, self.output).items():  # MoE balance
                loss = loss + aux.to(loss.dtype)
                seeds[name] = torch.ones_like(aux)
            grads = self.model.backward(**seeds).params
        return loss, tied_sums(self.model.params, grads, self.names)

    def state(self) -> dict:
        fp8 = self.model.fp8_state()  # an FP8 recipe's amax histories (runtime.fp8)
        return {"masters": {p: self.model.params[p] for p in self.names},
                "exp_avg": self.adamw.exp_avg, "exp_avg_sq": self.adamw.exp_avg_sq,
                "step": self.adamw.step} | ({"fp8": fp8.state_dict()} if fp8 else {})

    def checkpoint_source(self, moments: bool = True):
        """What a checkpoint's consolidated files are written from (runtime/train/
        consolidated.py): the state, held here whole."""
        from runtime.train.consolidated import LocalSource

        return LocalSource(self.state(), moments)

    def load_state(self, state: dict) -> None:
        with torch.no_grad():
            for path in self.names:
                self.model.params[path].copy_(state["masters"][path])
        self.adamw.exp_avg = {p: t.clone() for p, t in state["exp_avg"].items()}
        self.adamw.exp_avg_sq = {p: t.clone() for p, t in state["exp_avg_sq"].items()}
        self.adamw.step = int(state["step"])
        if self.model.fp8_state() is not None:
            self.model.fp8.load_state_dict(state.get("fp8", {}))

    def memory(self) -> dict:
        """Peak resident memory of the process (Linux: ru_maxrss is in KiB)."""
        return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "what": "host RSS"}


class CUDATrainer:
    """TrainStep through its public API: the first step eager, then capture (its one
    warm-up step is the second step) and a graph replay per step. With LoRA the step
    trains the adapters only; the frozen base weights' fp32 values stay here on the host
    (the checkpoint's base), the GPU holding their bf16 compute copies alone."""

    def __init__(self, model: Model, batch: int, seq: int, adamw: AdamW,
                 memory_budget: int | None = None, accumulation: int = 1, dist=None,
                 packing=None):
        from runtime.cuda.step import AdamWConfig, TrainStep

        self.packing = packing  # runtime.train.packing.Packing: --doc-sep (None: unpacked)
        self.names = owned_paths(model)
        if dist is not None and dist.options() is not None:  # the distributed section
            from runtime.train.data_parallel import with_distributed

            with_distributed(model, dist.options())
        program = gpu_program(model, batch, seq, memory_budget,
                              adamw.clip_grad is not None and accumulation == 1)
        if dist is not None:
            dist.context.same_program(program.document)
        from runtime.cuda.step import runtime_fixed_bytes
        from runtime.memory_check import check_step_state

        check_step_state(runtime_fixed_bytes(program, "fused", adamw.clip_grad is not None
                                             and accumulation == 1), "cuda")
        config = AdamWConfig(adamw.lr, adamw.betas, adamw.eps, adamw.weight_decay,
                             adamw.decay_all, adamw.clip_grad)
        # decisions="auto": a budgeted program's recompute decisions run in the step
        self.step = TrainStep(program, batch, seq, adamw=config, optimizer="fused",
                              accumulation=accumulation, dist=dist,
                              packed=packing is not None,
                              ignore_index=-100 if packing is None else packing.ignore_index)
        self.step.load(model.params)
        frozen = self.step.frozen()
        self.frozen = {p: model.params[p].detach().to("cpu", torch.float32)
                       for p in self.names if p in frozen}
        self.model = model
        model.params.clear()  # the step holds the fp32 masters now
        self.steps_run = 0

    def train_step(self, window: Tensor, denominators: list[float] | None = None) -> float:
        """A replay (the first step eager; the second captures). Packed, the documents
        go with the batch; one past the step's room for documents drops the graph (that
        step eager, the next captures again: runtime/cuda/packed.py). Under data
        parallel the loss returned is the ranks' mean, as the CPU trainer's (one
        all_reduce of it after the step, over the data-parallel group: a tensor-parallel
        slice's ranks hold the same loss): unpacked, the mean of the ranks' losses;
        packed (`denominators` given too), a rank's loss is its share of the step's, and
        the shares summed over the ranks / dp is the mean over every rank's counted
        targets as the ZeRO step's gradient is (docs/decisions.md "Packed data parallel:
        the loss's denominator")."""
        from runtime.train.packing import split_batch

        tokens, labels, documents = split_batch(window, self.packing)
        tokens, labels = tokens.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        if self.step.cuda_graph is not None or self.steps_run == 0:
            self.step(tokens, labels, documents, denominators)
        else:
            self.step.set_batch(tokens, labels, documents, denominators)
            self.step.capture(warmup=1)  # its one warm-up is this step
        self.steps_run += 1
        both = torch.cat([self.step.loss.reshape(1), self.step.grad_norm.reshape(1)])
        dist = self.step.dist
        if dist is not None and dist.dp > 1:  # the ranks' losses (packed: their shares)
            from runtime.dist.collectives import summed  # summed over the ranks, / dp

            both[0:1] = summed(both[0:1], dist.dp_group) / dist.dp
        # one read of both (the loss is read every step anyway: no sync more)
        loss, self._norm = both.tolist()
        return loss

    def set_lr(self, lr: float) -> None:
        """The next step's learning rate, written into the device scalar the captured
        graph reads (no re-capture)."""
        self.step.set_lr(lr)

    def step_metrics(self) -> dict:
        """The last step's global gradient norm (read with its loss); none under tensor
        parallel, where a rank sees its slices only."""
        norm = getattr(self, "_norm", None)
        if norm is None or sliced(self.model):
            return {}
        return {"grad_norm": norm}

    def attention_note(self) -> str | None:
        """Which attention kernels the steps so far ran (runtime/cuda/attention.py)."""
        from runtime.cuda.attention import ran_note

        return ran_note(set().union(*(getattr(kernel, "ran", set()) for name, kernel
                                      in self.step.kernels.items()
                                      if name.partition("@")[0] == "flash_attention")))

    def state(self, moments: bool = True) -> dict:
        """The whole state; `moments=False` under data parallel: the masters alone are
        gathered (the ranks' shards hold the moments: runtime.train.shards)."""
        s = self.step
        if s.zero is not None:
            return self._gathered_state(moments)
        if self.frozen:  # LoRA: the model's adapters are the step's masters (save_lora)
            self.model.params.update(s.masters)
        # joined one by one on the host as the checkpoint writes them (no GPU memory)
        return {"masters": ChainMap(s.masters.on("cpu"), self.frozen), "exp_avg": s.exp_avg,
                "exp_avg_sq": s.exp_avg_sq, "step": int(s.step_count.item())} | \
            ({"fp8": s.fp8.state_dict()} if s.fp8 is not None else {})  # amax histories

    def checkpoint_source(self, moments: bool = True):
        """What a checkpoint's consolidated files are written from (runtime/train/
        consolidated.py): under data parallel the ZeRO buckets gathered one at a time (a
        collective: every rank runs it), else the masters joined on the host one at a
        time from their halves."""
        from runtime.train.consolidated import LocalSource, ZeroSource

        s = self.step
        if s.zero is not None:
            return ZeroSource(s.zero, moments, keeps_gathered(s), self.frozen,
                              int(s.step_count.item()))
        state = self.state()
        return LocalSource(state, moments, shapes=s.shapes() | {
            p: t.shape for p, t in self.frozen.items()})

    def _gathered_state(self, moments: bool = True) -> dict:
        """Data parallel: the whole state, gathered shard by shard onto the host (a
        collective: every rank runs it). The first data-parallel replica keeps what it
        gathers: the main rank, and under --tp its TP partners, whose slices
        `whole_state` joins with the main rank's (kept on the main rank alone, a partner
        sent none and the join failed on rank 0, exit 101: DP 2 x TP 2, D9)."""
        s, keep = self.step, keeps_gathered(self.step)
        masters, exp_avg, exp_avg_sq = {}, {}, {}
        for path, master, m, v in s.zero.full_state(moments):
            if keep:
                masters[path] = master
                if moments:
                    exp_avg[path], exp_avg_sq[path] = m, v
        if self.frozen and keep:  # LoRA: the model's adapters are the masters (save_lora)
            self.model.params.update({p: masters[p] for p in masters})
        masters.update(self.frozen)
        return {"masters": masters, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                "step": int(s.step_count.item())}

    def load_state(self, state: dict) -> None:
        s = self.step
        s.load({p: state["masters"][p] for p in self.names})  # the step ties the rest
        if s.zero is not None:
            s.zero.load_moments(state["exp_avg"], state["exp_avg_sq"])
            s.step_count.fill_(float(state["step"]))
            s.rng_step.fill_(int(state["step"]))  # dropout masks go on, not start over
            self.steps_run = 0
            return
        self.frozen = {p: state["masters"][p].detach().to("cpu", torch.float32)
                       for p in self.frozen}
        for path in s.names:  # the trained ones
            s.exp_avg[path].copy_(state["exp_avg"][path])
            s.exp_avg_sq[path].copy_(state["exp_avg_sq"][path])
        s.step_count.fill_(float(state["step"]))
        s.rng_step.fill_(int(state["step"]))  # dropout masks go on, not start over
        if s.fp8 is not None:  # the FP8 recipe's amax histories (the CPU trainer's format)
            s.fp8.load_state_dict(state.get("fp8", {}))
        self.steps_run = 0

    def memory(self) -> dict:
        from runtime.dist.ce_gather import peak_allocated, window_bytes

        arena = self.step.arena  # its regions are torch allocations too
        # with NCCL's windows for ZeRO's gathers, where torch's statistics miss them
        return {"peak_bytes": peak_allocated(),
                "now_bytes": torch.cuda.memory_allocated() + window_bytes(),
                "what": "GPU (activations in the plan's arena)" if arena else
                "GPU (torch allocator)"}


def sliced(model: Model) -> bool:
    """The model is this rank's tensor-parallel slice (`--tp`): its gradient norm sums
    the slices' squares over the TP group (runtime/dist/tp_norm.py)."""
    return getattr(model.source, "tensor_parallel", 1) > 1


def keeps_gathered(step) -> bool:
    """Whether this rank keeps the gathered whole state: one process, or the first
    data-parallel replica (data-parallel rank 0: rank 0 and, under --tp M, ranks 1 ..
    M-1, the slices rank 0 joins)."""
    return step.dist is None or step.dist.dp_rank == 0


def gpu_program(model: Model, batch: int, seq: int, memory_budget: int | None,
                clipped: bool = False):
    """The program for the GPU step; with a budget, planned as TrainStep.from_module
    does: the planner's budget offset by the step's own fixed state (`planner_budget`),
    on the device's no-swap profile (the step recomputes, it does not swap)."""
    from dataclasses import replace

    from runtime.cuda.step import planner_budget

    names = model.source.program(planned=False).input_names()
    tokens = sized_inputs(names, batch, seq)
    program = model.source.program_for(tokens)
    if memory_budget is None:
        return program
    from modulec.lower.build_plan import PlanOptions

    offset = planner_budget(program, 0, "fused", clipped)  # clipped: held gradients
    profile = "h100-noswap" if "H100" in torch.cuda.get_device_name() else "h200-noswap"
    planning = PlanOptions(budget=memory_budget + offset, device=profile)
    source = replace(model.source, planning=planning, _built={}, _declared=None)
    try:
        return source.program_for(tokens)
    except RuntimeUserError as exc:
        from modulec.plan.units import size_text

        raise RuntimeUserError(exc.message, exc.help + [
            f"the planner's sizes include {size_text(offset)} more fixed state (fp32 "
            "gradients) than the GPU step holds: subtract it"]) from None


def split_window(window: Tensor) -> tuple[Tensor, Tensor]:
    """[B, T+1] ids -> (inputs [B, T] int32, labels [B, T] int64)."""
    return window[:, :-1].to(torch.int32).contiguous(), window[:, 1:].to(torch.int64).contiguous()


def owned_paths(model: Model) -> list[str]:
    """The parameter paths that own their tensor: all but the tied ones (`tied_to`), which
    share their target's."""
    ties = tied_targets(model.source.program(planned=False).weight_schema)
    return [p for p in sorted(model.params) if p not in ties]


def tied_sums(params: dict, grads: dict, names: list[str]) -> dict[str, Tensor]:
    """Gradients by owning path: a tied parameter's gradient is added to its owner's."""
    owner = {id(params[p]): p for p in names}
    out: dict[str, Tensor] = {}
    for path, grad in grads.items():
        key = owner[id(params[path])]
        out[key] = out[key] + grad if key in out else grad
    return out


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeUserError("--device cuda: no CUDA device is available here",
                               help=["train on the CPU with --device cpu (slow: for small "
                                     "models and tests)"])


def now() -> float:
    if "torch" in sys.modules and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()
