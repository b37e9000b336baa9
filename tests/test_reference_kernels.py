"""The reference kernels (runtime/kernels) against the primitives' contract.

- Every primitive of std/primitives has a kernel whose forward/backward input and output
  names are the signature's, in order, and every kernel has cases in CASES.
- For every case (random float64 inputs), the explicit backward equals torch.autograd's
  vector-Jacobian product of the forward, for a random gradient of every output that the
  backward takes a `d_` of, within 1e-10 relative.
- Where an independent formula exists (ORACLES: torch.nn.functional, HuggingFace's code
  written out, naive loops), the forward values equal it.
- float32 and bfloat16 runs of every case are finite, have the contract's dtypes, and
  are close to float64 runs on the same (rounded) inputs: 1e-4 / 2e-2 relative.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `runtime` is not installed

from modulec.ops.registry import op_table  # noqa: E402
from runtime.kernels import KERNELS, default_attrs  # noqa: E402
from runtime.kernels.utility import torch_dtype  # noqa: E402

from kernel_testing import (F64, I32, assert_close, offsets_of, randint, randn,  # noqa: E402
                            topk_indices)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@dataclass
class Case:
    id: str
    make: Callable  # generator -> list of float64 / int32 inputs in signature order
    attrs: dict = field(default_factory=dict)


def _oracle_block_diag(xs, *, zero_rows=(), **_):
    """torch.block_diag, with each zero band a [rows, 0] block (no columns)."""
    gaps = list(zero_rows) or [0] * (len(xs) + 1)
    blocks = [xs[0].new_zeros(gaps[0], 0)]
    for x, gap in zip(xs, gaps[1:]):
        blocks += [x, x.new_zeros(gap, 0)]
    return [torch.block_diag(*blocks)]


# ======================================================================== the cases
def _matmul_cases():
    shapes = {"NN": ((5, 4), (4, 3)), "NT": ((5, 4), (3, 4)), "TN": ((4, 5), (4, 3)),
              "TT": ((4, 5), (3, 4))}
    cases = [Case(mode, lambda g, a=a, b=b: [randn(g, *a), randn(g, *b)], {"transpose": mode})
             for mode, (a, b) in shapes.items()]
    return cases + [
        Case("NN-alpha", lambda g: [randn(g, 5, 4), randn(g, 4, 3)], {"alpha": 0.5}),
        Case("NT-folded", lambda g: [randn(g, 2, 3, 4), randn(g, 5, 4)], {"transpose": "NT"}),
        Case("TN-weight-grad", lambda g: [randn(g, 2, 3, 4), randn(g, 2, 3, 5)], {"transpose": "TN"}),
        Case("TT-alpha", lambda g: [randn(g, 4, 5), randn(g, 3, 4)], {"transpose": "TT", "alpha": -2.0}),
    ]


def _batched_matmul_cases():
    return [
        Case("NN", lambda g: [randn(g, 2, 3, 4, 5), randn(g, 2, 3, 5, 6)]),
        Case("NT", lambda g: [randn(g, 2, 3, 4, 5), randn(g, 2, 3, 6, 5)], {"transpose": "NT"}),
        Case("TN", lambda g: [randn(g, 2, 5, 4), randn(g, 2, 5, 6)], {"transpose": "TN"}),
        Case("TT", lambda g: [randn(g, 2, 5, 4), randn(g, 2, 6, 5)], {"transpose": "TT"}),
        Case("NN-broadcast-B", lambda g: [randn(g, 2, 3, 4, 5), randn(g, 5, 6)]),
    ]


def _grouped_gemm_cases():
    offsets = torch.tensor([0, 3, 3, 7, 10], dtype=I32)  # group 1 is empty
    return [
        Case("NT", lambda g: [randn(g, 10, 4), randn(g, 4, 5, 4), offsets]),
        Case("NN", lambda g: [randn(g, 10, 4), randn(g, 4, 4, 5), offsets], {"transpose": "NN"}),
    ]


def _flash_cases():
    def qkv(B, Hq, Hkv, T, D, alibi=False):
        return lambda g: [randn(g, B, Hq, T, D), randn(g, B, Hkv, T, D), randn(g, B, Hkv, T, D),
                          (torch.rand(Hq, generator=g, dtype=F64) if alibi else None)]
    return [
        Case("gqa-causal", qkv(2, 4, 2, 7, 8)),
        Case("mha-full", qkv(2, 3, 3, 6, 4), {"causal": False}),
        Case("gqa-causal-window", qkv(2, 4, 2, 9, 8), {"window_size": 3}),
        Case("window-only", qkv(1, 2, 2, 8, 4), {"causal": False, "window_size": 2}),
        Case("mqa-alibi-scale", qkv(1, 4, 1, 6, 8, alibi=True), {"softmax_scale": 0.3}),
    ]


def _moe_router_cases():
    mk = lambda g: [randn(g, 12, 8), randn(g, 6, 8)]  # noqa: E731
    return [
        Case("softmax-top2-normalized", mk, {"top_k": 2}),
        Case("softmax-top3-raw", mk, {"top_k": 3, "normalize": False}),
        Case("sigmoid-top2-normalized", mk, {"top_k": 2, "use_sigmoid": True}),
        Case("sigmoid-top1-raw", mk, {"top_k": 1, "use_sigmoid": True, "normalize": False}),
    ]


def _moe_permute_case(g):
    indices = topk_indices(g, 10, 5, 2)
    return [randn(g, 10, 4), indices, offsets_of(indices, 5)]


def _moe_unpermute_make(realistic):
    def make(g):
        N, K, C = 8, 3, 5
        if realistic:  # the scatter indices of a real permutation by expert
            flat = topk_indices(g, N, 6, K).reshape(-1)
            scatter = torch.argsort(flat, stable=True).to(I32)
        else:
            scatter = torch.randperm(N * K, generator=g).to(I32)
        return [randn(g, N * K, C), torch.rand(N, K, generator=g, dtype=F64), scatter]
    return make


def _scan_make(batch, channels, T, N, G, state):
    def make(g):
        return [randn(g, batch, channels, T), randn(g, batch, channels, T),
                -torch.exp(randn(g, channels, N)), randn(g, batch, G, N, T),
                randn(g, batch, G, N, T), randn(g, channels), randn(g, channels),
                randn(g, batch, channels, N) if state else None]
    return make


def _conv_make(B, D, T, W, bias, state):
    def make(g):
        return [randn(g, B, D, T), randn(g, D, 1, W), randn(g, D) if bias else None,
                randn(g, B, D, W - 1) if state else None]
    return make


def _unary(*shapes):
    return [Case("x".join(map(str, s)), lambda g, s=s: [randn(g, *s)]) for s in shapes]


def _binary(*shapes):
    return [Case("x".join(map(str, s)), lambda g, s=s: [randn(g, *s), randn(g, *s)]) for s in shapes]


CASES: dict[str, list[Case]] = {
    "matmul": _matmul_cases(),
    "batched_matmul": _batched_matmul_cases(),
    "grouped_gemm": _grouped_gemm_cases(),
    "rmsnorm": [Case("3d", lambda g: [randn(g, 2, 3, 8), randn(g, 8)]),
                Case("2d-eps", lambda g: [randn(g, 5, 16), randn(g, 16)], {"eps": 1e-3}),
                Case("offset", lambda g: [randn(g, 2, 3, 8), randn(g, 8)], {"offset": 1.0})],
    "fused_residual_rmsnorm": [
        Case("3d", lambda g: [randn(g, 2, 3, 8), randn(g, 2, 3, 8), randn(g, 8)]),
        Case("offset", lambda g: [randn(g, 2, 3, 8), randn(g, 2, 3, 8), randn(g, 8)],
             {"offset": 1.0})],
    "layernorm": [Case("bias", lambda g: [randn(g, 2, 3, 8), randn(g, 8), randn(g, 8)]),
                  Case("no-bias", lambda g: [randn(g, 5, 6), randn(g, 6), None], {"eps": 1e-3})],
    "fused_residual_layernorm": [
        Case("bias", lambda g: [randn(g, 2, 3, 8), randn(g, 2, 3, 8), randn(g, 8), randn(g, 8)]),
        Case("no-bias", lambda g: [randn(g, 5, 6), randn(g, 5, 6), randn(g, 6), None],
             {"eps": 1e-3})],
    "group_rmsnorm": [
        Case("groups1-no-gate", lambda g: [randn(g, 2, 3, 8), randn(g, 8), None]),
        Case("groups4-gate", lambda g: [randn(g, 2, 3, 16), randn(g, 16), randn(g, 2, 3, 16)],
             {"groups": 4}),
    ],
    "swiglu": _binary((2, 3, 8), (5,)),
    "geglu": _binary((2, 3, 8)) + [Case("erf", lambda g: [randn(g, 4, 6), randn(g, 4, 6)],
                                        {"approximate": False})],
    "silu": _unary((2, 3, 8)),
    "relu": _unary((2, 3, 8)),
    "relu2": _unary((2, 3, 8)),
    "gelu": _unary((2, 3, 8)) + [Case("erf", lambda g: [randn(g, 4, 6)], {"approximate": False})],
    "sigmoid": _unary((2, 3, 8)),
    "softmax": _unary((2, 3, 8)) + [Case("dim1", lambda g: [randn(g, 2, 5, 3)], {"dim": 1})],
    "flash_attention": _flash_cases(),
    "rope": [
        Case("default-positions", lambda g: [randn(g, 2, 4, 6, 8), randn(g, 2, 2, 6, 8), None]),
        Case("position-ids", lambda g: [randn(g, 2, 4, 6, 8), randn(g, 2, 2, 6, 8),
                                        randint(g, 4096, 2, 6)], {"theta": 500000.0}),
    ],
    "qk_norm": [Case("gqa", lambda g: [randn(g, 2, 4, 5, 8), randn(g, 2, 2, 5, 8), randn(g, 8),
                                       randn(g, 8)])],
    "qk_norm_rope": [
        Case("gqa-default-positions", lambda g: [randn(g, 2, 4, 5, 8), randn(g, 2, 2, 5, 8),
                                                 randn(g, 8), randn(g, 8), None]),
        Case("position-ids", lambda g: [randn(g, 2, 2, 6, 8), randn(g, 2, 1, 6, 8), randn(g, 8),
                                        randn(g, 8), randint(g, 4096, 2, 6)],
             {"theta": 1000000.0, "eps": 1e-5}),
    ],
    "view": [Case("flatten", lambda g: [randn(g, 2, 3, 4)], {"shape": [6, 4]}),
             Case("infer", lambda g: [randn(g, 2, 3, 4)], {"shape": [2, -1, 2]})],
    "transpose": [Case("0-2", lambda g: [randn(g, 2, 3, 4)], {"dim0": 0, "dim1": 2}),
                  Case("neg", lambda g: [randn(g, 2, 3, 4)], {"dim0": -1, "dim1": -2})],
    "permute": [Case("201", lambda g: [randn(g, 2, 3, 4)], {"dims": [2, 0, 1]}),
                Case("0321", lambda g: [randn(g, 2, 3, 4, 5)], {"dims": [0, 3, 2, 1]})],
    "split": [Case("last", lambda g: [randn(g, 2, 9)], {"sizes": [2, 3, 4]}),
              Case("dim0", lambda g: [randn(g, 6, 4)], {"sizes": [2, 4], "dim": 0})],
    "concat": [Case("last", lambda g: [[randn(g, 2, 3), randn(g, 2, 5), randn(g, 2, 1)]]),
               Case("dim0", lambda g: [[randn(g, 2, 4), randn(g, 3, 4)]], {"dim": 0})],
    "block_diag": [Case("three", lambda g: [[randn(g, 4, 2), randn(g, 3, 2), randn(g, 2, 1)]]),
                   Case("zero_rows", lambda g: [[randn(g, 3, 2), randn(g, 2, 2)]],
                        {"zero_rows": [1, 2, 0]})],
    "contiguous": [Case("strided", lambda g: [randn(g, 3, 4).T]),
                   Case("contiguous", lambda g: [randn(g, 3, 4)])],
    "copy": _unary((3, 4)),
    "cast": [Case("to-fp64", lambda g: [randn(g, 2, 5)], {"dtype": "fp64"})],  # fp32: below
    "select": [Case("last", lambda g: [randn(g, 2, 3, 4)], {"dim": 1, "index": -1}),
               Case("first", lambda g: [randn(g, 5, 2)], {"dim": 0, "index": 0})],
    "slice": [Case("tail", lambda g: [randn(g, 2, 5, 3)], {"dim": 1, "start": 2}),
              Case("inner", lambda g: [randn(g, 2, 6)], {"dim": -1, "start": 1, "end": -2})],
    "dropout": [Case("no-seed", lambda g: [randn(g, 3, 4)], {"p": 0.5})],  # seeded: below
    "stop_gradient": _unary((3, 4)),
    "scale_gradient": [Case("half", lambda g: [randn(g, 3, 4)], {"scale": 0.5}),
                       Case("clip", lambda g: [randn(g, 2, 6)], {"scale": 2.0, "clip": 0.7})],
    # one rank (no process group): the all-reduce is the identity; two ranks under gloo
    # are tests/test_tensor_parallel.py
    "tp_copy": [Case("one_rank", lambda g: [randn(g, 3, 4)], {"size": 1})],
    "tp_all_reduce": [Case("one_rank", lambda g: [randn(g, 3, 4)], {"size": 1})],
    "sp_all_gather": [Case("one_rank", lambda g: [randn(g, 2, 3, 4)], {"size": 1})],
    "sp_reduce_scatter": [Case("one_rank", lambda g: [randn(g, 2, 3, 4)], {"size": 1})],
    "sp_scatter": [Case("one_rank", lambda g: [randn(g, 2, 3, 4)], {"size": 1})],
    "sp_gather": [Case("one_rank", lambda g: [randn(g, 2, 3, 4)], {"size": 1})],
    # one rank (the whole vocabulary); two ranks: tests/test_tensor_parallel.py
    "vocab_parallel_embedding": [
        Case("one_rank", lambda g: [randint(g, 7, 2, 5), randn(g, 7, 4)], {"size": 1})],
    "vocab_parallel_cross_entropy": [
        Case("one_rank", lambda g: [randn(g, 2, 5, 11),
                                    torch.where(torch.rand(2, 5, generator=g) < 0.3, -100,
                                                torch.randint(0, 11, (2, 5), generator=g)
                                                ).to(I32)], {"size": 1})],
    "add": _binary((2, 3, 4)) + [
        Case("broadcast-bias", lambda g: [randn(g, 2, 3, 4), randn(g, 4)]),
        Case("broadcast-both", lambda g: [randn(g, 3, 1), randn(g, 2, 1, 4)])],
    "mul": _binary((2, 3, 4)) + [
        Case("broadcast", lambda g: [randn(g, 2, 3, 4), randn(g, 3, 1)])],
    "scale": [Case("half", lambda g: [randn(g, 2, 3)], {"factor": 0.5}),
              Case("neg", lambda g: [randn(g, 4)], {"factor": -2.0})],
    "add3": [Case("3d", lambda g: [randn(g, 2, 3, 4), randn(g, 2, 3, 4), randn(g, 2, 3, 4)])],
    "neg": _unary((2, 3)),
    "exp": _unary((2, 3)),
    "exp_neg": _unary((2, 3)),
    "reduce_sum": [Case("last", lambda g: [randn(g, 2, 3, 4)], {"dims": [-1]}),
                   Case("0-2-keep", lambda g: [randn(g, 2, 3, 4)], {"dims": [0, 2], "keepdim": True}),
                   Case("all", lambda g: [randn(g, 2, 3)], {"dims": [0, 1]})],
    "reduce_mean": [Case("last-keep", lambda g: [randn(g, 2, 3, 4)], {"dims": [-1], "keepdim": True}),
                    Case("0-1", lambda g: [randn(g, 2, 3, 4)], {"dims": [0, 1]}),
                    Case("all", lambda g: [randn(g, 5)], {"dims": [0]})],
    "reduce_max": [Case("last", lambda g: [randn(g, 2, 3, 5)], {"dim": -1}),
                   Case("0-keep", lambda g: [randn(g, 4, 3)], {"dim": 0, "keepdim": True})],
    "embedding": [Case("2d-ids", lambda g: [randint(g, 7, 2, 5), randn(g, 7, 4)]),
                  Case("1d-ids", lambda g: [torch.tensor([3, 3, 0, 3], dtype=I32), randn(g, 5, 2)]),
                  Case("padding", lambda g: [torch.tensor([3, 3, 0, 1], dtype=I32), randn(g, 5, 2)],
                       {"padding_idx": 3})],
    "cross_entropy": [
        Case("ignore", lambda g: [randn(g, 2, 5, 11),
                                  torch.where(torch.rand(2, 5, generator=g) < 0.3, -100,
                                              torch.randint(0, 11, (2, 5), generator=g)).to(I32)]),
        Case("ignore-3", lambda g: [randn(g, 6, 9), torch.tensor([3, 0, 8, 3, 1, 2], dtype=I32)],
             {"ignore_index": 3}),
    ],
    "moe_router": _moe_router_cases(),
    "moe_compute_offsets": [Case("top2", lambda g: [topk_indices(g, 10, 5, 2)], {"num_experts": 5}),
                            Case("unused-experts", lambda g: [randint(g, 3, 6, 1)],
                                 {"num_experts": 8})],
    "moe_permute": [Case("top2", _moe_permute_case)],
    "moe_unpermute": [Case("random-permutation", _moe_unpermute_make(False)),
                      Case("by-expert", _moe_unpermute_make(True))],
    "mamba_conv1d": [
        Case("silu-bias", _conv_make(2, 3, 7, 4, True, False)),
        Case("silu-state", _conv_make(2, 3, 7, 4, True, True)),
        Case("none-no-bias-k2", _conv_make(1, 2, 5, 2, False, True),
             {"kernel_size": 2, "activation": "none"}),
    ],
    "mamba_selective_scan": [
        Case("G2", _scan_make(2, 4, 6, 3, 2, False)),
        Case("G1-state", _scan_make(1, 3, 5, 4, 1, True)),
        Case("G4-state", _scan_make(2, 4, 4, 2, 4, True), {"chunk_size": 2}),
    ],
    "zeros": [Case("fp32", lambda g: [], {"shape": [2, 3], "dtype": "fp32"}),
              Case("scalar-bf16", lambda g: [], {"shape": []})],
    "ones": [Case("fp32", lambda g: [], {"shape": [2, 3], "dtype": "fp32"}),
             Case("int32", lambda g: [], {"shape": [4], "dtype": "int32"})],
    "fill": [Case("fp32", lambda g: [], {"shape": [2, 3], "value": -1.5, "dtype": "fp32"}),
             Case("bf16-rounded", lambda g: [], {"shape": [3], "value": 1.0 + 2 ** -10})],
}

ALL_CASES = [(name, case) for name in sorted(CASES) for case in CASES[name]]
CASE_IDS = [f"{name}-{case.id}" for name, case in ALL_CASES]


# ======================================================================= oracles
def _mode_einsum(mode):
    a = "mk" if mode[0] == "N" else "km"
    b = "kn" if mode[1] == "N" else "nk"
    return f"...{a},...{b}->...mn"


def _oracle_matmul(A, B, *, transpose, alpha, **_):
    fold = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    C = alpha * torch.einsum(_mode_einsum(transpose), fold(A), fold(B))
    return [C.reshape(*A.shape[:-1], -1) if transpose[0] == "N" else C]


def _oracle_grouped_gemm(x, W, offsets, *, transpose, **_):
    o = offsets.tolist()
    parts = [F.linear(x[o[e]:o[e + 1]], W[e]) if transpose == "NT" else x[o[e]:o[e + 1]] @ W[e]
             for e in range(W.shape[0])]
    return [torch.cat(parts)]


def _oracle_flash(q, k, v, alibi, *, causal, softmax_scale, window_size, **_):
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    keep = torch.tensor([[(not causal or j <= i) and (window_size is None or j > i - window_size)
                          for j in range(T)] for i in range(T)])
    bias = torch.zeros(Hq, T, T, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    if alibi is not None:
        rel = torch.tensor([[j - i for j in range(T)] for i in range(T)], dtype=q.dtype)
        bias = bias + alibi[:, None, None] * rel
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias, scale=softmax_scale)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    lse = torch.logsumexp(scale * q @ kk.transpose(-1, -2) + bias, dim=-1)
    return [out, lse]


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _oracle_rope(q, k, position_ids, *, theta, **_):
    # transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (unsqueeze_dim=1), in float64
    B, _, T, D = q.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).to(F64) / D))
    if position_ids is None:
        position_ids = torch.arange(T)[None].expand(B, T)
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].to(F64)).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    return [q * cos + _hf_rotate_half(q) * sin, k * cos + _hf_rotate_half(k) * sin]


def _rstd(x, eps):
    return 1 / torch.sqrt(x.pow(2).mean(-1) + eps)


def _oracle_qk_norm_rope(q, k, qw, kw, position_ids, *, eps, theta, **_):
    """Qwen3's attention: q_norm / k_norm (F.rms_norm), then HF's rotary embedding."""
    q_n, k_n = F.rms_norm(q, (q.shape[-1],), qw, eps), F.rms_norm(k, (k.shape[-1],), kw, eps)
    return [*_oracle_rope(q_n, k_n, position_ids, theta=theta), _rstd(q, eps), _rstd(k, eps)]


def _oracle_group_rmsnorm(x, weight, gate, *, groups, eps, **_):
    # transformers' MambaRMSNormGated (Mamba-2), group_size = C / groups
    h = x * F.silu(gate) if gate is not None else x
    hg = h.view(*h.shape[:-1], groups, -1)
    variance = hg.pow(2).mean(-1, keepdim=True)
    return [weight * (hg * torch.rsqrt(variance + eps)).view(x.shape), _rstd(hg, eps)]


def _oracle_cross_entropy(logits, labels, *, ignore_index, **_):
    V = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1).long(), reduction="none",
                           ignore_index=ignore_index)
    return [loss.reshape(labels.shape), torch.logsumexp(logits, -1)]


def _routing_stats(probs, top_k):
    # what transformers' load_balancing_loss_func sums per layer (no attention mask):
    # the top-k assignments per expert and the probabilities, here divided by the tokens
    _, selected = torch.topk(probs, top_k, dim=-1)
    counts = torch.histc(selected.reshape(-1).to(probs.dtype), bins=probs.shape[-1],
                         min=0, max=probs.shape[-1])
    return torch.stack([counts / probs.shape[0], probs.mean(0)])


def _oracle_moe_router(x, gate, *, top_k, normalize, use_sigmoid, **_):
    logits = F.linear(x, gate)
    probs = torch.sigmoid(logits) if use_sigmoid else torch.softmax(logits, -1)
    p, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        p = p / p.sum(-1, keepdim=True)
    return [p, idx.to(I32), _routing_stats(probs, top_k)]


def _oracle_moe_permute(x, indices, offsets, **_):
    N, K = indices.shape
    scatter = [t * K + k for e in range(int(indices.max()) + 1) for t in range(N) for k in range(K)
               if indices[t, k] == e]
    s = torch.tensor(scatter)
    return [x[s // K], s.to(I32)]


def _oracle_moe_unpermute(eo, weights, scatter, **_):
    N, K = weights.shape
    out = torch.zeros(N, eo.shape[1], dtype=eo.dtype)
    for j, a in enumerate(scatter.tolist()):
        out[a // K] += weights[a // K, a % K] * eo[j]
    return [out]


def _oracle_conv1d(x, weight, bias, state, *, kernel_size, activation, **_):
    W, T = weight.shape[-1], x.shape[-1]
    if state is None:
        y = F.conv1d(x, weight, bias, padding=W - 1, groups=x.shape[1])[..., :T]
        tail = F.pad(x, (W - 1, 0))[..., -(W - 1):]
    else:
        xp = torch.cat([state, x], -1)
        y = F.conv1d(xp, weight, bias, groups=x.shape[1])
        tail = xp[..., -(W - 1):]
    return [F.silu(y) if activation == "silu" else y, tail]


def _oracle_scan(u, delta, A, B, C, D, dt_bias, state, **_):
    """A naive sequential loop, one (batch, channel) at a time."""
    batch, channels, T = u.shape
    G, N = B.shape[1], A.shape[1]
    y = torch.zeros_like(u)
    last = torch.zeros(batch, channels, N, dtype=u.dtype)
    for b in range(batch):
        for d in range(channels):
            grp = d // (channels // G)
            h = state[b, d].clone() if state is not None else torch.zeros(N, dtype=u.dtype)
            for t in range(T):
                dt = F.softplus(delta[b, d, t] + dt_bias[d])
                h = torch.exp(dt * A[d]) * h + dt * B[b, grp, :, t] * u[b, d, t]
                y[b, d, t] = (C[b, grp, :, t] * h).sum() + D[d] * u[b, d, t]
            last[b, d] = h
    return [y, last]


def _oracle_reduce(op):
    def oracle(x, *, dims, keepdim, **_):
        return [op(x, dim=tuple(dims), keepdim=keepdim)]
    return oracle


def _oracle_reduce_max(x, *, dim, keepdim, **_):
    values, indices = torch.max(x, dim=dim, keepdim=keepdim)
    return [values, indices.to(I32)]


def _oracle_constant(value):
    def oracle(*, shape, dtype, **attrs):
        v = attrs.get("value", value)
        return [torch.tensor(v, dtype=torch.float32).to(torch_dtype(dtype)).expand(shape)]
    return oracle


ORACLES: dict[str, Callable] = {
    "matmul": _oracle_matmul,
    "batched_matmul": lambda A, B, *, transpose, **_: [torch.einsum(_mode_einsum(transpose), A, B)],
    "grouped_gemm": _oracle_grouped_gemm,
    "rmsnorm": lambda x, w, *, eps, offset, **_: [
        F.rms_norm(x, (x.shape[-1],), w + offset, eps), _rstd(x, eps)],
    "fused_residual_rmsnorm": lambda r, i, w, *, eps, offset, **_: [
        r + i, F.rms_norm(r + i, (r.shape[-1],), w + offset, eps), _rstd(r + i, eps)],
    "layernorm": lambda x, w, b, *, eps, **_: [
        F.layer_norm(x, (x.shape[-1],), w, b, eps), x.mean(-1),
        1 / torch.sqrt(x.var(-1, unbiased=False) + eps)],
    "fused_residual_layernorm": lambda r, i, w, b, *, eps, **_: [
        r + i, F.layer_norm(r + i, (r.shape[-1],), w, b, eps), (r + i).mean(-1),
        1 / torch.sqrt((r + i).var(-1, unbiased=False) + eps)],
    "group_rmsnorm": _oracle_group_rmsnorm,
    "swiglu": lambda g, u, **_: [F.silu(g) * u],
    "geglu": lambda g, u, *, approximate, **_: [
        F.gelu(g, approximate="tanh" if approximate else "none") * u],
    "silu": lambda x, **_: [F.silu(x)],
    "relu": lambda x, **_: [F.relu(x)],
    "relu2": lambda x, **_: [F.relu(x) ** 2],
    "gelu": lambda x, *, approximate, **_: [F.gelu(x, approximate="tanh" if approximate else "none")],
    "sigmoid": lambda x, **_: [torch.sigmoid(x)],
    "softmax": lambda x, *, dim, **_: [torch.softmax(x, dim)],
    "flash_attention": _oracle_flash,
    "rope": _oracle_rope,
    "qk_norm": lambda q, k, qw, kw, *, eps, **_: [
        F.rms_norm(q, (q.shape[-1],), qw, eps), F.rms_norm(k, (k.shape[-1],), kw, eps),
        _rstd(q, eps), _rstd(k, eps)],
    "qk_norm_rope": _oracle_qk_norm_rope,
    "view": lambda x, *, shape, **_: [x.reshape(shape)],
    "transpose": lambda x, *, dim0, dim1, **_: [torch.transpose(x, dim0, dim1)],
    "permute": lambda x, *, dims, **_: [torch.permute(x, dims)],
    "split": lambda x, *, sizes, dim, **_: [list(torch.split(x, sizes, dim))],
    "concat": lambda xs, *, dim, **_: [torch.cat(xs, dim)],
    "block_diag": _oracle_block_diag,
    "contiguous": lambda x, **_: [x],
    "copy": lambda x, **_: [x],
    "cast": lambda x, *, dtype, **_: [x.to({"fp32": torch.float32, "fp64": F64}[dtype])],
    "stop_gradient": lambda x, **_: [x],
    "scale_gradient": lambda x, **_: [x],
    "dropout": lambda x, **_: [x, torch.ones_like(x)],  # no seed: inference
    "select": lambda x, *, dim, index, **_: [torch.select(x, dim, index)],
    "slice": lambda x, *, dim, start, end, **_: [
        torch.narrow(x, dim, *_span(x.shape[dim], start, end))],
    "tp_copy": lambda x, **_: [x],
    "tp_all_reduce": lambda x, **_: [x],
    "sp_all_gather": lambda x, **_: [x],
    "sp_reduce_scatter": lambda x, **_: [x],
    "sp_scatter": lambda x, **_: [x],
    "sp_gather": lambda x, **_: [x],
    "vocab_parallel_embedding": lambda ids, w, **_: [F.embedding(ids.long(), w)],
    "vocab_parallel_cross_entropy": lambda logits, labels, *, ignore_index=-100, **_:
        _oracle_cross_entropy(logits, labels, ignore_index=ignore_index),
    "add": lambda a, b, **_: [torch.add(a, b)],
    "mul": lambda a, b, **_: [torch.mul(a, b)],
    "scale": lambda x, *, factor, **_: [torch.mul(x, factor)],
    "add3": lambda a, b, c, **_: [a + b + c],
    "neg": lambda x, **_: [torch.neg(x)],
    "exp": lambda x, **_: [torch.exp(x)],
    "exp_neg": lambda x, **_: [-torch.exp(x)],
    "reduce_sum": _oracle_reduce(torch.sum),
    "reduce_mean": _oracle_reduce(torch.mean),
    "reduce_max": _oracle_reduce_max,
    "embedding": lambda ids, w, *, padding_idx=None, **_: [
        F.embedding(ids.long(), w, padding_idx=padding_idx)],
    "cross_entropy": _oracle_cross_entropy,
    "moe_router": _oracle_moe_router,
    "moe_compute_offsets": lambda ids, *, num_experts, **_: [offsets_of(ids, num_experts)],
    "moe_permute": _oracle_moe_permute,
    "moe_unpermute": _oracle_moe_unpermute,
    "mamba_conv1d": _oracle_conv1d,
    "mamba_selective_scan": _oracle_scan,
    "zeros": _oracle_constant(0.0),
    "ones": _oracle_constant(1.0),
    "fill": _oracle_constant(None),
}


def _span(size, start, end):
    first, stop, _ = slice(start, end).indices(size)
    return first, max(stop - first, 0)


# ======================================================================= harness
def _attrs(name, case):
    return default_attrs(name, **case.attrs)


def _inputs(name, case):
    return case.make(torch.Generator().manual_seed(zlib.crc32(f"{name}-{case.id}".encode())))


def _map(f, x):
    if isinstance(x, (list, tuple)):
        return [_map(f, t) for t in x]
    return f(x) if isinstance(x, torch.Tensor) else x


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat(item)]
    return [x] if isinstance(x, torch.Tensor) else []


def _shape(x):
    if isinstance(x, (list, tuple)):
        return [_shape(t) for t in x]
    return list(x.shape) if x is not None else None


def _cotangent(g, out, dtype):
    return _map(lambda t: torch.randn(t.shape, generator=g, dtype=F64).to(dtype), out)


def _backward_env(kernel, inputs, outputs, grads):
    env = dict(zip(kernel.forward_inputs, inputs))
    env.update({n: v for n, v in zip(kernel.forward_outputs, outputs) if n not in env})
    env.update(grads)
    return [env[n] for n in kernel.backward_inputs]


def _grad_names(kernel):
    """Forward outputs whose gradient the backward takes."""
    return [n for n in kernel.forward_outputs if f"d_{n}" in kernel.backward_inputs]


def _detached(x):
    return _map(lambda t: t.detach(), x)


# ========================================================================= tests
def test_every_primitive_has_a_kernel_and_cases():
    table = op_table()
    assert sorted(KERNELS) == sorted(table), "kernels and std/primitives differ"
    assert sorted(CASES) == sorted(KERNELS), "a kernel without cases (or cases for no kernel)"
    assert all(CASES[name] for name in CASES)
    assert sorted(ORACLES) == sorted(KERNELS), "a kernel without an oracle"


@pytest.mark.parametrize("name", sorted(op_table()))
def test_kernel_signature_is_the_primitives(name):
    definition, kernel = op_table()[name].definition, KERNELS[name]
    names = lambda sigs: tuple(s.name for s in sigs)  # noqa: E731
    assert kernel.forward_inputs == names(definition.forward.inputs)
    assert kernel.forward_outputs == names(definition.forward.outputs)
    assert kernel.backward_inputs == names(definition.backward.inputs)
    assert kernel.backward_outputs == names(definition.backward.outputs)
    assert (kernel.backward_fn is None) == (not definition.backward.outputs)


def test_kernels_use_no_autograd():
    """The backwards are explicit formulas: no name or attribute of torch's autodiff occurs
    in the kernels' code (docstrings aside)."""
    import ast

    import runtime.kernels as package
    banned = {"autograd", "requires_grad", "requires_grad_", "backward", "grad", "func",
              "enable_grad", "vjp"}
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in banned, f"{path.name}:{node.lineno} uses .{node.attr}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("autograd" in m or "torch.func" in m for m in modules), path.name


@pytest.mark.parametrize("name,case", ALL_CASES, ids=CASE_IDS)
def test_forward_matches_oracle(name, case):
    kernel, attrs, inputs = KERNELS[name], _attrs(name, case), _inputs(name, case)
    got = kernel.forward(inputs, attrs)
    want = ORACLES[name](*inputs, **attrs)
    assert len(got) == len(kernel.forward_outputs)
    for out_name, g, w in zip(kernel.forward_outputs, got, want):
        assert_close(g, w, 1e-12, f"{name}.{out_name}")


# identities forward whose backward is the annotation's, not the forward's derivative
# (`@gradient`, §7.8.3): checked against their formula below
NOT_DERIVATIVES = {"scale_gradient"}
BACKWARD_CASES = [(n, c) for n, c in ALL_CASES
                  if KERNELS[n].backward_outputs and n not in NOT_DERIVATIVES]


@pytest.mark.parametrize("scale, clip", [(0.5, None), (2.0, 0.7), (-1.0, 0.1)])
def test_scale_gradient_scales_then_clips_element_wise(scale, clip):
    kernel = KERNELS["scale_gradient"]
    d_y = torch.randn(4, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    x = torch.randn(4, 5, dtype=F64)
    assert kernel.forward([x], {"scale": scale, "clip": clip})[0] is x
    want = d_y * scale if clip is None else (d_y * scale).clamp(-clip, clip)
    assert torch.equal(kernel.backward([d_y], {"scale": scale, "clip": clip})[0], want)


def test_seeded_dropout_drops_and_scales_and_its_backward_reads_the_mask():
    kernel, x = KERNELS["dropout"], torch.randn(64, 64, dtype=F64)
    y, mask = kernel.forward([x], {"p": 0.25, "seed": 5})
    assert set(mask.unique().tolist()) == {0.0, 1 / 0.75}
    assert 0.2 < float((mask == 0).double().mean()) < 0.3
    assert torch.equal(y, x * mask)
    assert torch.equal(kernel.forward([x], {"p": 0.25, "seed": 5})[1], mask)  # seeded
    assert not torch.equal(kernel.forward([x], {"p": 0.25, "seed": 6})[1], mask)
    d_y = torch.randn(64, 64, dtype=F64)
    assert torch.equal(kernel.backward([d_y, mask], {"p": 0.25})[0], d_y * mask)


def test_cast_converts_and_its_gradient_goes_back_to_the_input_dtype():
    kernel = KERNELS["cast"]
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    y = kernel.forward([x], {"dtype": "fp32"})[0]
    assert y.dtype == torch.float32 and torch.equal(y, x.float())
    d_x = kernel.backward([torch.randn(3, 4)], {"dtype": "fp32",
                                                "input_dtypes": {"x": torch.bfloat16}})[0]
    assert d_x.dtype == torch.bfloat16


@pytest.mark.parametrize("name,case", BACKWARD_CASES,
                         ids=[f"{n}-{c.id}" for n, c in BACKWARD_CASES])
def test_backward_matches_autograd(name, case):
    kernel, attrs, inputs = KERNELS[name], _attrs(name, case), _inputs(name, case)
    wanted = {n[2:] for n in kernel.backward_outputs}
    leaves = [_map(lambda t: t.clone().requires_grad_(), x)
              if n in wanted and x is not None else x
              for n, x in zip(kernel.forward_inputs, inputs)]
    outputs = kernel.forward(leaves, attrs)
    g = torch.Generator().manual_seed(1)
    grads = {f"d_{n}": _cotangent(g, outputs[kernel.forward_outputs.index(n)], F64)
             for n in _grad_names(kernel)}
    loss = sum((o * d).sum() for n in _grad_names(kernel)
               for o, d in zip(_flat(outputs[kernel.forward_outputs.index(n)]), _flat(grads[f"d_{n}"])))
    differentiable = [(n, x) for n, x in zip(kernel.forward_inputs, leaves)
                      if n in wanted and x is not None]
    flat_leaves = [t for _, x in differentiable for t in _flat(x)]
    auto = list(torch.autograd.grad(loss, flat_leaves, allow_unused=True))
    auto = [a if a is not None else torch.zeros_like(t) for a, t in zip(auto, flat_leaves)]
    if name == "embedding" and attrs.get("padding_idx") is not None:
        # a gradient rule, not the forward's derivative: torch's F.embedding(padding_idx=p)
        # gives row p no gradient, as the kernel must
        auto[0][attrs["padding_idx"]] = 0

    backward_attrs = dict(attrs, input_shapes={n: _shape(x) for n, x in zip(kernel.forward_inputs, inputs)})
    result = kernel.backward(_backward_env(kernel, inputs, _detached(outputs), grads), backward_attrs)
    assert len(result) == len(kernel.backward_outputs)
    got = dict(zip(kernel.backward_outputs, result))
    for n, x in zip(kernel.forward_inputs, inputs):
        if x is None and f"d_{n}" in got:
            assert got[f"d_{n}"] is None, f"{name}: d_{n} of an absent input"
    for n, x in differentiable:
        count = len(_flat(x))
        want, auto = auto[:count], auto[count:]
        g_flat = _flat(got[f"d_{n}"])
        assert len(g_flat) == count, f"{name}: d_{n} missing"
        for i, (gv, wv) in enumerate(zip(g_flat, want)):
            assert_close(gv, wv, 1e-10, f"{name}.d_{n}[{i}]")


LOW_CASES = [(n, c, dt) for n, c in ALL_CASES for dt in (torch.float32, torch.bfloat16)
             if any(t.is_floating_point() for t in _flat(_inputs(n, c)))  # not the constants
             and not KERNELS[n].converts]  # nor cast: its dtypes are its own (tested above)


@pytest.mark.parametrize("name,case,dtype", LOW_CASES,
                         ids=[f"{n}-{c.id}-{str(dt)[6:]}" for n, c, dt in LOW_CASES])
def test_low_precision_close_to_float64(name, case, dtype):
    kernel, attrs, inputs = KERNELS[name], _attrs(name, case), _inputs(name, case)
    tol = TOLERANCE[dtype]
    low = _map(lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)
    ref_in = _map(lambda t: t.to(F64) if t.is_floating_point() else t, low)
    out_low, out_ref = kernel.forward(low, attrs), kernel.forward(ref_in, attrs)
    for n, got, want in zip(kernel.forward_outputs, out_low, out_ref):
        for t in _flat(got):
            if t.is_floating_point():
                assert t.dtype == (torch.float32 if n in kernel.stats else dtype), f"{n}: {t.dtype}"
        assert_close(got, want, tol, f"{name}.{n}")
    if not kernel.backward_outputs:
        return
    g = torch.Generator().manual_seed(2)
    grads_low, grads_ref = {}, {}
    for n in _grad_names(kernel):
        d = _cotangent(g, out_ref[kernel.forward_outputs.index(n)],
                       torch.float32 if n in kernel.stats else dtype)
        grads_low[f"d_{n}"], grads_ref[f"d_{n}"] = d, _map(lambda t: t.to(F64), d)
    shapes = {n: _shape(x) for n, x in zip(kernel.forward_inputs, inputs)}
    got = kernel.backward(_backward_env(kernel, low, out_low, grads_low), dict(attrs, input_shapes=shapes))
    want = kernel.backward(_backward_env(kernel, ref_in, out_ref, grads_ref), dict(attrs, input_shapes=shapes))
    for n, gv, wv in zip(kernel.backward_outputs, got, want):
        if wv is None:
            continue
        for t in _flat(gv):
            assert t.dtype == dtype, f"{n}: {t.dtype}"
        assert_close(gv, wv, tol, f"{name}.{n}")
