"""add, mul, scale, add3 (spec §6.6) and neg, exp, exp_neg, dropout (not in §6).

add and mul broadcast NumPy-style; a gradient is summed over the dims its input was
broadcast along. add's backward reads only d_y, so it needs the recorded input shapes
(attrs["input_shapes"]); without them it assumes no broadcasting.
"""

from __future__ import annotations

import torch

from runtime.kernels.base import register, sum_to_shape


def _add_backward(d_y, **attrs):
    shapes = attrs.get("input_shapes") or {}
    return [sum_to_shape(d_y, shapes.get("a", d_y.shape)), sum_to_shape(d_y, shapes.get("b", d_y.shape))]


@register("add", ("a", "b"), ("y",), ("d_y",), ("d_a", "d_b"), backward=_add_backward)
def _add_forward(a, b, **_):
    return [a + b]


@register("mul", ("a", "b"), ("y",), ("d_y", "a", "b"), ("d_a", "d_b"),
          backward=lambda d_y, a, b, **_: [sum_to_shape(d_y * b, a.shape),
                                           sum_to_shape(d_y * a, b.shape)])
def _mul_forward(a, b, **_):
    return [a * b]


@register("scale", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=lambda d_y, *, factor, **_: [d_y * factor])
def _scale_forward(x, *, factor, **_):
    return [x * factor]


@register("add3", ("a", "b", "c"), ("y",), ("d_y",), ("d_a", "d_b", "d_c"),
          backward=lambda d_y, **_: [d_y, d_y, d_y])
def _add3_forward(a, b, c, **_):
    return [a + b + c]


@register("neg", ("x",), ("y",), ("d_y",), ("d_x",), backward=lambda d_y, **_: [-d_y])
def _neg_forward(x, **_):
    return [-x]


@register("exp", ("x",), ("y",), ("d_y", "y"), ("d_x",), backward=lambda d_y, y, **_: [d_y * y])
def _exp_forward(x, **_):
    return [torch.exp(x)]


# y = -exp(x): dy/dx = -exp(x) = y
@register("exp_neg", ("x",), ("y",), ("d_y", "y"), ("d_x",), backward=lambda d_y, y, **_: [d_y * y])
def _exp_neg_forward(x, **_):
    return [-torch.exp(x)]


# dropout: random, so the runtime gives it attrs["seed"] (None: no dropout, inference)
def _dropout_forward(x, *, p, seed=None, **_):
    if seed is None or p == 0:
        return [x, torch.ones_like(x)]
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= p
    mask = keep.to(x.dtype) / (1 - p)
    return [x * mask, mask]


register("dropout", ("x",), ("y", "mask"), ("d_y", "mask"), ("d_x",),
         backward=lambda d_y, mask, **_: [d_y * mask], random=True)(_dropout_forward)
