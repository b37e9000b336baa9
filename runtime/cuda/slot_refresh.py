"""The LoRA step's side and tail slots refreshed at the step's start, in one launch.

The one-GEMM path (runtime/cuda/lora_kcat.py) needs s B in the k r columns laid beside a
frozen weight's rows (its side slot) and, for down_proj's backward, A in the rows laid
after them (its tail slot). B and A change with every update, so the forward wrote each
side (`torch.mul(B, s, out=side)`) and the backward each tail (`tail.copy_(A)`): one
launch apiece, 2.6-3.5 us each in the LoRA 8B replay (four a layer, ~0.45 ms a step
with their gaps), for 16-460 KB each.

Here the first forward notes, for each slot it fills, where the slot's values come from:
pieces (a parameter's compute tensor, the row and column it lands at, the scale). From
then on `refresh` runs at the step's start and writes every noted piece of every slot in
one launch (csrc/kernels/scaled_copies.cu: the pieces' table lives on the device, so the
captured graph replays the launch), and marks the slots fresh; the forward and backward
`take` a fresh slot instead of filling it. A slot is fresh for one use: a second forward
in the same step (a recompute replay, an evaluation) fills it as before, and `finish`
(the step's end) forgets what is left. Only parameters are noted (a block-diagonal B's
blocks, each a parameter; never a value the step computes): the parameters change only
in the optimizer's update, after the forward and after the backward has read the slot,
so the slot written at the start holds what the forward's own fill would have written:
the same bf16 products (fp32 product rounded once, as torch.mul), the same bits.
A block-diagonal slot's zero blocks are written by the first (unnoted) fill and never
again. MODULEC_SLOT_REFRESH=0 turns it off (A/B runs).
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass

import torch

COPY_ROW = struct.Struct("<QQqqqqff")  # csrc/kernels/kernels.h ScaledCopy (56 bytes)


@dataclass(frozen=True)
class Piece:
    source: weakref.ref  # a parameter's compute tensor, 2-D contiguous
    row: int  # where it lands in the slot
    col: int
    alpha: float


_noted: dict[tuple, tuple] = {}  # the slot's view_key -> its Pieces
_fresh: set = set()  # slot keys written by this step's `refresh`, not yet taken
_tables: dict = {}  # the copies' signature -> (table tensor, count, most pieces)


def enabled() -> bool:
    """MODULEC_SLOT_REFRESH=0: every slot filled where it is used, as before (A/B runs)."""
    return os.environ.get("MODULEC_SLOT_REFRESH", "1") != "0"


def view_key(t: torch.Tensor) -> tuple:
    """A tensor view's identity: its device, first element, shape and strides."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride())


def note(slot: torch.Tensor, pieces, alpha: float) -> None:
    """From the next step on, `refresh` fills `slot` with each (tensor, row, col) of
    `pieces` scaled by alpha."""
    _noted[view_key(slot)] = tuple(Piece(weakref.ref(t), int(r), int(c), float(alpha))
                                   for t, r, c in pieces)


def take(slot: torch.Tensor, pieces, alpha: float) -> bool:
    """Whether this step's `refresh` already filled `slot` with exactly these pieces (then
    the caller skips its own fill): once per refresh."""
    key = view_key(slot)
    if key not in _fresh:
        return False
    _fresh.discard(key)
    noted = _noted.get(key)
    return noted is not None and len(noted) == len(pieces) and all(
        _same(p.source(), t) and (p.row, p.col, p.alpha) == (r, c, float(alpha))
        for p, (t, r, c) in zip(noted, pieces))


def _same(kept, given: torch.Tensor) -> bool:
    return kept is not None and view_key(kept) == view_key(given)


def finish() -> None:
    """The step ends: slots it did not take are not fresh for the next use."""
    _fresh.clear()


def refresh(slots) -> int:
    """Fill each of `slots` (one step's side and tail slots: a step's graph then reads
    and writes its own bytes alone) that a fill noted, from its parameters now, in one
    launch where the pieces fit the kernel (torch ops for any that do not), and mark them
    fresh; how many pieces were written."""
    if not enabled():
        return 0
    copies, keys = [], []
    for slot in slots:
        key = view_key(slot)
        noted = _noted.get(key)
        if noted is None:
            continue
        sources = [p.source() for p in noted]
        if any(s is None for s in sources):  # a parameter gone: the slot's step with it
            del _noted[key]
            continue
        keys.append(key)
        copies += [(s, _target(slot, s, p), p.alpha) for s, p in zip(sources, noted)]
    if not copies:
        return 0
    for source, target, alpha in copies:
        if not _fits(source, target):
            _torch_copy(source, target, alpha)
    _launch([c for c in copies if _fits(*c[:2])])
    _fresh.update(keys)
    return len(copies)


def _target(slot: torch.Tensor, source: torch.Tensor, piece: Piece) -> torch.Tensor:
    return slot[piece.row:piece.row + source.shape[0], piece.col:piece.col + source.shape[1]]


def _fits(source: torch.Tensor, target: torch.Tensor) -> bool:
    """The kernel's terms: bf16, 2-D, rows of a multiple of 8 elements, 16-byte aligned."""
    return source.is_cuda and source.device == target.device \
        and source.dtype == target.dtype == torch.bfloat16 and source.dim() == target.dim() == 2 \
        and source.shape == target.shape and source.shape[1] % 8 == 0 \
        and source.stride(1) == target.stride(1) == 1 \
        and source.stride(0) % 8 == 0 and target.stride(0) % 8 == 0 \
        and source.data_ptr() % 16 == 0 and target.data_ptr() % 16 == 0


def _torch_copy(source, target, alpha: float) -> None:
    if alpha == 1.0:
        target.copy_(source)
    else:
        torch.mul(source, alpha, out=target)


def _launch(copies: list) -> None:
    """The copies in one launch. Their table is made once per set of copies and kept for
    the process (a captured graph reads it; 56 bytes a copy); a graph being captured
    with copies not seen before gets torch ops instead (no table can be made then)."""
    if not copies:
        return
    signature = tuple((s.data_ptr(), t.data_ptr(), *s.shape, s.stride(0), t.stride(0), a)
                      for s, t, a in copies)
    kept = _tables.get(signature)
    if kept is None:
        if torch.cuda.is_current_stream_capturing():
            for copy in copies:
                _torch_copy(*copy)
            return
        rows = b"".join(COPY_ROW.pack(s.data_ptr(), t.data_ptr(), s.shape[0], s.shape[1],
                                      s.stride(0), t.stride(0), a, 0.0) for s, t, a in copies)
        table = torch.frombuffer(bytearray(rows), dtype=torch.uint8).to(copies[0][0].device)
        kept = _tables[signature] = (table, len(copies), max(s.numel() // 8 for s, _, _ in copies))
    from runtime.cuda.build import load

    load().scaled_copies(*kept)
