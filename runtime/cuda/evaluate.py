"""The GPU step's evaluation loss: a forward pass over `TrainStep`'s bf16 compute weights
with no backward, run eagerly between graph replays (`modulec train --eval-data`).

It leaves the training step as it is: its own interpreter (the step's kernels, no
recompute decisions, no hooks), torch's caching allocator instead of the step's arena
(whose bytes the captured graph owns), its own input tensors instead of the step's static
buffers; the weights are only read. Each forward function run keeps nothing but its
outputs once it returns (there is no backward to save for), so the pass holds about one
layer's activations at a time. The loss is the step's (fused LM head + cross-entropy in
chunks, no head gradient); no host sync happens here (a packed batch's cu_seqlens are
made from its documents on the host, where split_batch makes them). Under ZeRO-3 (data
parallel) the weights are gathered as the step's forward gathers them: the interpreter
drives the step's ZeroRun frame events inside `ZeroRun.forward_only`, which drops the
entry buffers after the loss (runtime/dist/zero.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from runtime.cuda.lm_head import lm_head_cross_entropy
from runtime.cuda.packed import exact
from runtime.cuda.step_interpreter import _StepInterpreter
from runtime.inputs import fed_inputs, positions_like
from runtime.interpreter import _keep_only_saved
from runtime.kernels.documents import packed

NOTHING = frozenset()


class ForwardOnly(_StepInterpreter):
    """The step's interpreter, dropping every value of a forward function run but the
    outputs it returns (a one-element stand-in of the same shape stays)."""

    def _run(self, frame, args: list, forward) -> list:
        outputs = super()._run(frame, args, forward)
        if not frame.function.gradient_of:
            _keep_only_saved(frame, NOTHING)
            frame.children.clear()
        return outputs


def forward_interpreter(step, frame_events=None) -> ForwardOnly:
    run = ForwardOnly(step.graph, step.compute, step.dtype, check_finite=False,
                      kernels=step.kernels, keep_only_saved=False, decisions=None,
                      hooks=None, arena=None, frame_events=frame_events)
    run.fp8_run = getattr(step, "fp8", None)  # an FP8 recipe: its GEMMs, nothing recorded
    if run.fp8_run is not None:  # delayed scales from the histories as they are now
        run.fp8_run.scales.begin_step()
    return run


@torch.no_grad()
def eval_loss(step, tokens: Tensor, labels: Tensor, documents=None) -> Tensor:
    """Mean next-token cross-entropy of `tokens` [B, T] int32 against `labels` [B, T]
    int64 (CUDA) on `step`'s current weights: a [] fp32 CUDA tensor. A packed step's
    batch comes with its `documents` (runtime.kernels.documents.Documents, read on the
    host for their cu_seqlens); labels equal to the step's ignore_index are left out.
    Under ZeRO-3 the weights are gathered as the step's forward gathers them and the
    entry buffers dropped after the loss (runtime.dist.zero.ZeroRun.forward_only)."""
    zero = step.zero if step.zero is not None and step.zero.zero == 3 else None
    run = forward_interpreter(step, zero)
    if documents is not None:
        documents = exact(documents, tokens.device)
    with zero.forward_only() if zero is not None else nullcontext():
        with packed(documents):
            inputs = fed_inputs(step.input_names, tokens, positions_like(tokens)
                                if documents is None else documents.positions)
            (out, *_), frame = run.forward([inputs[n] for n in step.input_names])
        del frame
        run._sinks = {}
        return _loss(step, out, labels)


def _loss(step, out: Tensor, labels: Tensor) -> Tensor:
    """The step's loss of the forward's output (the fused LM head where it split one off:
    its weight read from the step's compute weights, under ZeRO-3 the held buffer)."""
    if step.split is not None:
        head = step.compute[step.split.head_param]
        loss, _, _ = lm_head_cross_entropy(out, head, labels, step.chunk_rows,
                                           step.ignore_index, head_grad=False)
        return loss
    loss, _ = step.logits_loss(out, labels, step.chunk_rows, ignore_index=step.ignore_index)
    return loss
