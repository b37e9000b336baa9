"""flash_attention on the GPU through fused attention kernels that never materialize the
[T, T] scores (`BACKENDS`, tried in the order the registry entry is given):

- `cudnn`: cuDNN's fused attention (`aten::_scaled_dot_product_cudnn_attention` and its
  backward): native GQA, causal or not, no sliding window, head dim <= 128. On an H200
  at the TinyLlama shape it runs 1.5x FlashAttention-2's speed (forward 0.185 ms against
  0.278, backward 0.575 against 0.880: benchmarks/kernels/bench_attention.py).
- `cudnn_expand`: the same with K/V heads repeated (for a cuDNN without native GQA).
- `flash`: FlashAttention-2 (`aten::_flash_attention_forward` / `_backward`), below.
- `fa4`: FlashAttention-4's CuTe kernels (`flash_attn.cute`, the `flash-attn-4` package,
  an optional dependency) on Hopper and Blackwell: causal or not, sliding windows, native
  GQA, head dims 64 and 128. It covers a call only where the package imports on an SM90 /
  SM100 card; elsewhere the next backend of the order runs.
- `fa4_bwd`: cuDNN's forward with FA4's backward, at head dim 64 (the faster pair on an
  H100, below). The GPU step's default order is `DEFAULT_ORDER`: `fa4_bwd`, `cudnn`,
  `flash`, so without flash-attn-4 installed the step runs cuDNN as before.

Layouts: our primitive takes q [B, Hq, T, D], k, v [B, Hkv, T, D] and returns out
[B, Hq, T, D] and lse [B, Hq, T] (fp32, natural log). The aten ops take [B, T, H, D] with
the last dim contiguous: a transpose view of ours (the attention module's q, k, v are
already transposes of the fused QKV projection, so no copy happens). GQA is native (the
kernel reads kv head h // (Hq / Hkv); d_k, d_v come back with Hkv heads). Causal and the
sliding window map to the kernel's window: our window keeps keys i - window_size < j <= i,
that is window_size_left = window_size - 1, window_size_right = 0.

In a packed batch (`packed(documents)` with the step's cu_seqlens, runtime/cuda/packed.py)
FlashAttention-2's varlen entry runs instead (runtime/cuda/varlen.py): each document
attends to itself alone; cuDNN's fused attention is not used there.

Calls the kernel does not cover go to the reference kernel (in a packed batch it masks by
document): tensors not on CUDA, dtypes
other than bf16/fp16 (fp32 runs are exact references), ALiBi slopes, non-causal with a
window, head dims over 256 or not a multiple of 8.
"""

from __future__ import annotations

import math

import torch

from runtime.kernels import KERNELS
from runtime.kernels.documents import active

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


def _dense_bthd(t: torch.Tensor) -> torch.Tensor:
    """`t` [B, H, T, D] laid dense as [B, T, H, D] (a copy only where it is not)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


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


class Flash:
    """FlashAttention-2 (aten ops): causal, sliding window, native GQA."""

    name = "flash"

    def covers(self, q, k, v, attrs) -> bool:
        return True

    def forward(self, q, k, v, attrs):
        return flash_forward(q, k, v, attrs)

    def backward(self, d_out, q, k, v, out, lse, attrs):
        return flash_backward(d_out, q, k, v, out, lse, attrs)


class Cudnn:
    """cuDNN's fused attention (aten `_scaled_dot_product_cudnn_attention` and its
    backward) on our [B, H, T, D] layout (strided views are read as they are). No sliding
    window. `expand_kv`: GQA by repeating K/V heads (copies; d_k, d_v summed back) for a
    cuDNN without native GQA."""

    def __init__(self, expand_kv: bool = False):
        self.expand_kv = expand_kv
        self.name = "cudnn_expand" if expand_kv else "cudnn"

    def covers(self, q, k, v, attrs) -> bool:
        return attrs.get("window_size") is None and q.shape[-1] <= 128

    def _kv(self, q, t):
        if not self.expand_kv or t.shape[1] == q.shape[1]:
            return t
        B, H, S, D = t.shape
        group = q.shape[1] // H
        return t[:, :, None].expand(B, H, group, S, D).reshape(B, H * group, S, D)

    def forward(self, q, k, v, attrs):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, self._kv(q, k), self._kv(q, v), None, True, 0.0,
            bool(attrs.get("causal", True)), False, scale=_scale(q, attrs))
        return [out, lse.reshape(q.shape[:3])]

    def backward(self, d_out, q, k, v, out, lse, attrs):
        T, S = q.shape[2], k.shape[2]
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        # torch's entry keeps its cuDNN graph per shapes and q / k / v strides, not per
        # out's, d_out's or lse's: every call hands those laid one way (decisions.md "GPU
        # attention"), else a call laid otherwise than the first runs the first's layout
        out, d_out = _dense_bthd(out), _dense_bthd(d_out.to(q.dtype))
        lse = lse.reshape(*q.shape[:3], 1).contiguous()
        d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out, q, self._kv(q, k), self._kv(q, v), out, lse,
            empty, empty, None, None, None, T, S, 0.0,
            bool(attrs.get("causal", True)), scale=_scale(q, attrs))
        return [d_q, self._fold(d_k, k), self._fold(d_v, v)]

    @staticmethod
    def _fold(d, like):
        if d.shape[1] == like.shape[1]:
            return d
        B, H, S, D = like.shape
        return d.view(B, H, d.shape[1] // H, S, D).sum(2)


class FA4:
    """FlashAttention-4's CuTe kernels (`flash_attn.cute.interface`), when installed: our
    [B, H, T, D] layout read as [B, T, H, D] views (no copy for the fused QKV projection's
    heads), lse [B, H, T] in fp32 as ours; d_k, d_v come back with Hkv heads."""

    name = "fa4"
    _module = None
    unavailable = None  # why the package did not import (benchmarks print it)

    @classmethod
    def interface(cls):
        if cls._module is None:
            try:
                from flash_attn.cute import interface
            except Exception as error:  # not installed, or its CUDA toolchain does not load
                cls.unavailable = f"{type(error).__name__}: {error}"[:300]
                interface = False
            cls._module = interface
        return cls._module

    head_dims = (64, 128)  # the ones tests/test_cuda_train.py checks against the reference

    def covers(self, q, k, v, attrs) -> bool:
        if q.shape[-1] not in self.head_dims or not self.interface():
            return False
        return torch.cuda.get_device_capability(q.device)[0] in (9, 10)

    def forward(self, q, k, v, attrs):
        out, lse, *_ = self.interface()._flash_attn_fwd(
            _bthd(q), _bthd(k), _bthd(v), softmax_scale=_scale(q, attrs),
            causal=bool(attrs.get("causal", True)), return_lse=True, **_window(attrs))
        return [out.transpose(1, 2), lse]

    def backward(self, d_out, q, k, v, out, lse, attrs):
        d_q, d_k, d_v = self.interface()._flash_attn_bwd(
            _bthd(q), _bthd(k), _bthd(v), _bthd(out), _bthd(d_out.to(q.dtype)), lse,
            softmax_scale=_scale(q, attrs), causal=bool(attrs.get("causal", True)),
            **_window(attrs))[:3]
        return [d_q.transpose(1, 2), d_k.transpose(1, 2), d_v.transpose(1, 2)]


class FA4Backward(FA4):
    """cuDNN's forward and FlashAttention-4's backward, at head dim 64 only: on an H100 at
    the TinyLlama shape FA4's backward ran 1.35x cuDNN's (0.502 against 0.676 ms) while
    its forward ran 0.87x (0.215 against 0.187 ms); at head dim 128 cuDNN was as fast or
    faster both ways (benchmarks/kernels/results_attention_h100_fa4.txt). The backward
    reads the forward's out and lse, which cuDNN computes as FA4 does (natural-log lse of
    the scaled scores, fp32)."""

    name = "fa4_bwd"
    forward_name, backward_name = "cudnn", "fa4"  # what runs each way (the trainer's note)

    def covers(self, q, k, v, attrs) -> bool:
        return q.shape[-1] == 64 and attrs.get("window_size") is None and \
            super().covers(q, k, v, attrs)

    def forward(self, q, k, v, attrs):
        return BACKENDS["cudnn"].forward(q, k, v, attrs)


BACKENDS = {b.name: b for b in (Cudnn(), Cudnn(expand_kv=True), Flash(), FA4(), FA4Backward())}
# the GPU step's order: FA4's backward where it is installed and faster, else cuDNN,
# FlashAttention-2 for what cuDNN does not cover (sliding windows)
DEFAULT_ORDER = ("fa4_bwd", "cudnn", "flash")


class FlashAttention:
    """The `flash_attention` entry of the GPU registries (reference calling convention):
    the first of `order` that covers the call.

    `allocates_outputs`: the fused kernels allocate their outputs (no `out=`), so on the
    arena a transient one (the backward's d_q and d_k, which RoPE's backward reads at
    once) stays where the kernel put it instead of being copied into its planned bytes
    (runtime.interpreter `place`)."""

    allocates_outputs = True

    def __init__(self, order=("flash",), fallback=None, pinned: str | None = None):
        self.order = [BACKENDS[name] for name in order]
        self.fallback = fallback  # a `@kernel` choice's: the step's own entry
        self.pinned = pinned  # `@kernel(name, fallback=false)`: a call not covered is an error
        self.ran: set[tuple[str, str, int]] = set()  # (direction, kernel, head dim)

    def strict(self, name: str) -> "FlashAttention":
        """This entry under `@kernel(name, fallback=false)`."""
        return FlashAttention(tuple(b.name for b in self.order), pinned=name)

    def _uncovered(self, direction: str, inputs: list, attrs: dict) -> list:
        if self.pinned is not None:
            from runtime.errors import RuntimeUserError

            why = getattr(self.order[0], "unavailable", None)
            raise RuntimeUserError(
                f"`@kernel(\"{self.pinned}\", fallback=false)`: {self.pinned} does not cover "
                f"this flash_attention call (head dim, window, dtype or card)"
                + (f"; {why}" if why else ""), help=["drop fallback=false to run the "
                                                      "step's default attention there"])
        if self.fallback is not None:
            return getattr(self.fallback, direction)(inputs, attrs)
        self._ran(direction, "reference", inputs[0 if direction == "forward" else 1])
        return getattr(REFERENCE, direction)(inputs, attrs)

    def _ran(self, direction: str, kernel: str, q) -> None:
        """What ran, for `modulec train`'s note (eager calls only: a replay runs no Python,
        and runs what its capture ran)."""
        self.ran.add((direction, kernel, int(q.shape[-1])))

    def __getattr__(self, attr):  # name, forward_inputs, stats, ... as the reference's
        return getattr(REFERENCE, attr)

    def _backend(self, q, k, v, alibi, attrs):
        if not covers(q, k, v, alibi, attrs):
            return None
        return next((b for b in self.order if b.covers(q, k, v, attrs)), None)

    def _documents(self, q, k, v, alibi, attrs):
        """(packed, the documents for the varlen kernel or None: the reference's mask)."""
        documents = active(q.shape[0], q.shape[2])
        if documents is None:
            return False, None
        if documents.cu_seqlens is None or k.shape[2] != q.shape[2] or \
                not covers(q, k, v, alibi, attrs):
            return True, None
        return True, documents

    def forward(self, inputs: list, attrs: dict) -> list:
        q, k, v, alibi = inputs
        packed, documents = self._documents(q, k, v, alibi, attrs)
        if documents is not None:
            from runtime.cuda.varlen import varlen_forward

            self._ran("forward", "varlen", q)
            return list(varlen_forward(q, k, v, documents.cu_seqlens, documents.max_seqlen,
                                       attrs))
        if packed:  # documents the varlen kernel cannot take: the reference masks them
            self._ran("forward", "reference", q)
            return REFERENCE.forward(inputs, attrs)
        backend = self._backend(q, k, v, alibi, attrs)
        if backend is None:
            return self._uncovered("forward", inputs, attrs)
        self._ran("forward", getattr(backend, "forward_name", backend.name), q)
        return backend.forward(q, k, v, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        d_out, q, k, v, out, lse, alibi = inputs
        packed, documents = self._documents(q, k, v, alibi, attrs)
        if documents is not None:
            from runtime.cuda.varlen import varlen_backward

            self._ran("backward", "varlen", q)
            return varlen_backward(d_out, q, k, v, out, lse, documents.cu_seqlens,
                                   documents.max_seqlen, attrs)
        if packed:
            self._ran("backward", "reference", q)
            return REFERENCE.backward(inputs, attrs)
        backend = self._backend(q, k, v, alibi, attrs)
        if backend is None:
            return self._uncovered("backward", inputs, attrs)
        self._ran("backward", getattr(backend, "backward_name", backend.name), q)
        return backend.backward(d_out, q, k, v, out, lse, attrs)


KERNEL_WORDS = {"cudnn": "cuDNN", "cudnn_expand": "cuDNN (K/V heads repeated)",
                "flash": "FlashAttention-2", "varlen": "FlashAttention-2's varlen kernel",
                "fa4": "FlashAttention-4", "reference": "the reference kernel"}


def ran_note(ran: set) -> str | None:
    """`modulec train`'s line on the attention kernels its first step ran, with where
    flash-attn-4 would make the backward faster (FA4Backward's head dim) and is missing."""
    if not ran:
        return None
    parts = []
    for direction in ("forward", "backward"):
        kernels = sorted({KERNEL_WORDS.get(k, k) for d, k, _ in ran if d == direction})
        if kernels:
            parts.append(f"{direction} {', '.join(kernels)}")
    line = "attention: " + "; ".join(parts)
    if any(k == "fa4" for _, k, _ in ran):
        from importlib.metadata import PackageNotFoundError, version

        try:
            line += f" (flash-attn-4 {version('flash-attn-4')})"
        except PackageNotFoundError:
            pass
    elif any(d == "backward" and k == "cudnn" and dim == 64 for d, k, dim in ran) and \
            not FA4.interface():
        line += " (pip install \"modulec[fa4]\": the head dim 64 backward then runs " \
                "FlashAttention-4's kernel instead of cuDNN's on SM90 / SM100 cards)"
    return line
