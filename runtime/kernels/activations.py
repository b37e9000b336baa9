"""swiglu, geglu, silu, relu, relu2, gelu, softmax (spec §6.3) and sigmoid (not in §6)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.kernels.base import register, sigmoid, silu, silu_grad

_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def gelu(x: Tensor, approximate: bool) -> Tensor:
    if approximate:
        return 0.5 * x * (1 + torch.tanh(_GELU_C * (x + _GELU_A * x ** 3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_grad(x: Tensor, approximate: bool) -> Tensor:
    if approximate:
        t = torch.tanh(_GELU_C * (x + _GELU_A * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_A * x * x)
    phi = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # standard normal density
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * phi


# --------------------------------------------------------------------------- swiglu
# The gated backwards also return y (= the forward's, the same ops in the same order), the
# recompute a backward that did not save y needs (std/primitives/swiglu.module)
def _swiglu_backward(d_y, gate, up, **_):
    act = silu(gate)
    return [d_y * up * silu_grad(gate), d_y * act, act * up]


@register("swiglu", ("gate", "up"), ("y",), ("d_y", "gate", "up"), ("d_gate", "d_up", "y"),
          backward=_swiglu_backward)
def _swiglu_forward(gate, up, **_):
    return [silu(gate) * up]


# ---------------------------------------------------------------------------- geglu
def _geglu_backward(d_y, gate, up, *, approximate=True, **_):
    act = gelu(gate, approximate)
    return [d_y * up * gelu_grad(gate, approximate), d_y * act, act * up]


@register("geglu", ("gate", "up"), ("y",), ("d_y", "gate", "up"), ("d_gate", "d_up", "y"),
          backward=_geglu_backward)
def _geglu_forward(gate, up, *, approximate=True, **_):
    return [gelu(gate, approximate) * up]


# ----------------------------------------------------------------------------- silu
@register("silu", ("x",), ("y",), ("d_y", "x"), ("d_x",),
          backward=lambda d_y, x, **_: [d_y * silu_grad(x)])
def _silu_forward(x, **_):
    return [silu(x)]


# ----------------------------------------------------------------------------- relu
@register("relu", ("x",), ("y",), ("d_y", "x"), ("d_x",),
          backward=lambda d_y, x, **_: [d_y * (x > 0).to(d_y.dtype)])
def _relu_forward(x, **_):
    return [torch.clamp_min(x, 0)]


# ---------------------------------------------------------------------------- relu2
@register("relu2", ("x",), ("y",), ("d_y", "x"), ("d_x",),
          backward=lambda d_y, x, **_: [d_y * 2 * torch.clamp_min(x, 0)])
def _relu2_forward(x, **_):
    r = torch.clamp_min(x, 0)
    return [r * r]


# ----------------------------------------------------------------------------- gelu
@register("gelu", ("x",), ("y",), ("d_y", "x"), ("d_x",),
          backward=lambda d_y, x, *, approximate=True, **_: [d_y * gelu_grad(x, approximate)])
def _gelu_forward(x, *, approximate=True, **_):
    return [gelu(x, approximate)]


# -------------------------------------------------------------------------- sigmoid
@register("sigmoid", ("x",), ("y",), ("d_y", "y"), ("d_x",),
          backward=lambda d_y, y, **_: [d_y * (y - y * y)])
def _sigmoid_forward(x, **_):
    return [sigmoid(x)]


# -------------------------------------------------------------------------- softmax
def softmax(x: Tensor, dim: int) -> Tensor:
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


@register("softmax", ("x",), ("y",), ("d_y", "y"), ("d_x",),
          backward=lambda d_y, y, *, dim=-1, **_: [y * (d_y - (d_y * y).sum(dim, keepdim=True))])
def _softmax_forward(x, *, dim=-1, **_):
    return [softmax(x, dim)]
