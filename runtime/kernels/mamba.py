"""mamba_conv1d and mamba_selective_scan (spec §6.10; decisions.md "Per-primitive fixes").

mamba_conv1d: xp = [conv_state or zeros | x] along time, y[t] = act(bias + sum_j w[j] *
xp[t + j]), conv_state_out = the last W - 1 columns of xp.

mamba_selective_scan (S6, as mamba_ssm's selective_scan_fn with delta_softplus=True):
dt = softplus(delta + dt_bias); channel d reads group d // (channels / G);
h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t;  y_t = sum_n C_t * h_t + D * u_t.
The reference runs the recurrence step by step over time (chunk_size only tiles the CUDA
kernel's scan; it does not change the result). The backward recomputes the states and
runs the adjoint recurrence backwards: g_t = d_y_t * C_t + exp(dt_{t+1} * A) * g_{t+1}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.base import register, sigmoid, silu, silu_grad, softplus


# ------------------------------------------------------------------------- mamba_conv1d
def _padded_input(x, conv_state, W):
    B, D, _ = x.shape
    if conv_state is None:
        conv_state = x.new_zeros(B, D, W - 1)
    return torch.cat([conv_state, x], dim=-1)               # [B, D, T + W - 1]


def _conv(xp, weight, bias, T):
    W = weight.shape[-1]
    z = sum(weight[None, :, 0, j, None] * xp[..., j:j + T] for j in range(W))
    return z + bias[None, :, None] if bias is not None else z


def _check_kernel_size(weight, kernel_size):
    if weight.shape[-1] != kernel_size:
        raise ValueError(f"mamba_conv1d: weight has width {weight.shape[-1]}, kernel_size={kernel_size}")


def _mamba_conv1d_backward(d_y, x, weight, bias=None, conv_state=None, *, kernel_size=4,
                           activation="silu", **_):
    _check_kernel_size(weight, kernel_size)
    W, T = weight.shape[-1], x.shape[-1]
    xp = _padded_input(x, conv_state, W)
    dz = d_y * silu_grad(_conv(xp, weight, bias, T)) if activation == "silu" else d_y
    d_weight = torch.stack([(dz * xp[..., j:j + T]).sum((0, 2)) for j in range(W)], -1)[:, None]
    # xp[t + j] feeds z[t] with weight w[j]: shift dz right by j and add
    d_xp = sum(F.pad(dz * weight[None, :, 0, j, None], (j, W - 1 - j)) for j in range(W))
    d_bias = dz.sum((0, 2)) if bias is not None else None
    return [d_xp[..., W - 1:], d_weight, d_bias]


@register("mamba_conv1d", ("x", "weight", "bias", "conv_state"), ("y", "conv_state_out"),
          ("d_y", "x", "weight", "bias", "conv_state"), ("d_x", "d_weight", "d_bias"),
          backward=_mamba_conv1d_backward)
def _mamba_conv1d_forward(x, weight, bias=None, conv_state=None, *, kernel_size=4,
                          activation="silu", **_):
    _check_kernel_size(weight, kernel_size)
    W, T = weight.shape[-1], x.shape[-1]
    xp = _padded_input(x, conv_state, W)
    z = _conv(xp, weight, bias, T)
    return [silu(z) if activation == "silu" else z, xp[..., T:]]


# ----------------------------------------------------------------- mamba_selective_scan
def _per_channel(t, channels):
    """[batch, G, N, T] -> [batch, channels, N, T] (channel d reads group d // (channels/G))."""
    return t.repeat_interleave(channels // t.shape[1], dim=1)


def _per_group(t, groups):
    """Sum a per-channel gradient [batch, channels, N, T] over each group's channels."""
    b, ch, n, T = t.shape
    return t.reshape(b, groups, ch // groups, n, T).sum(2)


def _discretize(u, delta, A, B, dt_bias):
    dt = softplus(delta + dt_bias[None, :, None])                 # [b, ch, T]
    dA = torch.exp(dt[:, :, None, :] * A[None, :, :, None])        # [b, ch, N, T]
    Bc = _per_channel(B, u.shape[1])
    dBu = dt[:, :, None, :] * Bc * u[:, :, None, :]
    return dt, dA, Bc, dBu


def _states(dA, dBu, ssm_state):
    """h_t for every t: [b, ch, N, T], and h_{-1}."""
    h = ssm_state if ssm_state is not None else torch.zeros_like(dBu[..., 0])
    h0, hs = h, []
    for t in range(dA.shape[-1]):
        h = dA[..., t] * h + dBu[..., t]
        hs.append(h)
    return torch.stack(hs, -1), h0


def _check_groups(u, B):
    if u.shape[1] % B.shape[1]:
        raise ValueError(f"mamba_selective_scan: channels={u.shape[1]} not a multiple of G={B.shape[1]}")


def _mamba_selective_scan_backward(d_y, u, delta, A, B, C, D, dt_bias, ssm_state=None, **_):
    _check_groups(u, B)
    G, channels, T = B.shape[1], u.shape[1], u.shape[-1]
    dt, dA, Bc, dBu = _discretize(u, delta, A, B, dt_bias)
    H, h0 = _states(dA, dBu, ssm_state)
    H_prev = torch.cat([h0[..., None], H[..., :-1]], -1)
    Cc = _per_channel(C, channels)
    # adjoint: gh_t = dL/dh_t
    g, gs = torch.zeros_like(h0), [None] * T
    for t in reversed(range(T)):
        g = g + d_y[:, :, None, t] * Cc[..., t]
        gs[t] = g
        g = g * dA[..., t]
    Gh = torch.stack(gs, -1)                                      # [b, ch, N, T]
    d_logdA = Gh * H_prev * dA                                    # d(dt * A)
    d_dt = (d_logdA * A[None, :, :, None]).sum(2) + (Gh * Bc * u[:, :, None, :]).sum(2)
    d_delta = d_dt * sigmoid(delta + dt_bias[None, :, None])      # softplus' = sigmoid
    return [
        (Gh * dt[:, :, None, :] * Bc).sum(2) + D[None, :, None] * d_y,   # d_u
        d_delta,
        (d_logdA * dt[:, :, None, :]).sum((0, 3)),                        # d_A
        _per_group(Gh * dt[:, :, None, :] * u[:, :, None, :], G),         # d_B
        _per_group(d_y[:, :, None, :] * H, G),                            # d_C
        (d_y * u).sum((0, 2)),                                            # d_D
        d_delta.sum((0, 2)),                                              # d_dt_bias
    ]


@register("mamba_selective_scan", ("u", "delta", "A", "B", "C", "D", "dt_bias", "ssm_state"),
          ("y", "ssm_state_out"),
          ("d_y", "u", "delta", "A", "B", "C", "D", "dt_bias", "ssm_state"),
          ("d_u", "d_delta", "d_A", "d_B", "d_C", "d_D", "d_dt_bias"),
          backward=_mamba_selective_scan_backward)
def _mamba_selective_scan_forward(u, delta, A, B, C, D, dt_bias, ssm_state=None, **_):
    _check_groups(u, B)
    _, dA, _, dBu = _discretize(u, delta, A, B, dt_bias)
    H, _ = _states(dA, dBu, ssm_state)
    y = (_per_channel(C, u.shape[1]) * H).sum(2) + D[None, :, None] * u
    return [y, H[..., -1]]
