"""Packed sequences on the reference kernels: the documents of the batch being run.

A packed batch (`modulec train --doc-sep ID`, runtime/train/packing.py) is rows of
concatenated documents. While `packed(segments, positions)` is active (the trainer holds
it around one micro-batch's forward and backward), the kernels whose result depends on
where a token sits read it: flash_attention masks every query-key pair of two different
documents (on top of causal / window), and rope (qk_norm_rope too) rotates by `positions`
(restarting at 0 per document) where the node itself gives no position_ids. Every other
reference kernel works per token and needs nothing. decisions.md "Packed sequences" says
why this is the runtime's batch layout and not a graph input yet.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Documents:
    segments: Tensor  # [B, T] int64: the document index of each token within its row
    positions: Tensor  # [B, T] int32: the token's place in its document, 0 at its start
    # the GPU step's FlashAttention-2 varlen inputs (runtime/cuda/packed.py): the documents'
    # starts in the flattened B*T rows, B*T at the end and repeated to a fixed length
    # (int32, on the device), and the longest a document may be (T); None on the CPU
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0


_ACTIVE: ContextVar[Documents | None] = ContextVar("packed_documents", default=None)


@contextmanager
def packed(documents: Documents | None):
    """Run the kernels inside on `documents` (None: an unpacked batch, nothing changes)."""
    token = _ACTIVE.set(documents)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> Documents | None:
    """The documents `packed(...)` holds now, unchecked (None: an unpacked batch)."""
    return _ACTIVE.get()


def active(batch: int, seq: int) -> Documents | None:
    """The packed batch's documents, checked against the [batch, seq] a kernel runs on."""
    documents = _ACTIVE.get()
    if documents is not None and tuple(documents.segments.shape) != (batch, seq):
        raise RuntimeError(f"packed documents are {tuple(documents.segments.shape)} but a "
                           f"kernel runs on [{batch}, {seq}] tokens")
    return documents


def cross_document(batch: int, seq: int) -> Tensor | None:
    """[B, 1, T, T] bool, True where query i and key j lie in different documents."""
    documents = active(batch, seq)
    if documents is None:
        return None
    s = documents.segments
    return (s[:, :, None] != s[:, None, :])[:, None]


def positions(position_ids: Tensor | None, batch: int, seq: int) -> Tensor | None:
    """The node's own position_ids, else the packed batch's restarting ones (else None:
    0 .. T-1)."""
    if position_ids is not None:
        return position_ids
    documents = active(batch, seq)
    return None if documents is None else documents.positions
