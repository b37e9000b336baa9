"""`modulec train --eval-data FILE --eval-every K [--eval-batches N]`: the validation
loss, forward only (no gradients, no optimizer state touched), every K optimizer steps and
after the last one.

The eval file is a token file like `--data` (same dtype). It is cut into the same windows
of T+1 tokens, read in file order (no shuffling): batch i holds windows i*B .. i*B+B-1, so
every evaluation reads the same tokens. N batches (default: every whole batch in the
file) of the run's micro-batch size B are evaluated; the eval loss is the mean of their
mean next-token cross-entropies (every batch has B*T targets, so it is the mean over all
targets). On the CPU the reference interpreter runs the forward; on the GPU a forward-only
interpreter over the step's bf16 compute weights (runtime/cuda/evaluate.py), outside the
captured graph and its arena.

Under torchrun, data parallel (--zero 0-3), the batches are split over the data-parallel
ranks (batch i on rank i % dp); one all_reduce over the run's data-parallel group sums the
ranks' sums of batch losses, and every rank divides by the number of batches: the
one-process eval loss on every rank (rank 0 reports it). ZeRO 0-2 ranks hold the whole
compute weights; under ZeRO-3 the forward gathers them as the step's does
(ZeroRun.forward_only), so every rank runs the same number of forwards.

Under tensor parallel (--tp M, alone or DP x TP) the M ranks of a TP group evaluate the
same batches together, as they train on the same rows: each runs the forward of its
slices (the group's collectives in it), and the loss is the vocab-parallel loss's value,
the same on every rank of the group. The batches are split over the data-parallel
groups (batch i on the TP groups of data-parallel rank i % dp) and the all_reduce runs
over the data-parallel group alone (one rank per TP group: the TP ranks' equal sums are
not added).

Under pipeline parallel (--pp P, with or without --tp and data-parallel pipelines) the
trainer evaluates itself (PipelineTrainer.evaluate): each batch forward through the
stages, the batches split over the pipelines, the last stages' sums all-reduced over
every rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.errors import RuntimeUserError
from runtime.train.data import TokenData


@dataclass
class EvalData:
    path: Path
    dtype: str
    seq: int
    batch: int
    vocab_size: int | None = None
    batches: int | None = None  # --eval-batches (None: every whole batch)
    tokens: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        # TokenData's checks: a regular, non-empty file of whole ids, one batch at least,
        # every id below vocab_size
        self.tokens = TokenData(self.path, self.dtype, self.seq, self.batch, 0,
                                self.vocab_size).tokens
        whole = ((len(self.tokens) - 1) // self.seq) // self.batch
        if self.batches is None:
            self.batches = whole
        elif self.batches < 1:
            raise RuntimeUserError(f"--eval-batches must be at least 1, not {self.batches}")
        elif self.batches > whole:
            raise RuntimeUserError(
                f"--eval-batches {self.batches}: {self.path} holds {whole} whole batches of "
                f"{self.batch} x {self.seq} (+1) tokens",
                help=[f"give --eval-batches {whole} or fewer, or leave it out (all)"])

    def batch_at(self, index: int) -> torch.Tensor:
        """Batch `index` (0-based): [batch, seq + 1] int64, windows in file order."""
        rows = []
        for window in range(index * self.batch, (index + 1) * self.batch):
            start = window * self.seq
            rows.append(np.asarray(self.tokens[start:start + self.seq + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def check_eval_options(eval_data, eval_every, eval_batches) -> None:
    """--eval-every and --eval-batches need --eval-data, and --eval-data needs a positive
    --eval-every; evaluation runs in one process, data parallel, tensor parallel,
    pipeline parallel, or any of them together."""
    if eval_data is None:
        given = [f for f, v in (("--eval-every", eval_every),
                                ("--eval-batches", eval_batches)) if v is not None]
        if given:
            raise RuntimeUserError(f"{' and '.join(given)} need --eval-data FILE")
        return
    if eval_every is None or eval_every < 1:
        raise RuntimeUserError("--eval-data needs --eval-every K (K >= 1): evaluate every "
                               "K optimizer steps", help=["for example --eval-every 50"])


def due(step: int, every: int, last: int) -> bool:
    """Whether the evaluation runs after optimizer step `step`."""
    return step % every == 0 or step == last


def evaluate(trainer, data: EvalData, parallel=None) -> float:
    """The mean loss of the eval batches on the trainer's current weights. `parallel`
    (runtime.dist.DataParallelRun, data and/or tensor parallel): this rank evaluates
    batches i with i % dp == its data-parallel rank (a TP group's ranks the same ones,
    the forward and the vocab-parallel loss collectives over the group), and the sum
    over the data-parallel group (a collective: every rank calls it) is divided by the
    number of batches. Under ZeRO-3 a forward gathers weights with
    the other ranks, so every rank runs as many: one left without a batch in the last
    round runs one whose loss it does not count."""
    from runtime.train.pipeline import PipelineTrainer

    if isinstance(trainer, PipelineTrainer):  # --pp: through the stages, every pipeline
        return trainer.evaluate(data)
    dp, rank = (parallel.dp, parallel.dp_rank) if parallel is not None else (1, 0)
    total = 0.0
    for start in range(0, data.batches, dp):
        index = start + rank
        if index < data.batches:
            total += batch_loss(trainer, data.batch_at(index))
        elif gathers(trainer):  # the same collectives as the ranks that have a batch
            batch_loss(trainer, data.batch_at(start))
    if dp > 1:
        total = ranks_total(total, parallel)
    return total / data.batches


def gathers(trainer) -> bool:
    """The trainer's forward gathers its weights across the ranks (ZeRO-3)."""
    from runtime.train.shards import zero_of

    zero = zero_of(trainer)
    return zero is not None and zero.zero == 3


def ranks_total(value: float, parallel) -> float:
    """`value` summed over the data-parallel ranks: one all_reduce on the run's
    data-parallel group, in float64 (on the device NCCL needs: the context's)."""
    from runtime.dist.collectives import summed

    return float(summed(torch.tensor([value], dtype=torch.float64,
                                     device=parallel.context.device), parallel.dp_group))


def batch_loss(trainer, window: torch.Tensor) -> float:
    from runtime.train.backends import CUDATrainer

    if isinstance(trainer, CUDATrainer):
        from runtime.cuda.evaluate import eval_loss
        from runtime.train.packing import split_batch

        tokens, labels, documents = split_batch(window, trainer.packing)
        return float(eval_loss(trainer.step, tokens.cuda(non_blocking=True),
                               labels.cuda(non_blocking=True), documents))
    return cpu_loss(trainer, window)


@torch.no_grad()
def cpu_loss(trainer, window: torch.Tensor) -> float:
    """The CPU trainer's model, forward only: no dropout (`rng_seed` None), the frame it
    keeps for a backward dropped at once."""
    from runtime.inputs import fed_inputs
    from runtime.kernels.documents import packed
    from runtime.tensor_parallel import logits_loss
    from runtime.train.packing import split_batch
    from runtime.train.shards import zero_of

    model, packing = trainer.model, getattr(trainer, "packing", None)
    tokens, labels, documents = split_batch(window, packing)
    seed, model.rng_seed = model.rng_seed, None
    # data parallel: ZeRO 0-2 bind the whole weights (no ZeRO trigger runs); ZeRO-3
    # gathers them as the step's forward does (ZeroRun.forward_only)
    zero = zero_of(trainer) if gathers(trainer) else None
    events, model.frame_events = model.frame_events, model.frame_events if zero else None
    try:
        with zero.forward_only() if zero is not None else nullcontext(), packed(documents):
            logits = model.forward(**fed_inputs(
                trainer.inputs, tokens, documents.positions if documents else None)
            )[trainer.output]
    finally:
        model.rng_seed, model._frame, model.frame_events = seed, None, events
    loss, _ = logits_loss(model.source.program(planned=False), trainer.output)(
        logits, labels, ignore_index=-100 if packing is None else packing.ignore_index)
    return float(loss)
