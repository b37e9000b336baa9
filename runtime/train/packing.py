"""Packed sequences (`modulec train --doc-sep ID`): each window of T+1 tokens is read
as concatenated documents, each ended by the separator id (what `modulec data` writes
after every document). A document's tokens attend only to its own earlier tokens and
take positions restarting at 0 (runtime/kernels/documents.py); the target after a
separator (the next document's first token, predicted from another document) gets
the ignore index and is left out of the loss, whose mean is over the micro-batch's
other targets. The separator itself stays a target: a document learns to end. On the
GPU the step holds the documents in static buffers (runtime/cuda/packed.py).

Under torchrun, data parallel (--zero 0-3), each rank packs its own rows
the same way, and the step is the one-process step on the ranks' rows together: the
ranks' micro-batches j make one micro-batch of dp x B rows whose loss is the mean over
all its counted targets. A rank's own mean would not give that (the ranks count different
numbers of targets, and the step averages the ranks' gradients), so each rank divides
its summed loss by `denominators` (the whole micro-batch's count / dp), which every rank
computes from the step's whole window (all ranks read it) without a collective.
Under tensor parallel (--tp M, alone or with data parallel) the ranks of a TP group hold
the same rows, so the same documents: each runs the per-document attention on its heads,
and the vocab-parallel loss (runtime.kernels.vocab_parallel.mean_cross_entropy) leaves
the ignored targets out and takes the denominators as the one-process loss does (dp and
dp_rank are the data-parallel group's). Under pipeline parallel (--pp) each stage
computes a micro-batch's documents from its rows, the last stage its ignored targets, and
data-parallel pipelines take the denominators as data-parallel ranks do
(runtime/train/pipeline.py). decisions.md "Packed sequences", "Packed data parallel: the
loss's denominator", "Packed tensor parallel", "Packed pipeline parallel and evaluation
through the stages".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.errors import RuntimeUserError
from runtime.kernels.documents import Documents

# Reference kernels that mix tokens along T other than flash_attention: a packed batch
# would leak across documents through them, so --doc-sep refuses a model that has one.
MIXING = ("mamba_conv1d", "mamba_selective_scan", "batched_matmul", "softmax")


@dataclass(frozen=True)
class Packing:
    sep: int  # the end-of-document id
    ignore_index: int = -100  # the label of a target left out of the loss


def split_batch(window: Tensor, packing: Packing | None):
    """[B, T+1] ids -> (inputs [B, T] int32, labels [B, T] int64, Documents or None)."""
    tokens = window[:, :-1].to(torch.int32).contiguous()
    labels = window[:, 1:].to(torch.int64).contiguous()
    if packing is None:
        return tokens, labels, None
    ends = tokens == packing.sep  # a separator ends its document: the next token starts one
    labels = labels.masked_fill(ends, packing.ignore_index)
    return tokens, labels, documents_of(ends)


def documents_of(ends: Tensor) -> Documents:
    """Segments and restarting positions of rows whose `ends` [B, T] mark separators."""
    rows, seq = ends.shape
    marks = ends.to(torch.int64)
    segments = marks.cumsum(1) - marks  # separators before t: t's document
    index = torch.arange(seq).expand(rows, seq)
    starts = torch.zeros_like(marks, dtype=torch.bool)
    starts[:, 1:] = ends[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return Documents(segments.contiguous(), (index - first).to(torch.int32).contiguous())


def denominators(window: Tensor, packing: Packing, batch: int, dp: int) -> list[float]:
    """Packed data parallel: what each rank divides micro-batch j's summed loss by, for
    the step's whole `window` [dp * accumulation * batch, T+1] (rank r's rows are the
    r-th dp-th of it, its micro-batch j their j-th `batch` rows): the count of counted
    targets of every rank's micro-batch j together, over dp (at least 1 / dp: a
    micro-batch without a counted target has a summed loss of 0). The ranks' losses then
    average (and their gradients, each divided by dp, sum) to the mean over the whole
    micro-batch's counted targets, as one process computes it on those rows."""
    rows, width = window.shape
    _, labels, _ = split_batch(window, packing)  # the labels the loss reads
    counted = labels != packing.ignore_index
    per_micro = counted.reshape(dp, rows // (dp * batch), batch, width - 1).sum((0, 2, 3))
    return [max(int(n), 1) / dp for n in per_micro]


def check_options(request) -> None:
    """--doc-sep and --ignore-index, before the model is built."""
    sep, ignore = request.doc_sep, request.ignore_index
    if sep is None:
        if ignore != -100:
            raise RuntimeUserError(f"--ignore-index {ignore} needs --doc-sep: an unpacked "
                                   "run has no target to ignore",
                                   help=["give --doc-sep ID (the end-of-document id) to "
                                         "pack documents"])
        return
    if sep < 0:
        raise RuntimeUserError(f"--doc-sep {sep} is not a token id",
                               help=["give the tokenizer's end-of-document (eos) id"])


def packing_for(request, vocab_size: int | None, program) -> Packing | None:
    """The run's packing (None: unpacked), checked against the model (the launch:
    check_options)."""
    sep, ignore = request.doc_sep, request.ignore_index
    if sep is None:
        return None
    if vocab_size is not None and sep >= vocab_size:
        raise RuntimeUserError(f"--doc-sep {sep} is not a token id of the model "
                               f"(vocab_size {vocab_size})",
                               help=["give the tokenizer's end-of-document (eos) id"])
    if ignore >= 0 and (vocab_size is None or ignore < vocab_size):
        raise RuntimeUserError(f"--ignore-index {ignore} is a token id: real targets with "
                               "that id would be left out of the loss",
                               help=["use a negative value (the default -100)"])
    _check_model(program, request.file)
    return Packing(sep, ignore)


def _check_model(program, file) -> None:
    """A model whose tokens meet other than through flash_attention cannot be packed."""
    found = sorted({node.target for function in program.graph.functions
                    for node in function.nodes if node.target in MIXING})
    if found:
        raise RuntimeUserError(f"--doc-sep: {file}'s model mixes tokens through "
                               f"{', '.join(found)}, which would cross documents",
                               help=["packing masks flash_attention only; train this model "
                                     "unpacked"])
