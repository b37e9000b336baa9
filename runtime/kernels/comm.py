"""tp_copy, tp_all_reduce: the tensor-parallel pair (Megatron's f and g), spec §7.6.0.

tp_copy is the identity forward and an all-reduce (sum) of the gradient backward;
tp_all_reduce the other way round. The all-reduce is `torch.distributed.all_reduce` on
the tensor-parallel process group: the one given to `set_tp_group` (a DP x TP run makes
one group per TP slice), else the default group when its world size is the op's `size`.
The same code runs on CPU tensors under gloo and on CUDA tensors under NCCL.
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


def process_group(size: int, name: str = "tp"):
    """The process group of `size` ranks the ops of group `name` reduce over."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeUserError(f"this program is one rank's of {size} (tensor parallel): "
                               "run it in a torch.distributed process group",
                               help=["torchrun, or init_process_group() in each process"])
    group = _GROUPS.get(name)
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
