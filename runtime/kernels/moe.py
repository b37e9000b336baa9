"""moe_router, moe_compute_offsets, moe_permute, moe_unpermute (spec §6.9; decisions.md
"Per-primitive fixes"). grouped_gemm is in linalg.py.

Index conventions: token t's top_k assignments are a = t * top_k + k. moe_permute sorts
the N * top_k assignments by expert, stably (so by a within an expert):
scatter_indices[j] = a of permuted row j, permuted[j] = x[a // top_k]; expert e owns rows
expert_offsets[e] .. expert_offsets[e+1]-1. moe_unpermute sends row j back to token
a // top_k weighted by weights[a // top_k, a % top_k], summed over the token's rows.
"""

from __future__ import annotations

import torch

from runtime.kernels.activations import softmax
from runtime.kernels.base import input_shape, register, sigmoid


# --------------------------------------------------------------------------- moe_router
def _router_probs(x, gate, use_sigmoid):
    return router_probs(x @ gate.T, use_sigmoid)          # logits [N, E]


def router_probs(logits, use_sigmoid):
    return sigmoid(logits) if use_sigmoid else softmax(logits, -1)


def _assignment_fraction(indices, num_experts, dtype):
    """f_e = (assignments to e) / N: no gradient (counts)."""
    counts = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)
    return counts.to(dtype) / indices.shape[0]


def _moe_router_backward(d_weights, d_stats, x, gate, indices, *, top_k, normalize=True,
                         use_sigmoid=False, **_):
    probs = _router_probs(x, gate, use_sigmoid)           # recomputed
    d_logits = router_d_logits(d_weights, d_stats, probs, indices, normalize, use_sigmoid)
    return [d_logits @ gate, d_logits.T @ x]


def router_d_logits(d_weights, d_stats, probs, indices, normalize=True, use_sigmoid=False):
    """The router logits' gradient from those of its weights and statistics."""
    N = probs.shape[0]
    idx = indices.long()
    d_probs = torch.zeros_like(probs)
    if d_weights is not None:
        p = torch.gather(probs, 1, idx)
        if normalize:                                     # w = p / s, s = sum(p)
            s = p.sum(-1, keepdim=True)
            w = p / s
            d_p = (d_weights - (d_weights * w).sum(-1, keepdim=True)) / s
        else:
            d_p = d_weights
        d_probs = d_probs.scatter_add(1, idx, d_p)
    if d_stats is not None:                               # stats[1] = mean_t probs[t, e]
        d_probs = d_probs + d_stats[1].to(probs.dtype)[None, :] / N
    if use_sigmoid:
        d_logits = d_probs * (probs - probs * probs)
    else:
        d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
    return d_logits


@register("moe_router", ("x", "gate"), ("weights", "indices", "stats"),
          ("d_weights", "d_stats", "x", "gate", "indices"), ("d_x", "d_gate"),
          backward=_moe_router_backward, stats=("stats", "d_stats"))
def _moe_router_forward(x, gate, *, top_k, normalize=True, use_sigmoid=False, **_):
    E = gate.shape[0]
    probs = _router_probs(x, gate, use_sigmoid)
    p, indices = torch.topk(probs, top_k, dim=-1)
    weights = p / p.sum(-1, keepdim=True) if normalize else p
    stats = torch.stack([_assignment_fraction(indices, E, probs.dtype), probs.mean(0)])
    return [weights, indices.to(torch.int32), stats]


# ------------------------------------------------------------------ moe_compute_offsets
@register("moe_compute_offsets", ("indices",), ("expert_offsets",))
def _moe_compute_offsets_forward(indices, *, num_experts, **_):
    return [_offsets(indices, num_experts)]


def _offsets(indices, num_experts):
    counts = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)
    if counts.numel() > num_experts:
        raise ValueError(f"moe_compute_offsets: an index is >= num_experts={num_experts}")
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


# -------------------------------------------------------------------------- moe_permute
def _moe_permute_backward(d_permuted, scatter_indices, **attrs):
    N = input_shape(attrs, "moe_permute", "x")[0]
    top_k = scatter_indices.shape[0] // N
    token = scatter_indices.long() // top_k
    # d_x[t] = sum of the d_permuted rows of t's assignments (moe_unpermute, unit weights)
    d_x = torch.zeros(N, d_permuted.shape[1], dtype=d_permuted.dtype, device=d_permuted.device)
    return [d_x.index_add(0, token, d_permuted)]


@register("moe_permute", ("x", "indices", "expert_offsets"), ("permuted", "scatter_indices"),
          ("d_permuted", "scatter_indices"), ("d_x",), backward=_moe_permute_backward)
def _moe_permute_forward(x, indices, expert_offsets, **_):
    top_k = indices.shape[1]
    order = torch.argsort(indices.reshape(-1).long(), stable=True)   # assignments by expert
    if expert_offsets is not None:
        expected = _offsets(indices, expert_offsets.shape[0] - 1)
        if not torch.equal(expert_offsets.to(torch.int32), expected):
            raise ValueError("moe_permute: expert_offsets do not match indices")
    return [x[order // top_k], order.to(torch.int32)]


# ------------------------------------------------------------------------ moe_unpermute
def _slots(weights, scatter_indices):
    top_k = weights.shape[1]
    a = scatter_indices.long()
    return a // top_k, a % top_k


def _moe_unpermute_backward(d_combined, expert_outputs, weights, scatter_indices, **_):
    token, slot = _slots(weights, scatter_indices)
    d_rows = d_combined[token]                                  # [N * top_k, C]
    d_expert_outputs = weights[token, slot][:, None] * d_rows
    d_flat = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
    d_flat = d_flat.index_add(0, scatter_indices.long(), (d_rows * expert_outputs).sum(-1))
    return [d_expert_outputs, d_flat.reshape(weights.shape)]


@register("moe_unpermute", ("expert_outputs", "weights", "scatter_indices"), ("combined",),
          ("d_combined", "expert_outputs", "weights", "scatter_indices"),
          ("d_expert_outputs", "d_weights"), backward=_moe_unpermute_backward)
def _moe_unpermute_forward(expert_outputs, weights, scatter_indices, **_):
    token, slot = _slots(weights, scatter_indices)
    rows = weights[token, slot][:, None] * expert_outputs
    combined = torch.zeros(weights.shape[0], expert_outputs.shape[1], dtype=rows.dtype,
                           device=rows.device)
    return [combined.index_add(0, token, rows)]
