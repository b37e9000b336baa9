"""mamba_conv1d and mamba_selective_scan on the GPU (csrc/kernels/mamba.cu, bound by
csrc/bindings_mamba.cpp), with the reference's calling convention and results.

The kernels take the activations (x, u, delta, B, C and the incoming gradients) in bf16 or
fp32, of one dtype, made contiguous here where they are strided (delta is a transposed
view in the std blocks); the small per-channel tensors (the conv weight and bias, A, D,
dt_bias) and the incoming states are cast to fp32 here, and their gradients come back in
their own dtypes (the reference's rule: d_<x> in x's dtype). Arithmetic and the scan's
states are fp32.

- mamba_conv1d: one block per (batch, channel) row; the backward recomputes the
  pre-activation; d_weight / d_bias are per-row partials summed over the batch here
  (deterministic).
- mamba_selective_scan: one warp per (batch, channel) row, a warp scan within each
  128-step tile, tiles in sequence. The backward keeps the state at every `chunk_size`
  steps (rounded up to whole tiles), re-runs the forward over each chunk and scans the
  adjoint in reverse (as mamba_ssm's kernels recompute instead of saving the states).
  d_B and d_C are summed over a group's channels with fp32 atomics (the order of the
  per-block sums varies between runs: not bitwise repeatable, as mamba_ssm's); d_A, d_D
  and d_dt_bias are per-row partials summed over the batch here.

Calls the kernels do not cover (tensors not on CUDA, other dtypes such as float64, a
kernel wider than 8, a state size N above 256) go to the reference kernels
(runtime/kernels/mamba.py), a per-time-step loop.
"""

from __future__ import annotations

import torch

from runtime.kernels import KERNELS

IO_DTYPES = (torch.bfloat16, torch.float32)
MAX_WIDTH, MAX_STATE = 8, 256


def _extension():
    from runtime.cuda.build import load

    return load()


def _activations_ok(*tensors) -> bool:
    """CUDA tensors of one dtype in IO_DTYPES."""
    first = tensors[0]
    return (all(isinstance(t, torch.Tensor) and t.is_cuda and t.device == first.device
                and t.dtype == first.dtype for t in tensors) and first.dtype in IO_DTYPES)


def _small_ok(like: torch.Tensor, *tensors) -> bool:
    """The per-channel tensors: None or floating CUDA tensors in IO_DTYPES on like's device."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.device == like.device
                             and t.dtype in IO_DTYPES) for t in tensors)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _like(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(x.dtype).contiguous()


class _Reference:
    def __init__(self, name: str):
        self.reference = KERNELS[name]

    def __getattr__(self, attr):
        return getattr(self.reference, attr)


# ------------------------------------------------------------------------- mamba_conv1d
class MambaConv1d(_Reference):
    def __init__(self):
        super().__init__("mamba_conv1d")

    @staticmethod
    def _covers(x, weight, bias, state, attrs, *more) -> bool:
        W = weight.shape[-1] if isinstance(weight, torch.Tensor) else 0
        return (_activations_ok(x, *more) and x.dim() == 3 and _small_ok(x, weight, bias, state)
                and 1 <= W <= MAX_WIDTH and int(attrs.get("kernel_size", 4)) == W
                and weight.numel() == x.shape[1] * W)

    def forward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        x, weight, bias, state = inputs
        if not self._covers(x, weight, bias, state, attrs):
            return self.reference.forward(inputs, attrs)
        x, state = x.contiguous(), _like(state, x)
        W = weight.shape[-1]
        y = _extension().mamba_conv1d_forward(x, _f32(weight).view(-1, W), _f32(bias), state,
                                              attrs.get("activation", "silu") == "silu")
        return [y, conv_state_out(x, state, W)]

    def backward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        d_y, x, weight, bias, state = inputs
        if not self._covers(x, weight, bias, state, attrs, d_y):
            return self.reference.backward(inputs, attrs)
        W = weight.shape[-1]
        d_x, partial = _extension().mamba_conv1d_backward(
            d_y.contiguous(), x.contiguous(), _f32(weight).view(-1, W), _f32(bias),
            _like(state, x), attrs.get("activation", "silu") == "silu")
        sums = partial.sum(0)                                        # [D, W + 1]
        d_weight = sums[:, :W].reshape(weight.shape).to(weight.dtype)
        d_bias = sums[:, W].to(bias.dtype) if bias is not None else None
        return [d_x, d_weight, d_bias]


def conv_state_out(x: torch.Tensor, state: torch.Tensor | None, W: int) -> torch.Tensor:
    """The last W - 1 columns of [conv_state (or zeros) | x] ([B, D, W - 1])."""
    B, D, T = x.shape
    pad = state if state is not None else x.new_zeros(B, D, W - 1)
    tail = torch.cat([pad, x[..., T - min(T, W - 1):]], dim=-1)
    return tail[..., tail.shape[-1] - (W - 1):].contiguous()


# ----------------------------------------------------------------- mamba_selective_scan
class MambaSelectiveScan(_Reference):
    def __init__(self):
        super().__init__("mamba_selective_scan")

    @staticmethod
    def _covers(u, delta, A, B, C, D, dt_bias, state, *more) -> bool:
        if not (_activations_ok(u, delta, B, C, *more) and u.dim() == 3 and B.dim() == 4
                and _small_ok(u, A, D, dt_bias, state) and A is not None):
            return False
        batch, channels, T = u.shape
        G, N = B.shape[1], B.shape[2]
        return (G >= 1 and channels % G == 0 and 1 <= N <= MAX_STATE
                and tuple(A.shape) == (channels, N) and B.shape == C.shape
                and tuple(B.shape) == (batch, G, N, T) and delta.shape == u.shape)

    def forward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        u, delta, A, B, C, D, dt_bias, state = inputs
        if not self._covers(*inputs):
            return self.reference.forward(inputs, attrs)
        y, last = _extension().mamba_scan_forward(
            u.contiguous(), delta.contiguous(), _f32(A), B.contiguous(), C.contiguous(),
            _f32(D), _f32(dt_bias), _f32(state))
        return [y, last.to(u.dtype)]

    def backward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        d_y, u, delta, A, B, C, D, dt_bias, state = inputs
        if not self._covers(u, delta, A, B, C, D, dt_bias, state, d_y):
            return self.reference.backward(inputs, attrs)
        d_u, d_delta, d_A, d_B, d_C, d_D, d_bias = _extension().mamba_scan_backward(
            d_y.contiguous(), u.contiguous(), delta.contiguous(), _f32(A), B.contiguous(),
            C.contiguous(), _f32(D), _f32(dt_bias), _f32(state),
            int(attrs.get("chunk_size", 256)))
        return [d_u, d_delta, d_A.sum(0).to(A.dtype), d_B.to(B.dtype), d_C.to(C.dtype),
                d_D.sum(0).to(D.dtype), d_bias.sum(0).to(dt_bias.dtype)]


MAMBA_KERNELS = {"mamba_conv1d": MambaConv1d(), "mamba_selective_scan": MambaSelectiveScan()}
