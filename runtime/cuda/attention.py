"""flash_attention on the GPU through torch's FlashAttention-2 aten ops
(`aten::_flash_attention_forward` / `_flash_attention_backward`), never materializing the
[T, T] scores.

Layouts: our primitive takes q [B, Hq, T, D], k, v [B, Hkv, T, D] and returns out
[B, Hq, T, D] and lse [B, Hq, T] (fp32, natural log). The aten ops take [B, T, H, D] with
the last dim contiguous: a transpose view of ours (the attention module's q, k, v are
already transposes of the fused QKV projection, so no copy happens). GQA is native (the
kernel reads kv head h // (Hq / Hkv); d_k, d_v come back with Hkv heads). Causal and the
sliding window map to the kernel's window: our window keeps keys i - window_size < j <= i,
that is window_size_left = window_size - 1, window_size_right = 0.

Calls the kernel does not cover go to the reference kernel: tensors not on CUDA, dtypes
other than bf16/fp16 (fp32 runs are exact references), ALiBi slopes, non-causal with a
window, head dims over 256 or not a multiple of 8.
"""

from __future__ import annotations

import math

import torch

from runtime.kernels import KERNELS

REFERENCE = KERNELS["flash_attention"]
FLASH_DTYPES = (torch.bfloat16, torch.float16)


def covers(q, k, v, alibi_slopes, attrs) -> bool:
    tensors = (q, k, v)
    if alibi_slopes is not None or not all(isinstance(t, torch.Tensor) and t.is_cuda
                                           for t in tensors):
        return False
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in FLASH_DTYPES:
        return False
    D = q.shape[-1]
    if D % 8 or D > 256 or q.shape[1] % k.shape[1]:
        return False
    return bool(attrs.get("causal", True)) or attrs.get("window_size") is None


def _window(attrs) -> dict:
    window = attrs.get("window_size")
    if window is None:
        return {}
    return {"window_size_left": int(window) - 1, "window_size_right": 0}


def _scale(q, attrs) -> float:
    scale = attrs.get("softmax_scale")
    return 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _bthd(t: torch.Tensor) -> torch.Tensor:
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(q, k, v, attrs):
    T, S = q.shape[2], k.shape[2]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _bthd(q), _bthd(k), _bthd(v), None, None, T, S, 0.0,
        bool(attrs.get("causal", True)), False, scale=_scale(q, attrs), **_window(attrs))
    return [out.transpose(1, 2), lse]


def flash_backward(d_out, q, k, v, out, lse, attrs):
    T, S = q.shape[2], k.shape[2]
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    d_q, d_k, d_v = torch.ops.aten._flash_attention_backward(
        _bthd(d_out.to(q.dtype)), _bthd(q), _bthd(k), _bthd(v), _bthd(out), lse.contiguous(),
        None, None, T, S, 0.0, bool(attrs.get("causal", True)), empty, empty,
        scale=_scale(q, attrs), **_window(attrs))
    return [d_q.transpose(1, 2), d_k.transpose(1, 2), d_v.transpose(1, 2)]


class FlashAttention:
    """The `flash_attention` entry of the GPU registries (reference calling convention)."""

    def __getattr__(self, attr):  # name, forward_inputs, stats, ... as the reference's
        return getattr(REFERENCE, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        q, k, v, alibi = inputs
        if not covers(q, k, v, alibi, attrs):
            return REFERENCE.forward(inputs, attrs)
        return flash_forward(q, k, v, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        d_out, q, k, v, out, lse, alibi = inputs
        if not covers(q, k, v, alibi, attrs):
            return REFERENCE.backward(inputs, attrs)
        return flash_backward(d_out, q, k, v, out, lse, attrs)
