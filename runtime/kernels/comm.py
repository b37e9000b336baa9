"""tp_copy, tp_all_reduce: the tensor-parallel pair (Megatron's f and g), spec §7.6.0;
sp_all_gather, sp_reduce_scatter, sp_scatter, sp_gather: sequence parallel's (`--sp`).

tp_copy is the identity forward and an all-reduce (sum) of the gradient backward;
tp_all_reduce the other way round. The all-reduce is `torch.distributed.all_reduce` on
the tensor-parallel process group: the one given to `set_tp_group` (a DP x TP run makes
one group per TP slice), else the default group when its world size is the op's `size`.
The same code runs on CPU tensors under gloo and on CUDA tensors under NCCL.

Under sequence parallel a tensor's rows (its dims up to and including `dim`, the
sequence, flattened: the B x T tokens of a [B, T, ...] tensor) are split into `size`
equal contiguous blocks, rank r (of the group) holding block r as a tensor shaped like x
with dim `dim` divided by `size`. With B = 1 that is the sequence's block r; with B > 1
a rank's [B, T / M, ...] rows are tokens r B T / M .. (r + 1) B T / M - 1 of the batch,
not positions r T / M .. of each sequence: the ops between the regions are row-wise, so
which tokens a rank holds does not matter as long as every split and join agrees (the
`sequence_parallel` pass sends an op whose other operand varies along B or T through
sp_gather). sp_all_gather joins the blocks (its gradient reduce-scattered),
sp_reduce_scatter sums over the ranks and keeps this rank's block (its gradient
all-gathered); sp_scatter keeps this rank's block of a replicated tensor (its gradient
all-gathered) and sp_gather joins blocks for replicated compute (its gradient: this
rank's block). Because each block is contiguous, the gather is one
all_gather_into_tensor straight into the result and the reduce-scatter one
reduce_scatter_tensor straight from x (NCCL and gloo alike): no copy on either side.
"""

from __future__ import annotations

import torch

from runtime.errors import RuntimeUserError
from runtime.kernels.base import register

_GROUPS: dict[str, object] = {}  # group name ("tp") -> torch.distributed ProcessGroup


def set_tp_group(group, name: str = "tp") -> None:
    """Use `group` for the ops of group `name` (None: back to the default group)."""
    if group is None:
        _GROUPS.pop(name, None)
    else:
        _GROUPS[name] = group


def group_named(name: str = "tp"):
    """The process group the ops of group `name` use: `set_tp_group`'s, else None (the
    default group)."""
    return _GROUPS.get(name)


def process_group(size: int, name: str = "tp"):
    """The process group of `size` ranks the ops of group `name` reduce over."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeUserError(f"this program is one rank's of {size} (tensor parallel): "
                               "run it in a torch.distributed process group",
                               help=["torchrun, or init_process_group() in each process"])
    group = group_named(name)
    got = dist.get_world_size(group)
    if got != size:
        raise RuntimeUserError(f"the `{name}` process group has {got} ranks, the program "
                               f"was built for tensor parallel size {size}",
                               help=["pass the tensor-parallel group to "
                                     "runtime.kernels.comm.set_tp_group"])
    return group


def all_reduce(x: torch.Tensor, size: int, group: str = "tp") -> torch.Tensor:
    """The sum of x over the group, in a new tensor (x is left as it is); one rank's sum
    is x itself, with or without a process group."""
    import torch.distributed as dist

    y = x.contiguous().clone()
    if size > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=process_group(size, group))
    return y


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()  # a fresh value, as every other kernel returns


@register("tp_copy", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=lambda d_y, *, size, group="tp", **_: [all_reduce(d_y, size, group)])
def _tp_copy_forward(x, *, size, group="tp", **_):
    return [_identity(x)]


@register("tp_all_reduce", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=lambda d_y, **_: [_identity(d_y)])
def _tp_all_reduce_forward(x, *, size, group="tp", **_):
    return [all_reduce(x, size, group)]


def group_rank(size: int, group: str = "tp") -> int:
    """This process's rank in the group (0 for one rank)."""
    import torch.distributed as dist

    return dist.get_rank(process_group(size, group)) if size > 1 else 0


def local_shape(shape, size: int, dim: int = 1) -> tuple:
    """A tensor's shape with dim `dim` divided by `size` (a rank's block)."""
    return tuple(shape[:dim]) + (shape[dim] // size,) + tuple(shape[dim + 1:])


def _stacked(x: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Contiguous x (whole) as `size` blocks stacked along dim 0, block r rank r's rows
    (gloo wants a gather's output and a reduce-scatter's input so)."""
    block = local_shape(x.shape, size, dim)
    return x.view((size * block[0],) + block[1:])


def split_rank(x: torch.Tensor, size: int, dim: int = 1, group: str = "tp") -> torch.Tensor:
    """This rank's block of x's rows (a copy, never a view of x)."""
    x = x.contiguous()
    block = x.numel() // size
    return x.view(-1).narrow(0, group_rank(size, group) * block, block).clone().view(
        local_shape(x.shape, size, dim))


def all_gather(x: torch.Tensor, size: int, dim: int = 1, group: str = "tp") -> torch.Tensor:
    """Every rank's rows joined in rank order, gathered straight into the result."""
    from runtime.dist.collectives import all_gather_into

    if size == 1:
        return x.contiguous().clone()
    x = x.contiguous()
    whole = x.shape[:dim] + (size * x.shape[dim],) + x.shape[dim + 1:]
    out = torch.empty(whole, dtype=x.dtype, device=x.device)
    all_gather_into(_stacked(out, size, dim), x, group=process_group(size, group))
    return out


def reduce_scatter(x: torch.Tensor, size: int, dim: int = 1, group: str = "tp") -> torch.Tensor:
    """This rank's block of the rows of the sum of x over the group, reduce-scattered
    straight from x into the result."""
    from runtime.dist.collectives import reduce_scatter_into

    if size == 1:
        return x.contiguous().clone()
    handle = process_group(size, group)
    x = x.contiguous()
    out = torch.empty(local_shape(x.shape, size, dim), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, _stacked(x, size, dim), group=handle)
    return out


def _comm(forward, backward):
    """A collective's kernel pair over (x, size, dim, group)."""
    def run(fn):
        return lambda t, *, size, dim=1, group="tp", **_: [fn(t, size, dim, group)]
    return run(forward), run(backward)


for _name, (_forward, _backward) in {
        "sp_all_gather": _comm(all_gather, reduce_scatter),
        "sp_reduce_scatter": _comm(reduce_scatter, all_gather),
        "sp_scatter": _comm(split_rank, all_gather),
        "sp_gather": _comm(all_gather, split_rank)}.items():
    register(_name, ("x",), ("y",), ("d_y",), ("d_x",), backward=_backward)(_forward)
