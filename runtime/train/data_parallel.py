"""The CPU trainer on several processes (gloo): data parallel with ZeRO sharding executed
from the IR's `distributed` section by runtime.dist.zero, the same code the GPU step runs
(only the precision differs: fp32 masters and torch's AdamW arithmetic here). Each rank
trains on its own rows of the batch; the parameters stay equal on every rank."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dist.collectives import summed
from runtime.dist.context import DistContext
from runtime.dist.streams import InOrder
from runtime.dist.tp_norm import tp_norm_options
from runtime.dist.zero import Precision, ZeroRun, check_group, refuse_parameter_settings
from runtime.errors import RuntimeUserError
from runtime.hf_weights.schema import tied_targets
from runtime.inputs import sized_inputs
from runtime.model import Model
from runtime.train.backends import CPUTrainer
from runtime.train.optim import AdamW, adamw_step_


def with_distributed(model: Model, options) -> Model:
    """The model rebuilt with the distributed section in its IR (`options`:
    modulec.plan.distributed.DataParallel). A model read from an IR document is not
    rebuilt: its document must carry a section for this run (`modulec build --dp N
    --zero S`), which then decides the ZeRO stage."""
    from runtime.program import IRSource

    if isinstance(model.source, IRSource):
        section = model.source.program().document.get("schedule", {}).get("distributed")
        if section is None:
            raise RuntimeUserError(f"{model.source.path} has no distributed section",
                                   help=[f"build it with `modulec build ... --dp "
                                         f"{options.dp} --zero {options.zero}`"])
        if section["zero"] != options.zero:
            raise RuntimeUserError(f"{model.source.path} was built for ZeRO stage "
                                   f"{section['zero']}; this run asks for {options.zero}",
                                   help=[f"leave out --zero, or rebuild with --zero "
                                         f"{options.zero}"])
        return model
    model.source = replace(model.source, distributed=options, _built={}, _declared=None)
    return model


def built_zero(model: Model) -> int | None:
    """The ZeRO stage an IR document was built for (None: not an IR, or no section)."""
    from runtime.program import IRSource

    if not isinstance(model.source, IRSource):
        return None
    section = model.source.program().document.get("schedule", {}).get("distributed")
    return None if section is None else section["zero"]


def program_of(model: Model, batch: int, seq: int):
    names = model.source.program(planned=False).input_names()
    return model.source.program_for(sized_inputs(names, batch, seq))


def section_of(model: Model, batch: int, seq: int) -> dict:
    return program_of(model, batch, seq).document["schedule"]["distributed"]


class CPUDataParallelTrainer(CPUTrainer):
    def __init__(self, model: Model, batch: int, seq: int, adamw: AdamW, parallel,
                 accumulation: int = 1, packing=None):
        """`parallel`: runtime.dist.DataParallelRun (ZeRO over its data-parallel group; with
        tensor parallel, the model is this rank's slice and the TP pair uses its group).
        `packing`: --doc-sep's (runtime.train.packing.Packing), each rank its own rows."""
        with_distributed(model, parallel.options())
        super().__init__(model, batch, seq, adamw, accumulation, packing)
        self.context = context = parallel.context
        self.dp_rank = parallel.dp_rank
        parallel.use_tensor_parallel_group()
        program = program_of(model, batch, seq)
        context.same_program(program.document)
        refuse_parameter_settings(program)
        section = section_of(model, batch, seq)
        check_group(section["mesh"]["dp"], parallel.dp_group)
        precision = Precision(model.dtype, model.dtype, split=False, update=self._update)
        self.zero = ZeroRun(section, parallel.dp_rank, precision, "cpu", InOrder(),
                            parallel.dp_group, decay_of=self._decay_of,
                            clip=adamw.clip_grad, **tp_norm_options(program, parallel))
        self.ties = tied_targets(model.source.program(planned=False).weight_schema)
        self._bind(self.zero.load(model.params))
        model.frame_events = self.zero

    def _bind(self, views: dict[str, Tensor]) -> None:
        """The model reads the ZeRO state's compute copies (tied parameters: their
        target's)."""
        params = self.model.params
        params.update(views)
        for path, target in self.ties.items():
            params[path] = params[target]
        self.zero.attach(params, self.ties)  # ZeRO-3's entry buffers come and go

    def _decay_of(self, path: str) -> float:
        from runtime.train.param_groups import decay_scale

        return decay_scale(self.program, path, self.adamw)

    def _update(self, hi: Tensor, lo, grad: Tensor, m: Tensor, v: Tensor, decay: float,
                scale: Tensor | None) -> None:
        a = self.adamw
        if scale is not None:
            grad = grad * scale
        adamw_step_(hi, grad, m, v, a.step, a.lr, a.betas, a.eps, a.weight_decay * decay)

    def step_metrics(self) -> dict:
        """The last step's global gradient norm (over every rank's shards; under tensor
        parallel the TP slices' summed)."""
        return {"grad_norm": float(self.zero.grad_norm)}

    def train_step(self, window: Tensor, denominators: list[float] | None = None) -> float:
        """One optimizer step on this rank's `window` rows; returns the mean loss over
        every rank's rows. Packed, `denominators` (runtime.train.packing.denominators)
        divide each micro-batch's summed loss: the step is then one process's on every
        rank's rows (the mean over their counted targets)."""
        losses, total = [], {}
        self.adamw.step += 1
        self.zero.step_begin()
        parts = window.split(self.batch)
        if denominators is not None and len(denominators) != len(parts):
            raise ValueError(f"{len(denominators)} denominators for {len(parts)} "
                             "micro-batches")
        for index, part in enumerate(parts):
            loss, grads = self._loss_and_gradients(
                part, None if denominators is None else denominators[index])
            losses.append(float(loss))
            for path, grad in grads.items():
                total[path] = total[path] + grad if path in total else grad
        for path in self.zero.index:  # one order on every rank: the collectives match
            if path in total:
                grad = total.pop(path)
                self.zero.gradient(path, grad / len(losses) if len(losses) > 1 else grad)
        self.zero.step_end()
        return self._mean_over_ranks(sum(losses) / len(losses))

    def _mean_over_ranks(self, loss: float) -> float:
        """Every rank's loss averaged (a tensor-parallel slice's ranks hold the same)."""
        return float(summed(torch.tensor([loss], dtype=torch.float64))) / self.context.world

    def state(self, moments: bool = True) -> dict:
        """The whole state, gathered (a collective: every rank calls it); `moments=False`:
        the masters alone (the ranks' shards hold the moments)."""
        masters, exp_avg, exp_avg_sq = {}, {}, {}
        for path, master, m, v in self.zero.full_state(moments):
            masters[path] = master
            if moments:
                exp_avg[path], exp_avg_sq[path] = m, v
        for path in self.names:
            if path not in masters:  # not trained here (frozen)
                masters[path] = self.model.params[path]
        return {"masters": masters, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                "step": self.adamw.step}

    def checkpoint_source(self, moments: bool = True):
        """The ZeRO buckets gathered one at a time for a checkpoint's consolidated files
        (a collective: every rank runs it; data-parallel rank 0, with its TP partners,
        keeps them), then the parameters in no bucket (frozen)."""
        from runtime.train.consolidated import ZeroSource

        others = {p: self.model.params[p] for p in self.names if p not in self.zero.paths}
        return ZeroSource(self.zero, moments, self.dp_rank == 0, others, self.adamw.step)

    def load_state(self, state: dict) -> None:
        masters = {p: state["masters"][p] for p in self.zero.paths}
        self._bind(self.zero.load(masters))
        self.zero.load_moments(state["exp_avg"], state["exp_avg_sq"])
        with torch.no_grad():
            for path in self.names:
                if path not in self.zero.paths:
                    self.model.params[path].copy_(state["masters"][path])
        self.adamw.step = int(state["step"])


# ---------------------------------------------------------------------- tensor parallel
STATE_PARTS = ("masters", "exp_avg", "exp_avg_sq")


def whole_state(state: dict, model: Model, parallel) -> dict:
    """A tensor-parallel rank's state (its slices) joined with its slice's other ranks'
    into whole tensors, as one process holds them (a collective over the TP group)."""
    from runtime.tensor_parallel import sharded_paths, unshard_tensors

    sharded = sharded_paths(model.source.program(planned=False))
    whole = dict(state)
    for part in STATE_PARTS:
        mine = {p: state[part][p].detach().cpu() for p in sharded if p in state[part]}
        slices = [None] * parallel.tp
        dist.all_gather_object(slices, mine, group=parallel.tp_group)
        joined = {p: unshard_tensors([s[p] for s in slices], sharded[p]) for p in mine}
        whole[part] = {p: joined.get(p, v) for p, v in state[part].items()}
    return whole


def rank_state(state: dict, model: Model, tp_rank: int) -> dict:
    """This tensor-parallel rank's slices of a whole state (a checkpoint's)."""
    from runtime.tensor_parallel import shard_params

    program = model.source.program(planned=False)
    return dict(state, **{part: shard_params(dict(state[part]), program, tp_rank)
                          for part in STATE_PARTS})
