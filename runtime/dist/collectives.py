"""The three collectives of data parallel (and `summed`, a loss over the ranks), through torch.distributed (NCCL on CUDA, gloo
on the CPU), on flat tensors (all_reduce_, with its `op`, also the vocab-parallel loss's
max and sums: runtime/kernels/vocab_parallel.py). Each is issued on the current stream:
under `torch.cuda.stream(comm)` it runs after what that stream waited for and before what
comes next on it, and the compute stream goes on meanwhile."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def all_reduce_(tensor: Tensor, group=None, op=dist.ReduceOp.SUM) -> None:
    """Reduce over the ranks by `op` (a torch.distributed.ReduceOp: SUM, MAX, ..), in
    place."""
    dist.all_reduce(tensor, op=op, group=group)


def summed(tensor: Tensor, group=None) -> Tensor:
    """`tensor` summed over the ranks of `group`, out of place (one all_reduce)."""
    total = tensor.clone()
    all_reduce_(total, group)
    return total


def reduce_scatter_into(out: Tensor, tensor: Tensor, group=None) -> None:
    """Rank r's `out` is the sum over the ranks of slice r of `tensor`."""
    dist.reduce_scatter_tensor(out, tensor, op=dist.ReduceOp.SUM, group=group)


def all_gather_into(out: Tensor, part: Tensor, group=None) -> None:
    """`out` is the ranks' `part`s in rank order; `part` may be rank r's slice of `out`
    (in place, as NCCL allows)."""
    dist.all_gather_into_tensor(out, part, group=group)
