"""FlashAttention-2 over packed documents (`cu_seqlens`), the GPU counterpart of the
reference kernel's per-document mask (runtime/kernels/documents.py): what the GPU step's
flash_attention runs in a packed batch (runtime/cuda/attention.py, the buffers in
runtime/cuda/packed.py; decisions.md "Packed sequences"). Parity test
tests/test_cuda_varlen.py, timing benchmarks/kernels/bench_varlen.py.

Our layout q [B, Hq, T, D], k, v [B, Hkv, T, D] is a transpose view of [B, T, H, D];
flattening B and T gives the [B*T, H, D] rows FlashAttention's variable-length entry
reads (a view whenever the [B, T, H, D] tensor's T stride times T is its B stride, as
for the attention module's fused QKV projection). Every row of the batch is a run of
whole documents, so the documents of all rows, in order, are the variable-length
sequences: `cu_seqlens` holds their starts in the flattened rows and B*T at the end
(repeated: empty sequences, which the kernel skips). `longest` is a bound, not read from
the batch: the step passes T, so nothing syncs with the host.

The kernel's lse is [H, B*T] (one row per head over the flattened rows); our primitive's
is [B, H, T]: `varlen_forward` returns the permuted view (the arena keeps its memory
order) and `varlen_backward` takes it back as [H, B*T] (a view of it, or one copy).
"""

from __future__ import annotations

import torch

from runtime.cuda.attention import _scale, _window


def cu_seqlens(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [documents + 1], the longest document) of a packed batch from its
    restarting positions [B, T] (a document starts where its position is 0; each row
    starts one). Reads the host once for the longest document (outside a CUDA graph)."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    cu = torch.cat([starts, end]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] (a transpose view of [B, T, H, D]) -> [B*T, H, D], a view if it can."""
    t = t.transpose(1, 2)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[2], t.shape[3])


def varlen_forward(q, k, v, cu: torch.Tensor, longest: int, attrs: dict):
    """(out [B, Hq, T, D], lse [B, Hq, T]: a permuted view of the kernel's [Hq, B*T])."""
    B, H, T, D = q.shape
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _rows(q), _rows(k), _rows(v), cu, cu, longest, longest, 0.0,
        bool(attrs.get("causal", True)), False, scale=_scale(q, attrs), **_window(attrs))
    if tuple(lse.shape) != (H, B * T):
        raise RuntimeError(f"FlashAttention's varlen lse is {tuple(lse.shape)}, not "
                           f"[heads, tokens] = {(H, B * T)}: this torch pads it per "
                           "sequence, which packed training does not read")
    return out.view(B, T, H, D).transpose(1, 2), lse.view(H, B, T).transpose(0, 1)


def varlen_backward(d_out, q, k, v, out, lse, cu: torch.Tensor, longest: int, attrs: dict):
    """(d_q, d_k, d_v) in our layout, for varlen_forward's out and lse [B, Hq, T]."""
    B, H, T = lse.shape
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    d_q, d_k, d_v = torch.ops.aten._flash_attention_backward(
        _rows(d_out.to(q.dtype)), _rows(q), _rows(k), _rows(v), _rows(out),
        lse.transpose(0, 1).reshape(H, B * T), cu, cu, longest, longest, 0.0,
        bool(attrs.get("causal", True)), empty, empty, scale=_scale(q, attrs),
        **_window(attrs))
    return [g.view(B, T, *g.shape[1:]).transpose(1, 2) for g in (d_q, d_k, d_v)]
