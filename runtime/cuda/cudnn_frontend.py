"""cuDNN's fused attention through its own graph API (the `nvidia-cudnn-frontend` package,
an optional dependency: `pip install "modulec[cudnn]"`), the `cudnn_fe` backend of
runtime/cuda/attention.py.

torch's `_scaled_dot_product_cudnn_attention` runs the same cuDNN kernels, but each call
also launches work of its own around them. Built here from the frontend's graphs (one per
shape, layout, dtype, mask and scale, kept for the process) and executed on torch's
current stream, the kernels are cuDNN's alone and the bits are the same as torch's call.
One H200, LoRA 8B's attention (B=1, T=2048, 32 / 8 heads, D=128), CUDA-graph replays
back to back: the forward 82.2 against 87.9 us (benchmarks/kernels/results_cudnn_fe_h200.txt).

Layouts are the `cudnn` backend's: q, k, v read as the strided views they are, out laid
[B, T, H, D] in memory (the attention module's `contiguous` stays a view:
modulec/plan/layouts.py), lse [B, H, T] fp32 (cuDNN's natural-log stats), the gradients
laid as their inputs are. Causal masks are top-left aligned, as torch's `is_causal`.
`MODULEC_CUDNN_FRONTEND=0` leaves the backend out (A/B against torch's call).
"""

from __future__ import annotations

import os
from functools import cache

import torch

DTYPES = (torch.bfloat16, torch.float16)
_UID = dict(q=1, k=2, v=3, o=4, d_o=5, stats=6, d_q=7, d_k=8, d_v=9)


@cache
def frontend():
    """The `cudnn` module, or None where it does not import (not installed, or a cuDNN it
    cannot load); `unavailable` then says why."""
    try:
        import cudnn
    except Exception as error:  # noqa: BLE001 (any import failure leaves the backend out)
        frontend.unavailable = f"{type(error).__name__}: {error}"[:300]
        return None
    return cudnn


frontend.unavailable = None


def enabled() -> bool:
    return os.environ.get("MODULEC_CUDNN_FRONTEND", "1") != "0" and frontend() is not None


def like_layout(t: torch.Tensor) -> torch.Tensor:
    """An empty dense tensor shaped as `t` with its dimensions laid in `t`'s stride order
    (a transposed view stays transposed: what torch's cuDNN entry allocates)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    dense = torch.empty([t.shape[d] for d in order], dtype=t.dtype, device=t.device)
    return dense.permute([order.index(d) for d in range(t.dim())])


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride())


def _forward_specs(q, k, v) -> dict:
    """The forward's tensors as (shape, strides): out laid [B, T, H, D], stats [B, H, T, 1]."""
    B, H, T, _ = q.shape
    Dv = v.shape[-1]
    return dict(q=_spec(q), k=_spec(k), v=_spec(v),
                o=((B, H, T, Dv), (T * H * Dv, Dv, H * Dv, 1)),
                stats=((B, H, T, 1), (H * T, T, 1, 1)))


_graphs: dict[tuple, object] = {}   # key -> built graph, or None where cuDNN refused it
_handles: dict[int, object] = {}


def _handle(device: torch.device):
    if device.index not in _handles:
        with torch.cuda.device(device):
            _handles[device.index] = frontend().create_handle()
    return _handles[device.index]


def _graph(direction: str, specs: dict, q, causal: bool, scale: float):
    """The built graph for tensors laid as `specs` (cached), or None where cuDNN cannot
    run it."""
    key = (direction, causal, scale, q.dtype, q.device.index, tuple(sorted(specs.items())))
    if key not in _graphs:
        try:
            _graphs[key] = _build(direction, specs, q, causal, scale)
        except Exception:  # noqa: BLE001 (cuDNN's "not supported" comes as many types)
            _graphs[key] = None
    return _graphs[key]


def _build(direction: str, specs: dict, q, causal: bool, scale: float):
    cudnn = frontend()
    io = cudnn.data_type.BFLOAT16 if q.dtype == torch.bfloat16 else cudnn.data_type.HALF
    f32 = cudnn.data_type.FLOAT
    with torch.cuda.device(q.device):
        g = cudnn.pygraph(handle=_handle(q.device), io_data_type=io,
                          intermediate_data_type=f32, compute_data_type=f32)
        made = {name: g.tensor(name=name, dim=list(specs[name][0]),
                               stride=list(specs[name][1]),
                               data_type=f32 if name == "stats" else io, uid=_UID[name])
                for name in _INPUTS[direction]}
        mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                    diagonal_band_right_bound=0) if causal else {}
        if direction == "forward":
            results = g.sdpa(name="sdpa", q=made["q"], k=made["k"], v=made["v"],
                             generate_stats=True, attn_scale=scale, **mask)
        else:
            results = g.sdpa_backward(name="sdpa_backward", q=made["q"], k=made["k"],
                                      v=made["v"], o=made["o"], dO=made["d_o"],
                                      stats=made["stats"], attn_scale=scale, **mask)
        for name, result in zip(_OUTPUTS[direction], results):
            shape, stride = specs[name]
            result.set_uid(_UID[name]).set_output(True).set_dim(list(shape)) \
                .set_stride(list(stride)).set_data_type(f32 if name == "stats" else io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    return g


_INPUTS = {"forward": ("q", "k", "v"), "backward": ("q", "k", "v", "o", "d_o", "stats")}
_OUTPUTS = {"forward": ("o", "stats"), "backward": ("d_q", "d_k", "d_v")}


def _run(g, tensors: dict) -> None:
    cudnn = frontend()
    device = tensors["q"].device
    handle = _handle(device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    work = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=device)
    g.execute({_UID[name]: t for name, t in tensors.items()}, work, handle)


class CudnnFrontend:
    """The `cudnn_fe` backend (runtime/cuda/attention.py): no sliding window, head dims up
    to 128, a causal mask only where queries and keys are as many, every tensor's last
    dimension contiguous; a shape cuDNN refuses is left to the next backend."""

    name = "cudnn_fe"

    @property
    def unavailable(self):  # why `cudnn` did not import (the pinned-kernel error says it)
        return frontend.unavailable

    def covers(self, q, k, v, attrs) -> bool:
        if not enabled() or attrs.get("window_size") is not None or q.shape[-1] > 128:
            return False
        if q.dtype not in DTYPES or any(t.stride(-1) != 1 for t in (q, k, v)):
            return False
        causal = bool(attrs.get("causal", True))
        if causal and q.shape[2] != k.shape[2]:
            return False
        return _graph("forward", _forward_specs(q, k, v), q, causal,
                      _scale(q, attrs)) is not None

    def forward(self, q, k, v, attrs):
        specs = _forward_specs(q, k, v)
        g = _graph("forward", specs, q, bool(attrs.get("causal", True)), _scale(q, attrs))
        B, H, T, _ = q.shape
        out = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
        stats = torch.empty(B, H, T, 1, dtype=torch.float32, device=q.device)
        _run(g, dict(q=q, k=k, v=v, o=out, stats=stats))
        return [out, stats.view(B, H, T)]

    def backward(self, d_out, q, k, v, out, lse, attrs):
        d_out = d_out.to(q.dtype)
        if d_out.stride(-1) != 1:
            d_out = d_out.contiguous()
        tensors = dict(q=q, k=k, v=v, o=out, d_o=d_out, stats=lse.unsqueeze(-1),
                       d_q=like_layout(q), d_k=like_layout(k), d_v=like_layout(v))
        specs = {name: _spec(t) for name, t in tensors.items()}
        g = _graph("backward", specs, q, bool(attrs.get("causal", True)), _scale(q, attrs))
        if g is None:  # cuDNN refused this backward: torch's entry runs it
            from runtime.cuda.attention import BACKENDS

            return BACKENDS["cudnn"].backward(d_out, q, k, v, out, lse, attrs)
        _run(g, tensors)
        return [tensors["d_q"], tensors["d_k"], tensors["d_v"]]


def _scale(q, attrs) -> float:
    from runtime.cuda.attention import _scale as scale

    return scale(q, attrs)
