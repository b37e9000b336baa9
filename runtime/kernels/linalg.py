"""matmul, batched_matmul, grouped_gemm (spec §6.1, decisions.md "matmul transpose modes",
"matmul folds leading dims", "grouped_gemm").

Transpose modes are by stored shape: NN A:[M, K] B:[K, N]; NT B:[N, K]; TN A:[K, M];
TT both. matmul folds an operand of more than two dims into the matrix whose first dim
absorbs the leading dims; in NN/NT mode C keeps A's leading dims. `accumulate` and `beta`
read the old C, which is not an input of the signature: the kernel returns
alpha * op(A) @ op(B) and the caller that owns C's buffer applies C = new + beta * C (or
C += new); they are not differentiated (the backward assumes accumulate=false, beta=0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.base import register, sum_to_shape


def _op(x: Tensor, flag: str) -> Tensor:
    return x.transpose(-1, -2) if flag == "T" else x


def _mm(a: Tensor, b: Tensor, mode: str, alpha: float = 1.0) -> Tensor:
    """alpha * op(a) @ op(b) in `mode` (broadcasting over leading batch dims)."""
    out = torch.matmul(_op(a, mode[0]), _op(b, mode[1]))
    return out if alpha == 1.0 else alpha * out


def _fold(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x


# ------------------------------------------------------------------------------- matmul
def _matmul_backward(d_C, A, B, *, transpose="NN", alpha=1.0, **_):
    g, a, b = _fold(d_C), _fold(A), _fold(B)
    # the formulas of matmul.module's docstring, one line per mode
    d_A, d_B = {
        "NN": lambda: (_mm(g, b, "NT", alpha), _mm(a, g, "TN", alpha)),
        "NT": lambda: (_mm(g, b, "NN", alpha), _mm(g, a, "TN", alpha)),
        "TN": lambda: (_mm(b, g, "NT", alpha), _mm(a, g, "NN", alpha)),
        "TT": lambda: (_mm(b, g, "TT", alpha), _mm(g, a, "TT", alpha)),
    }[transpose]()
    return [d_A.reshape(A.shape), d_B.reshape(B.shape)]


@register("matmul", ("A", "B"), ("C",), ("d_C", "A", "B"), ("d_A", "d_B"),
          backward=_matmul_backward)
def _matmul_forward(A, B, *, transpose="NN", alpha=1.0, **_):
    C = _mm(_fold(A), _fold(B), transpose, alpha)
    if transpose[0] == "N" and A.dim() > 2:
        C = C.reshape(*A.shape[:-1], C.shape[-1])
    return [C]


# ----------------------------------------------------------------------- batched_matmul
def _batched_matmul_backward(d_C, A, B, *, transpose="NN", **_):
    d_A, d_B = {
        "NN": lambda: (_mm(d_C, B, "NT"), _mm(A, d_C, "TN")),
        "NT": lambda: (_mm(d_C, B, "NN"), _mm(d_C, A, "TN")),
        "TN": lambda: (_mm(B, d_C, "NT"), _mm(A, d_C, "NN")),
        "TT": lambda: (_mm(B, d_C, "TT"), _mm(d_C, A, "TT")),
    }[transpose]()
    # a 2-D B is broadcast over the batch dims: its gradient sums over them
    return [sum_to_shape(d_A, A.shape), sum_to_shape(d_B, B.shape)]


@register("batched_matmul", ("A", "B"), ("C",), ("d_C", "A", "B"), ("d_A", "d_B"),
          backward=_batched_matmul_backward)
def _batched_matmul_forward(A, B, *, transpose="NN", **_):
    return [_mm(A, B, transpose)]


# ------------------------------------------------------------------------- grouped_gemm
def _groups(offsets: Tensor):
    o = [int(v) for v in offsets.tolist()]
    return [(g, o[g], o[g + 1]) for g in range(len(o) - 1)]


def _grouped_gemm_backward(d_output, input, weights, offsets, *, transpose="NT", **_):
    d_input = torch.zeros_like(input)
    d_weights = torch.zeros_like(weights)
    for g, lo, hi in _groups(offsets):
        dy, x = d_output[lo:hi], input[lo:hi]
        if transpose == "NT":    # y = x @ W^T, W: [N, K]
            d_input[lo:hi] = dy @ weights[g]
            d_weights[g] = dy.T @ x
        else:                    # NN: y = x @ W, W: [K, N]
            d_input[lo:hi] = dy @ weights[g].T
            d_weights[g] = x.T @ dy
    return [d_input, d_weights]


@register("grouped_gemm", ("input", "weights", "offsets"), ("output",),
          ("d_output", "input", "weights", "offsets"), ("d_input", "d_weights"),
          backward=_grouped_gemm_backward)
def _grouped_gemm_forward(input, weights, offsets, *, transpose="NT", **_):
    n = weights.shape[1] if transpose == "NT" else weights.shape[2]
    rows = []
    for g, lo, hi in _groups(offsets):
        w = weights[g].T if transpose == "NT" else weights[g]
        rows.append(input[lo:hi] @ w)
    out = torch.cat(rows) if rows else input.new_zeros(0, n)
    if out.shape[0] < input.shape[0]:  # rows past offsets[-1] belong to no group
        out = torch.cat([out, input.new_zeros(input.shape[0] - out.shape[0], n)])
    return [out]
