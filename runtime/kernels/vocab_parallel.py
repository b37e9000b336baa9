"""vocab_parallel_embedding, vocab_parallel_cross_entropy: the embedding table, the LM head
and the loss split over the vocabulary under `--tp M` (Megatron's vocab-parallel layers;
docs/distributed.md, Tensor parallel).

Rank r of the tensor-parallel group holds rows [r V, (r + 1) V) of a [M V, D] table (V
the local row count) and, from the column-parallel head, the logits of those tokens. The
embedding gives zeros for tokens outside the rank's rows (the pass sums the ranks' parts);
the cross-entropy all-reduces the row max (MAX), the sum of exp and the target logit (SUM)
over the group, so every rank gets the whole loss; its backward is local (softmax - onehot
on the rank's slice). `mean_cross_entropy` is the trainers' loss over such a slice (the
mean over labels != ignore_index, and d_logits), on CPU and on CUDA alike (torch ops; one
all-reduce of the max, one of the two sums, no host sync, so a CUDA graph captures it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.base import input_shape, register
from runtime.kernels.comm import group_rank, process_group


def _reduce(x: Tensor, size: int, group: str, op: str = "sum") -> Tensor:
    """x reduced over the group (in place on x, which the caller owns); one rank's is x."""
    import torch.distributed as dist

    from runtime.dist.collectives import all_reduce_

    if size > 1:
        all_reduce_(x, process_group(size, group),
                    op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return x


def owned(indices: Tensor, rows: int, size: int, group: str) -> tuple[Tensor, Tensor]:
    """(local row of each index (0 where not owned), mask of indices in this rank's rows)."""
    local = indices.long() - group_rank(size, group) * rows
    mine = (local >= 0) & (local < rows)
    return torch.where(mine, local, 0), mine


def _embedding_backward(d_y, indices, *, size, group="tp", padding_idx=None, **attrs):
    V, D = input_shape(attrs, "vocab_parallel_embedding", "weight")
    local, mine = owned(indices, V, size, group)
    d_rows = d_y.reshape(-1, D) * mine.reshape(-1, 1).to(d_y.dtype)
    d_weight = torch.zeros(V, D, dtype=d_y.dtype, device=d_y.device)
    d_weight = d_weight.index_add(0, local.reshape(-1), d_rows)
    if padding_idx is not None:
        row = int(padding_idx) - group_rank(size, group) * V
        if 0 <= row < V:
            d_weight[row].zero_()
    return [d_weight]


@register("vocab_parallel_embedding", ("indices", "weight"), ("y",), ("d_y", "indices"),
          ("d_weight",), backward=_embedding_backward)
def _embedding_forward(indices, weight, *, size, group="tp", **_):
    local, mine = owned(indices, weight.shape[0], size, group)
    rows = weight.index_select(0, local.reshape(-1)) * mine.reshape(-1, 1).to(weight.dtype)
    return [rows.reshape(*indices.shape, weight.shape[1])]


def _cross_entropy_backward(d_loss, logits, labels, lse, *, size, group="tp",
                            ignore_index=-100, **_):
    keep = labels != ignore_index
    local, mine = owned(torch.where(keep, labels, -1), logits.shape[-1], size, group)
    onehot = torch.zeros_like(logits).scatter(-1, local[..., None], 1.0) * \
        mine[..., None].to(logits.dtype)
    d_logits = d_loss[..., None] * (torch.exp(logits - lse[..., None]) - onehot)
    return [d_logits * keep[..., None].to(logits.dtype)]


@register("vocab_parallel_cross_entropy", ("logits", "labels"), ("loss", "lse"),
          ("d_loss", "logits", "labels", "lse"), ("d_logits",),
          backward=_cross_entropy_backward, stats=("loss", "lse", "d_loss"))
def _cross_entropy_forward(logits, labels, *, size, group="tp", ignore_index=-100, **_):
    m = _reduce(logits.amax(-1), size, group, "max")
    keep = labels != ignore_index
    local, mine = owned(torch.where(keep, labels, -1), logits.shape[-1], size, group)
    picked = torch.gather(logits, -1, local[..., None]).squeeze(-1) * mine.to(logits.dtype)
    sums = torch.stack([torch.exp(logits - m[..., None]).sum(-1), picked])
    sum_exp, picked = _reduce(sums, size, group)  # one all-reduce for both sums
    lse = m + torch.log(sum_exp)
    return [torch.where(keep, lse - picked, torch.zeros_like(lse)), lse]


def mean_cross_entropy(logits: Tensor, labels: Tensor, size: int, group: str = "tp",
                       ignore_index: int = -100, chunk_rows: int | None = None,
                       denominator=None) -> tuple[Tensor, Tensor]:
    """(loss [] fp32, d_logits like logits) of the mean token cross-entropy over labels
    != ignore_index, from this rank's vocabulary slice of the logits (fp32 math; float64
    stays float64), `chunk_rows` rows at a time (None: all), so the fp32 copies are one
    chunk's (two all-reduces a chunk; every rank cuts the same chunks). Every rank gets
    the same loss. `denominator` (a number or a [] tensor): the summed loss divided by it
    instead of the count (packed data parallel, runtime/train/packing.py: the same on
    the ranks of a tensor-parallel group, which hold the same rows)."""
    from runtime.cuda.lm_head import inverse_count

    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    V = logits.shape[-1]
    rows, flat = logits.reshape(-1, V), labels.reshape(-1)
    inv_n = inverse_count(flat != ignore_index, compute, denominator)
    attrs = dict(size=size, group=group, ignore_index=ignore_index)
    loss = torch.zeros((), dtype=compute, device=logits.device)
    d_rows = torch.empty_like(rows)
    step = chunk_rows or max(rows.shape[0], 1)
    for start in range(0, rows.shape[0], step):
        part = slice(start, min(start + step, rows.shape[0]))
        x = rows[part].to(compute)
        token_loss, lse = _cross_entropy_forward(x, flat[part], **attrs)
        loss = loss + token_loss.sum()
        (d_x,) = _cross_entropy_backward(inv_n.expand_as(token_loss), x, flat[part], lse,
                                         **attrs)
        d_rows[part] = d_x.to(logits.dtype)
    return loss * inv_n, d_rows.reshape(logits.shape)
