"""flash_attention, rope, qk_norm (spec §6.4, decisions.md "Per-primitive fixes"), and
qk_norm_rope, the two in one op (decisions.md "Fused QK-norm + RoPE").

flash_attention is exact softmax attention that materializes the [T, T] scores (the
reference, not the tiled kernel): S = scale * q . k + alibi[h] * (j - i), masked to -inf
where j > i (causal) or j <= i - window_size (the last window_size keys, the query's own
included), and in a packed batch where i and j lie in different documents
(runtime/kernels/documents.py); P = softmax(S); out = P @ v; lse = logsumexp(S). GQA: query head h reads kv
head h // (Hq / Hkv). The backward recomputes P = exp(S - lse) from the saved lse and
uses D = rowsum(d_out * out), as FlashAttention-2 does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.kernels.base import register
from runtime.kernels.documents import cross_document, positions as packed_positions
from runtime.kernels.norms import rms_backward, rms_forward
from runtime.kernels.rope_freq import device_frequencies


# ---------------------------------------------------------------------- flash_attention
def _scores(q, k, alibi_slopes, causal, softmax_scale, window_size):
    """Masked scores S [B, Hq, T, T], k already expanded to Hq heads; and the scale. In
    a packed batch (runtime/kernels/documents.py) pairs of two documents are masked too."""
    T, D = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(D) if softmax_scale is None else softmax_scale
    S = scale * (q @ k.transpose(-1, -2))
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    if alibi_slopes is not None:
        S = S + alibi_slopes[None, :, None, None] * (j - i).to(S.dtype)
    masked = torch.zeros(T, T, dtype=torch.bool, device=q.device)
    if causal:
        masked |= j > i
    if window_size is not None:
        masked |= j <= i - window_size
    apart = cross_document(q.shape[0], T)
    if apart is not None:
        masked = masked | apart
    return S.masked_fill(masked, float("-inf")), scale


def _expand_kv(t: Tensor, hq: int) -> Tensor:
    hkv = t.shape[1]
    if hq % hkv:
        raise ValueError(f"flash_attention: Hq={hq} is not a multiple of Hkv={hkv}")
    return t.repeat_interleave(hq // hkv, dim=1)


def _reduce_kv(t: Tensor, hkv: int) -> Tensor:
    """Sum the gradients of the query heads that share a kv head."""
    B, hq, T, D = t.shape
    return t.reshape(B, hkv, hq // hkv, T, D).sum(2)


def _flash_attention_backward(d_out, q, k, v, out, lse, alibi_slopes=None, *, causal=True,
                              softmax_scale=None, window_size=None, **_):
    hq, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, hq), _expand_kv(v, hq)
    S, scale = _scores(q, ke, alibi_slopes, causal, softmax_scale, window_size)
    P = torch.exp(S - lse[..., None])
    d_ve = P.transpose(-1, -2) @ d_out
    dP = d_out @ ve.transpose(-1, -2)
    Drow = (d_out * out).sum(-1, keepdim=True)
    dS = P * (dP - Drow)
    d_q = scale * (dS @ ke)
    d_ke = scale * (dS.transpose(-1, -2) @ q)
    return [d_q, _reduce_kv(d_ke, hkv), _reduce_kv(d_ve, hkv)]


@register("flash_attention", ("q", "k", "v", "alibi_slopes"), ("out", "lse"),
          ("d_out", "q", "k", "v", "out", "lse", "alibi_slopes"), ("d_q", "d_k", "d_v"),
          backward=_flash_attention_backward, stats=("lse", "alibi_slopes"))
def _flash_attention_forward(q, k, v, alibi_slopes=None, *, causal=True, softmax_scale=None,
                             window_size=None, **_):
    hq = q.shape[1]
    S, _ = _scores(q, _expand_kv(k, hq), alibi_slopes, causal, softmax_scale, window_size)
    m = S.amax(-1, keepdim=True)
    e = torch.exp(S - m)
    l = e.sum(-1, keepdim=True)
    out = (e / l) @ _expand_kv(v, hq)
    lse = (m + torch.log(l)).squeeze(-1)
    # laid out [B, T, H, D] in memory, as the GPU kernels write it (modulec.plan.layouts)
    return [out.transpose(1, 2).contiguous().transpose(1, 2), lse]


# --------------------------------------------------------------------------------- rope
def rope_tables(position_ids, T: int, D: int, attrs: dict, dtype, device):
    """cos, sin [B or 1, 1, T, R] (R = the rotated channels, runtime/kernels/rope_freq.py),
    attention_scaling applied: angle = pos * inv_freq, each frequency on its pair's two
    channels (rotate-half: the list twice; interleaved: each value twice in a row)."""
    inv_freq, scaling = device_frequencies(attrs, D, T, position_ids, device)
    if position_ids is None:
        pos = torch.arange(T, device=device, dtype=dtype)[None, :]
    else:
        pos = position_ids.to(dtype)
    angle = pos[..., None] * inv_freq.to(dtype)           # [B, T, n]
    if attrs.get("interleaved"):
        angle = angle.repeat_interleave(2, dim=-1)
    else:
        angle = torch.cat([angle, angle], dim=-1)        # [B, T, 2n]
    return (torch.cos(angle) * scaling)[:, None], (torch.sin(angle) * scaling)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotate_every_two(x: Tensor) -> Tensor:
    """GPT-J's pairs (2i, 2i + 1): (x0, x1, ..) -> (-x1, x0, ..)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x's first R channels rotated (x * cos + pair_swap(x) * sin), the rest as they are."""
    R = cos.shape[-1]
    xr = x[..., :R]
    turned = rotate_every_two(xr) if interleaved else rotate_half(xr)
    y = xr * cos + turned * sin
    return y if R == x.shape[-1] else torch.cat([y, x[..., R:]], dim=-1)


def _rope_apply(q, k, position_ids, attrs: dict, inverse: bool):
    """position_ids None in a packed batch: its positions, restarting per document."""
    T, D = q.shape[-2:]
    position_ids = packed_positions(position_ids, q.shape[0], T)
    cos, sin = rope_tables(position_ids, T, D, attrs, q.dtype, q.device)
    if inverse:  # the backward: the transposed rotation, scaled alike
        sin = -sin
    inter = bool(attrs.get("interleaved"))
    return [_rotate(q, cos, sin, inter), _rotate(k, cos, sin, inter)]


def _rope_backward(d_q_rot, d_k_rot, position_ids=None, **attrs):
    return _rope_apply(d_q_rot, d_k_rot, position_ids, attrs, True)


@register("rope", ("q", "k", "position_ids"), ("q_rot", "k_rot"),
          ("d_q_rot", "d_k_rot", "position_ids"), ("d_q", "d_k"), backward=_rope_backward)
def _rope_forward(q, k, position_ids=None, **attrs):
    return _rope_apply(q, k, position_ids, attrs, False)


# ------------------------------------------------------------------------------ qk_norm
def _qk_norm_backward(d_q_norm, d_k_norm, q, k, q_weight, k_weight, q_rstd, k_rstd, **_):
    d_q, d_q_weight = rms_backward(d_q_norm, q, q_weight, q_rstd)
    d_k, d_k_weight = rms_backward(d_k_norm, k, k_weight, k_rstd)
    return [d_q, d_k, d_q_weight, d_k_weight]


@register("qk_norm", ("q", "k", "q_weight", "k_weight"), ("q_norm", "k_norm", "q_rstd", "k_rstd"),
          ("d_q_norm", "d_k_norm", "q", "k", "q_weight", "k_weight", "q_rstd", "k_rstd"),
          ("d_q", "d_k", "d_q_weight", "d_k_weight"),
          backward=_qk_norm_backward, stats=("q_rstd", "k_rstd"))
def _qk_norm_forward(q, k, q_weight, k_weight, *, eps=1e-6, **_):
    q_norm, q_rstd = rms_forward(q, q_weight, eps)
    k_norm, k_rstd = rms_forward(k, k_weight, eps)
    return [q_norm, k_norm, q_rstd, k_rstd]


# ------------------------------------------------------------------------- qk_norm_rope
# qk_norm then rope with the normalized q, k kept in the compute dtype between them (the
# fused kernel does not round them to the I/O dtype either); the backward undoes the
# rotation, then runs rmsnorm's backward
def _qk_norm_rope_backward(d_q_rot, d_k_rot, q, k, q_weight, k_weight, q_rstd, k_rstd,
                           position_ids=None, **attrs):
    d_q_n, d_k_n = _rope_apply(d_q_rot, d_k_rot, position_ids, attrs, True)
    return _qk_norm_backward(d_q_n, d_k_n, q, k, q_weight, k_weight, q_rstd, k_rstd)


@register("qk_norm_rope", ("q", "k", "q_weight", "k_weight", "position_ids"),
          ("q_rot", "k_rot", "q_rstd", "k_rstd"),
          ("d_q_rot", "d_k_rot", "q", "k", "q_weight", "k_weight", "q_rstd", "k_rstd",
           "position_ids"),
          ("d_q", "d_k", "d_q_weight", "d_k_weight"),
          backward=_qk_norm_rope_backward, stats=("q_rstd", "k_rstd"))
def _qk_norm_rope_forward(q, k, q_weight, k_weight, position_ids=None, *, eps=1e-6,
                          **attrs):
    q_n, k_n, q_rstd, k_rstd = _qk_norm_forward(q, k, q_weight, k_weight, eps=eps)
    q_rot, k_rot = _rope_apply(q_n, k_n, position_ids, attrs, False)
    return [q_rot, k_rot, q_rstd, k_rstd]
