"""`ReferenceKernel`, the registry, and the dtype policy shared by every family.

Calling convention (both phases): `inputs` is a list in the order of the signature's
`in:` names, an absent optional input is None and a tensor-list entry (`xs: [n] x [*]`)
is a Python list of tensors; the result is a list in the order of the `out:` names, a
tensor list again being a list, and a backward output that is not computed (the gradient
of an absent optional input) None. `attrs` holds the primitive's params by name, defaults
filled in (`default_attrs`): ints, floats, bools, None, enum members and dtypes as strings
("NT", "silu", "bf16"), int lists as lists. A backward may also read
`attrs["input_shapes"]`, the shapes of the forward inputs by name (a list of shapes for a
tensor list, None for an absent input): the metadata the runtime records at forward
(decisions.md, "`save:` lists exactly what the backward reads"). view, concat,
reduce_sum, reduce_mean, reduce_max, embedding and moe_permute need it; add (broadcast
dims), layernorm (whether there was a bias) and split (a part without gradient) read it
when it is there.

Dtypes: the I/O dtype is that of the first floating input that is not a statistic. Every
floating input is cast to the compute dtype (the I/O dtype for float64 and float32,
float32 for bfloat16 and float16), the math runs there, and floating outputs are cast back
to the I/O dtype (a gradient `d_<x>` whose input x is also a backward input: to x's
dtype), except the statistics (`stats`: rstd, mean, lse, the per-token loss, the
aux loss), which stay in the compute dtype: fp32 for 32- and 16-bit inputs as the
signatures say, float64 under float64 inputs so that float64 runs are exact end to end.
Integer tensors pass through; integer outputs (indices, offsets) are int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

KERNELS: dict[str, "ReferenceKernel"] = {}

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ReferenceKernel:
    name: str
    forward_inputs: tuple[str, ...]
    forward_outputs: tuple[str, ...]
    backward_inputs: tuple[str, ...]
    backward_outputs: tuple[str, ...]
    forward_fn: Callable
    backward_fn: Callable | None = None
    stats: frozenset[str] = frozenset()  # floating tensors kept in the compute dtype
    converts: bool = False  # its outputs' dtypes are its business (cast): none cast back
    random: bool = False  # draws random numbers: the runtime gives it attrs["seed"]

    def forward(self, inputs: list, attrs: dict) -> list:
        return _call(self, self.forward_fn, self.forward_inputs, self.forward_outputs, inputs, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        if self.backward_fn is None:
            if inputs:
                raise ValueError(f"{self.name} has no backward")
            return []
        return _call(self, self.backward_fn, self.backward_inputs, self.backward_outputs, inputs, attrs)


def register(name: str, forward_inputs, forward_outputs, backward_inputs=(), backward_outputs=(),
             *, backward: Callable | None = None, stats=(), converts: bool = False,
             random: bool = False):
    """Register `forward` (the decorated function) and `backward` under `name`. Both are
    called as fn(*inputs, **attrs), inputs already in the compute dtype."""
    def wrap(forward: Callable) -> Callable:
        KERNELS[name] = ReferenceKernel(name, tuple(forward_inputs), tuple(forward_outputs),
                                        tuple(backward_inputs), tuple(backward_outputs),
                                        forward, backward, frozenset(stats), converts,
                                        random)
        return forward
    return wrap


def _call(kernel: ReferenceKernel, fn, in_names, out_names, inputs, attrs) -> list:
    if len(inputs) != len(in_names):
        raise ValueError(f"{kernel.name}: {len(inputs)} inputs given, signature has "
                         f"{len(in_names)} ({', '.join(in_names)})")
    if kernel.converts:
        return list(fn(*inputs, **attrs))
    io = io_dtype(inputs, in_names, kernel.stats)
    compute = compute_dtype(io) if io is not None else None
    args = [_cast(x, compute) for x in inputs]
    outputs = list(fn(*args, **attrs))
    if len(outputs) != len(out_names):
        raise ValueError(f"{kernel.name}: {len(outputs)} outputs, signature has {len(out_names)}")
    if io is None:
        return outputs
    # a gradient d_<x> whose input x is at hand gets x's dtype (fp32 master weights, say)
    own = {f"d_{n}": x.dtype for n, x in zip(in_names, inputs)
           if isinstance(x, Tensor) and x.is_floating_point() and n not in kernel.stats}
    return [_cast(y, compute if name in kernel.stats else own.get(name, io))
            for name, y in zip(out_names, outputs)]


def io_dtype(inputs, names, stats) -> torch.dtype | None:
    for name, x in zip(names, inputs):
        if name in stats:
            continue
        for t in x if isinstance(x, (list, tuple)) else [x]:
            if isinstance(t, Tensor) and t.is_floating_point():
                return t.dtype
    return None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _cast(x, dtype):
    if isinstance(x, (list, tuple)):
        return [_cast(t, dtype) for t in x]
    if dtype is not None and isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


# ---------------------------------------------------------------- helpers for the families
def sum_to_shape(g: Tensor, shape) -> Tensor:
    """Sum a broadcast gradient back to `shape` (NumPy broadcasting, aligned from the end)."""
    shape = tuple(shape)
    extra = g.dim() - len(shape)
    if extra:
        g = g.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(dim=dims, keepdim=True) if dims else g


def input_shape(attrs: dict, primitive: str, name: str):
    """The recorded shape of forward input `name` (see the module docstring)."""
    shapes = attrs.get("input_shapes") or {}
    if name not in shapes:
        raise KeyError(f"{primitive} backward needs attrs['input_shapes'][{name!r}] "
                       f"(the forward input's shape, recorded at forward)")
    return shapes[name]


def sigmoid(x: Tensor) -> Tensor:
    return 1 / (1 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def silu_grad(x: Tensor) -> Tensor:
    """silu'(x) = sigmoid(x) + silu(x) * sigmoid(-x)."""
    return sigmoid(x) + silu(x) * sigmoid(-x)


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)), stable for large |x| (no threshold: its derivative is sigmoid)."""
    return torch.logaddexp(x, torch.zeros_like(x))
