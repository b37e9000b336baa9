"""reduce_sum, reduce_mean, reduce_max (spec §6.7).

`dims` lists the reduced dims (negative from the end); an empty list reduces nothing (as
the checker's shape rule), all of them give a 0-d tensor. The backwards broadcast d_y back
to x's shape, which they read from attrs["input_shapes"]["x"] (recorded at forward).
reduce_max's indices point at the first maximum (int32).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.kernels.base import input_shape, register


def _axes(dims, rank: int) -> list[int]:
    return sorted({d % rank for d in dims}) if rank else []


def _broadcast_back(d_y: Tensor, shape, axes: list[int], keepdim: bool) -> Tensor:
    if not keepdim:
        for a in axes:
            d_y = d_y.unsqueeze(a)
    return d_y.expand(*shape)


# --------------------------------------------------------------------------- reduce_sum
def _reduce_sum_backward(d_y, *, dims, keepdim=False, **attrs):
    shape = input_shape(attrs, "reduce_sum", "x")
    return [_broadcast_back(d_y, shape, _axes(dims, len(shape)), keepdim).clone()]


@register("reduce_sum", ("x",), ("y",), ("d_y",), ("d_x",), backward=_reduce_sum_backward)
def _reduce_sum_forward(x, *, dims, keepdim=False, **_):
    axes = _axes(dims, x.dim())
    return [x.sum(dim=axes, keepdim=keepdim) if axes else x.clone()]


# -------------------------------------------------------------------------- reduce_mean
def _reduce_mean_backward(d_y, *, dims, keepdim=False, **attrs):
    shape = input_shape(attrs, "reduce_mean", "x")
    axes = _axes(dims, len(shape))
    count = math.prod(shape[a] for a in axes)
    return [_broadcast_back(d_y, shape, axes, keepdim) / count]


@register("reduce_mean", ("x",), ("y",), ("d_y",), ("d_x",), backward=_reduce_mean_backward)
def _reduce_mean_forward(x, *, dims, keepdim=False, **_):
    axes = _axes(dims, x.dim())
    count = math.prod(x.shape[a] for a in axes)
    return [x.sum(dim=axes, keepdim=keepdim) / count if axes else x.clone()]


# --------------------------------------------------------------------------- reduce_max
def _reduce_max_backward(d_values, indices, *, dim, keepdim=False, **attrs):
    shape = input_shape(attrs, "reduce_max", "x")
    axis = dim % len(shape)
    index = indices.long()
    if not keepdim:
        d_values, index = d_values.unsqueeze(axis), index.unsqueeze(axis)
    d_x = torch.zeros(shape, dtype=d_values.dtype, device=d_values.device)
    return [d_x.scatter(axis, index, d_values)]


@register("reduce_max", ("x",), ("values", "indices"), ("d_values", "indices"), ("d_x",),
          backward=_reduce_max_backward)
def _reduce_max_forward(x, *, dim, keepdim=False, **_):
    indices = torch.argmax(x, dim=dim, keepdim=True)  # the first maximum
    values = torch.gather(x, dim, indices)
    if not keepdim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    return [values, indices.to(torch.int32)]
