"""Packed batches on the GPU step (`TrainStep(packed=True)`, `modulec train --device cuda
--doc-sep ID`): what the CPU reference reads from `packed(documents)`
(runtime/kernels/documents.py), in static device buffers a captured CUDA graph reads.

- positions [rows, T] int32, restarting at 0 per document: fed as position_ids where the
  model declares them (GPT-2), and given to every rope / qk_norm_rope node that has none
  of its own (runtime/cuda/step_interpreter.py), which the CUDA rope kernels take.
- segments [rows, T] int64: only for the reference attention, which a call FlashAttention
  does not cover (fp32 compute, ALiBi) falls back to; it masks by document.
- cu_seqlens [accumulation, capacity + 1] int32: per micro-batch, the documents' starts
  in the flattened B*T rows, then B*T, repeated to the fixed length (empty documents):
  FlashAttention-2's varlen kernel (runtime/cuda/varlen.py) with max_seqlen T. A captured
  graph has a fixed number of sequences, so the buffer has a fixed `capacity`; it is not
  B*T + 1 (every token its own document) because the kernel launches blocks per sequence
  per 128 queries of max_seqlen and the backward's dq accumulator has 128 rows per
  sequence: at B*T + 1 = 8193 sequences (TinyLlama's B=4, T=2048) that is millions of
  empty blocks and gigabytes a layer. The capacity is the power of two at or above the
  most documents a micro-batch has held (at least MIN_CAPACITY, at most B*T); a batch
  with more grows it, and the step drops its captured graph (the next one is captured
  with the larger buffer: `modulec train` does that on the next step).

Labels are the caller's: the target after a separator carries the ignore index
(runtime/train/packing.py split_batch), which the fused cross-entropy leaves out.

Tensor parallel (a `dist` with tp > 1): the ranks of a TP group get the same rows, so
the same buffers; each rank's varlen attention runs on its heads, and the vocab-parallel
loss leaves the ignored targets out (and reads `denominator`) as the fused loss does.

Data parallel (a `dist` with dp > 1): each rank packs its own rows, and the batch comes
with `denominators` (runtime/train/packing.py: what each micro-batch's summed loss is
divided by, the whole micro-batch's count over the ranks / dp), held in a static
[accumulation] fp32 buffer the loss reads (`denominator`), so the ranks' averaged
gradients are the one-process step's on their rows together.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.documents import Documents

MIN_CAPACITY = 8


def document_counts(positions: Tensor, batch: int) -> list[int]:
    """The documents in each micro-batch of `batch` rows of positions [rows, T] (host)."""
    starts = (positions == 0).reshape(-1, batch * positions.shape[1]).sum(1)
    return [int(n) for n in starts]


def capacity_for(documents: int, limit: int) -> int:
    """The sequences the varlen buffer holds for `documents`: the power of two at or above
    it, at least MIN_CAPACITY, at most `limit` (B*T: every token a document)."""
    capacity = MIN_CAPACITY
    while capacity < documents:
        capacity *= 2
    return min(capacity, limit)


def padded_cu_seqlens(positions: Tensor, capacity: int) -> Tensor:
    """int32 [capacity + 1]: the starts of the documents of rows positions [B, T] (each row
    starts one; a document starts where its position is 0) in the flattened B*T rows, then
    B*T repeated (empty documents) to the fixed length."""
    flat = positions.reshape(-1)
    if flat.numel() == 0 or int(flat[0]) != 0:
        raise ValueError("packed positions must start each row at 0")
    starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int32)
    if starts.numel() > capacity:
        raise ValueError(f"{starts.numel()} documents, room for {capacity}")
    cu = torch.full((capacity + 1,), flat.numel(), dtype=torch.int32)
    cu[:starts.numel()] = starts
    return cu


class PackedBuffers:
    """The static device buffers of a packed step's `accumulation` micro-batches of
    `batch` rows of `seq` tokens (`set` copies a batch's documents in)."""

    def __init__(self, accumulation: int, batch: int, seq: int, device="cuda"):
        self.batch, self.seq, self.device = batch, seq, device
        rows = accumulation * batch
        self.positions = torch.zeros(rows, seq, dtype=torch.int32, device=device)
        self.segments = torch.zeros(rows, seq, dtype=torch.int64, device=device)
        self.capacity = 0
        self.cu_seqlens = torch.zeros(accumulation, 1, dtype=torch.int32, device=device)
        self.denominators: Tensor | None = None  # data parallel: [accumulation] fp32

    def set(self, documents: Documents, denominators=None) -> bool:
        """Copy `documents` ([rows, T], any device) and the micro-batches' `denominators`
        (a list of numbers, data parallel; None: each divides by its own count) in; True
        when a micro-batch held more documents than the capacity, which then grew, or the
        denominators' buffer was made or dropped (a graph captured with the old buffers
        must go)."""
        changed = self._set_denominators(denominators)
        positions = documents.positions.to("cpu", torch.int32)
        if tuple(positions.shape) != tuple(self.positions.shape):
            raise ValueError(f"the documents are {tuple(positions.shape)}, the step's "
                             f"batch {tuple(self.positions.shape)}")
        most = max(document_counts(positions, self.batch))
        grown = most > self.capacity
        if grown:
            self.capacity = capacity_for(most, self.batch * self.seq)
            self.cu_seqlens = torch.zeros(self.cu_seqlens.shape[0], self.capacity + 1,
                                          dtype=torch.int32, device=self.device)
        cu = torch.stack([padded_cu_seqlens(part, self.capacity)
                          for part in positions.split(self.batch)])
        self.cu_seqlens.copy_(cu)
        self.positions.copy_(positions)
        self.segments.copy_(documents.segments)
        return grown or changed

    def _set_denominators(self, values) -> bool:
        if values is None:
            changed, self.denominators = self.denominators is not None, None
            return changed
        values = torch.tensor([float(v) for v in values], dtype=torch.float32)
        if values.shape != self.cu_seqlens.shape[:1]:
            raise ValueError(f"{values.numel()} denominators for "
                             f"{self.cu_seqlens.shape[0]} micro-batches")
        made = self.denominators is None
        if made:
            self.denominators = torch.zeros_like(values, device=self.device)
        self.denominators.copy_(values)
        return made

    def denominator(self, index: int) -> Tensor | None:
        """Micro-batch `index`'s denominator (a [] view of the static buffer), or None:
        its own count of counted targets."""
        return None if self.denominators is None else self.denominators[index]

    def micro(self, index: int) -> Documents:
        """Micro-batch `index`'s documents: views of the static buffers."""
        if self.capacity == 0:
            raise ValueError("a packed step runs on a batch's documents: give them to "
                             "set_batch (or the call) before the first step or capture")
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return Documents(self.segments[rows], self.positions[rows], self.cu_seqlens[index],
                         self.seq)


def exact(documents: Documents, device) -> Documents:
    """`documents` on `device` with cu_seqlens of exactly its documents (an eager call:
    the evaluation's forward)."""
    positions = documents.positions.to("cpu", torch.int32)
    cu = padded_cu_seqlens(positions, int((positions == 0).sum()))
    return Documents(documents.segments.to(device), positions.to(device), cu.to(device),
                     positions.shape[1])


def packed_buffers(step) -> PackedBuffers | None:
    """A packed step's buffers (None: unpacked), checked first; its positions become the
    step's (fed where the model declares position_ids)."""
    if not step.packed:
        return None
    check_packed(step)
    buffers = PackedBuffers(step.accumulation, step.batch, step.seq)
    step.positions = buffers.positions
    return buffers


def check_packed(step) -> None:
    """What a packed step does not run: refused before anything is allocated."""
    from runtime.errors import RuntimeUserError
    from runtime.train.packing import MIXING

    nodes = [node for function in step.program.graph.functions for node in function.nodes]
    pinned = sorted({_pinned_dense(node) for node in nodes
                     if node.target == "flash_attention"} - {None})
    if pinned:
        raise RuntimeUserError(f"`@kernel(\"{pinned[0]}\", fallback=false)` on flash_attention: "
                               f"{pinned[0]} takes no packed documents (a packed step runs "
                               "FlashAttention-2's varlen kernel)",
                               help=["drop fallback=false, or train unpacked"])
    found = sorted({node.target for node in nodes if node.target in MIXING})
    if found:
        raise RuntimeUserError(f"the model mixes tokens through {', '.join(found)}, which "
                               "a packed batch would carry across documents",
                               help=["packing masks flash_attention only; train this "
                                     "model unpacked"])


def _pinned_dense(node) -> str | None:
    """The kernel a node's `@kernel(..., fallback=false)` pins it to where that kernel
    cannot take packed documents (every attention backend but FlashAttention-2, whose
    varlen entry a packed step runs), or None."""
    from runtime.kernel_choice import REFERENCE, requested

    choice = requested(node)
    if choice is None or choice[1] or choice[0] in ("flash", REFERENCE):
        return None
    return choice[0]


def set_documents(step, documents: Documents | None, denominators=None) -> None:
    """TrainStep.set_batch's documents (and data parallel's denominators): required for
    a packed step, refused otherwise."""
    if step.packing is None:
        if documents is not None or denominators is not None:
            raise ValueError("documents for a step built unpacked: build it with "
                             "packed=True")
        return
    if documents is None:
        raise ValueError("a packed step needs each batch's documents "
                         "(runtime.train.packing.split_batch)")
    if step.packing.set(documents, denominators):
        step.cuda_graph = None  # captured with the smaller cu_seqlens buffer (or none)
