"""rmsnorm, fused_residual_rmsnorm, layernorm, fused_residual_layernorm, group_rmsnorm
(spec §6.2; fused_residual_layernorm is fused_residual_rmsnorm's LayerNorm twin and
group_rmsnorm Mamba-2's gated norm, decisions.md "Primitives not in spec §6"). qk_norm
(§6.4.3) is in attention.py and uses the rmsnorm helpers here.

All normalize the last dim. With n = x * rstd and g = d_y * weight, RMSNorm's backward is
d_x = rstd * (g - n * mean(g * n)), d_weight = sum over rows of d_y * n. rmsnorm and
fused_residual_rmsnorm scale by offset + weight (`offset`, 0 by default; Gemma's `1 + w` is
offset 1): the sum is taken in the compute dtype (fp32 for bf16 weights), g uses it, and
d_weight is unchanged (d(offset + w)/dw = 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.base import register, silu, silu_grad


def _scale(weight: Tensor, offset) -> Tensor:
    return weight + float(offset) if offset else weight


def rms_forward(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0
                ) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt((x * x).mean(-1) + eps)
    return x * rstd[..., None] * _scale(weight, offset), rstd


def rms_backward(d_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float = 0.0
                 ) -> tuple[Tensor, Tensor]:
    n = x * rstd[..., None]
    g = d_y * _scale(weight, offset)
    d_x = rstd[..., None] * (g - n * (g * n).mean(-1, keepdim=True))
    d_weight = (d_y * n).reshape(-1, x.shape[-1]).sum(0)
    return d_x, d_weight


# ------------------------------------------------------------------------------ rmsnorm
def _rmsnorm_backward(d_y, x, weight, rstd, *, offset=0.0, **_):
    return list(rms_backward(d_y, x, weight, rstd, offset))


@register("rmsnorm", ("x", "weight"), ("y", "rstd"), ("d_y", "x", "weight", "rstd"),
          ("d_x", "d_weight"), backward=_rmsnorm_backward, stats=("rstd",))
def _rmsnorm_forward(x, weight, *, eps=1e-6, offset=0.0, **_):
    return list(rms_forward(x, weight, eps, offset))


# ----------------------------------------------------------------- fused_residual_rmsnorm
def _fused_residual_rmsnorm_backward(d_residual_out, d_y, residual_out, weight, rstd, *,
                                     offset=0.0, **_):
    d_norm, d_weight = rms_backward(d_y, residual_out, weight, rstd, offset)
    g = d_residual_out + d_norm
    return [g, g, d_weight]  # d_residual and d_input are one tensor


@register("fused_residual_rmsnorm", ("residual", "input", "weight"), ("residual_out", "y", "rstd"),
          ("d_residual_out", "d_y", "residual_out", "weight", "rstd"),
          ("d_residual", "d_input", "d_weight"),
          backward=_fused_residual_rmsnorm_backward, stats=("rstd",))
def _fused_residual_rmsnorm_forward(residual, input, weight, *, eps=1e-6, offset=0.0, **_):
    residual_out = residual + input
    y, rstd = rms_forward(residual_out, weight, eps, offset)
    return [residual_out, y, rstd]


# ---------------------------------------------------------------------------- layernorm
def ln_forward(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float
               ) -> tuple[Tensor, Tensor, Tensor]:
    mean = x.mean(-1)
    centred = x - mean[..., None]
    rstd = torch.rsqrt((centred * centred).mean(-1) + eps)  # biased variance
    y = centred * rstd[..., None] * weight
    return (y + bias if bias is not None else y), mean, rstd


def ln_backward(d_y, x, weight, mean, rstd, attrs) -> list:
    """(d_x, d_weight, d_bias); bias is no backward input: d_bias is computed unless the
    recorded shapes say it was None."""
    n = (x - mean[..., None]) * rstd[..., None]
    g = d_y * weight
    d_x = rstd[..., None] * (g - g.mean(-1, keepdim=True) - n * (g * n).mean(-1, keepdim=True))
    d_weight = (d_y * n).reshape(-1, x.shape[-1]).sum(0)
    shapes = attrs.get("input_shapes") or {}
    no_bias = "bias" in shapes and shapes["bias"] is None
    return [d_x, d_weight, None if no_bias else d_y.reshape(-1, x.shape[-1]).sum(0)]


@register("layernorm", ("x", "weight", "bias"), ("y", "mean", "rstd"),
          ("d_y", "x", "weight", "mean", "rstd"), ("d_x", "d_weight", "d_bias"),
          backward=lambda d_y, x, weight, mean, rstd, **attrs: ln_backward(
              d_y, x, weight, mean, rstd, attrs),
          stats=("mean", "rstd"))
def _layernorm_forward(x, weight, bias=None, *, eps=1e-5, **_):
    return list(ln_forward(x, weight, bias, eps))


# --------------------------------------------------------------- fused_residual_layernorm
def _fused_residual_layernorm_backward(d_residual_out, d_y, residual_out, weight, mean, rstd,
                                       **attrs):
    d_norm, d_weight, d_bias = ln_backward(d_y, residual_out, weight, mean, rstd, attrs)
    g = d_residual_out + d_norm
    return [g, g, d_weight, d_bias]  # d_residual and d_input are one tensor


@register("fused_residual_layernorm", ("residual", "input", "weight", "bias"),
          ("residual_out", "y", "mean", "rstd"),
          ("d_residual_out", "d_y", "residual_out", "weight", "mean", "rstd"),
          ("d_residual", "d_input", "d_weight", "d_bias"),
          backward=_fused_residual_layernorm_backward, stats=("mean", "rstd"))
def _fused_residual_layernorm_forward(residual, input, weight, bias=None, *, eps=1e-5, **_):
    residual_out = residual + input
    return [residual_out, *ln_forward(residual_out, weight, bias, eps)]


# ------------------------------------------------------------------------ group_rmsnorm
def _grouped(t: Tensor, groups: int) -> Tensor:
    return t.reshape(*t.shape[:-1], groups, t.shape[-1] // groups)


def _group_rmsnorm_backward(d_y, x, weight, gate, rstd, *, groups=1, **_):
    h = x * silu(gate) if gate is not None else x
    n = _grouped(h, groups) * rstd[..., None]
    g = _grouped(d_y * weight, groups)
    d_h = (rstd[..., None] * (g - n * (g * n).mean(-1, keepdim=True))).reshape(x.shape)
    d_weight = (d_y * n.reshape(x.shape)).reshape(-1, x.shape[-1]).sum(0)
    if gate is None:
        return [d_h, d_weight, None]
    # the gate as swiglu with up = x
    return [d_h * silu(gate), d_weight, d_h * x * silu_grad(gate)]


@register("group_rmsnorm", ("x", "weight", "gate"), ("y", "rstd"),
          ("d_y", "x", "weight", "gate", "rstd"), ("d_x", "d_weight", "d_gate"),
          backward=_group_rmsnorm_backward, stats=("rstd",))
def _group_rmsnorm_forward(x, weight, gate=None, *, groups=1, eps=1e-5, **_):
    if x.shape[-1] % groups:
        raise ValueError(f"group_rmsnorm: C={x.shape[-1]} is not a multiple of groups={groups}")
    h = x * silu(gate) if gate is not None else x
    hg = _grouped(h, groups)
    rstd = torch.rsqrt((hg * hg).mean(-1) + eps)  # [*, groups]
    y = (hg * rstd[..., None]).reshape(x.shape) * weight
    return [y, rstd]
