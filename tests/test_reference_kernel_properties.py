"""The reference kernels (runtime/kernels): properties a random-case comparison cannot show
(GQA and sliding windows, rotations, round trips, dtype policy, missing gradients)."""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `runtime` is not installed

from runtime.kernels import KERNELS, default_attrs  # noqa: E402

from kernel_testing import F64, I32, assert_close, randn, topk_indices  # noqa: E402


def _run(name, inputs, **params):
    return KERNELS[name].forward(inputs, default_attrs(name, **params))


def test_flash_attention_gqa_is_attention_with_repeated_kv():
    g = torch.Generator().manual_seed(3)
    q, k, v = randn(g, 2, 4, 6, 8), randn(g, 2, 2, 6, 8), randn(g, 2, 2, 6, 8)
    out, lse = _run("flash_attention", [q, k, v, None], window_size=4)
    rep_out, rep_lse = _run("flash_attention", [q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                None], window_size=4)
    assert_close(out, rep_out, 1e-14, "out")
    assert_close(lse, rep_lse, 1e-14, "lse")
    # heads 0 and 1 read kv head 0, heads 2 and 3 kv head 1 (h // (Hq / Hkv))
    single, _ = _run("flash_attention", [q[:, 1:2], k[:, 0:1], v[:, 0:1], None], window_size=4)
    assert_close(out[:, 1:2], single, 1e-14, "head 1")


def test_flash_attention_window_keeps_the_last_window_keys():
    """With v = one-hot of the key position, out[i] is the attention distribution: query i
    attends to exactly keys max(0, i - w + 1) .. i."""
    T, w = 7, 3
    q = torch.zeros(1, 1, T, T, dtype=F64)
    k = torch.zeros(1, 1, T, T, dtype=F64)
    v = torch.eye(T, dtype=F64)[None, None]
    out, lse = _run("flash_attention", [q, k, v, None], window_size=w)
    for i in range(T):
        seen = [j for j in range(T) if out[0, 0, i, j] > 0]
        assert seen == list(range(max(0, i - w + 1), i + 1))
        assert math.isclose(lse[0, 0, i].item(), math.log(len(seen)), rel_tol=1e-12)


def test_rope_is_a_rotation_and_relative():
    g = torch.Generator().manual_seed(4)
    q, k = randn(g, 1, 2, 5, 8), randn(g, 1, 2, 5, 8)
    q_rot, k_rot = _run("rope", [q, k, None])
    assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), 1e-13, "norm")
    # q_i . k_j depends on i - j only: shift all positions by 11
    shifted = torch.arange(5, dtype=I32)[None] + 11
    q_s, k_s = _run("rope", [q, k, shifted])
    assert_close(q_s @ k_s.transpose(-1, -2), q_rot @ k_rot.transpose(-1, -2), 1e-12, "scores")



def _qk_norm_rope_inputs(g):
    """GQA (4 query heads, 2 kv heads), positions per batch row."""
    return [randn(g, 2, 4, 5, 8), randn(g, 2, 2, 5, 8), randn(g, 8), randn(g, 8),
            torch.randint(0, 100, (2, 5), generator=g).to(I32)]


def test_qk_norm_rope_is_qk_norm_then_rope():
    """The fused op's forward and backward are the unfused pair's (float64: exact up to
    rounding), the attention module's two branches."""
    g = torch.Generator().manual_seed(9)
    q, k, qw, kw, pos = _qk_norm_rope_inputs(g)
    attrs = default_attrs("qk_norm_rope", eps=1e-5, theta=500.0)
    fused = KERNELS["qk_norm_rope"].forward([q, k, qw, kw, pos], attrs)
    q_n, k_n, q_rstd, k_rstd = _run("qk_norm", [q, k, qw, kw], eps=1e-5)
    pair = [*_run("rope", [q_n, k_n, pos], theta=500.0), q_rstd, k_rstd]
    assert_close(fused, pair, 1e-14, "forward")
    d_rot = [randn(g, *q.shape), randn(g, *k.shape)]
    got = KERNELS["qk_norm_rope"].backward([*d_rot, q, k, qw, kw, q_rstd, k_rstd, pos], attrs)
    d_n = KERNELS["rope"].backward([*d_rot, pos], default_attrs("rope", theta=500.0))
    want = KERNELS["qk_norm"].backward([*d_n, q, k, qw, kw, q_rstd, k_rstd],
                                       default_attrs("qk_norm", eps=1e-5))
    assert_close(got, want, 1e-14, "backward")


def test_qk_norm_rope_backward_by_finite_differences():
    """<d_out, f(x + h e) - f(x - h e)> / 2h against <d_in, e> for random directions e of
    every differentiable input (central differences, float64)."""
    g = torch.Generator().manual_seed(10)
    kernel = KERNELS["qk_norm_rope"]
    inputs = _qk_norm_rope_inputs(g)
    attrs = default_attrs("qk_norm_rope", theta=10000.0)
    q_rot, k_rot, q_rstd, k_rstd = kernel.forward(inputs, attrs)
    d_out = [randn(g, *q_rot.shape), randn(g, *k_rot.shape)]
    grads = kernel.backward([*d_out, *inputs[:4], q_rstd, k_rstd, inputs[4]], attrs)

    def loss(xs):
        a, b, _, _ = kernel.forward(xs + inputs[4:], attrs)
        return float((a * d_out[0]).sum() + (b * d_out[1]).sum())

    h = 1e-6
    for i, grad in enumerate(grads):
        e = randn(g, *inputs[i].shape)
        plus = [x + h * e if j == i else x for j, x in enumerate(inputs[:4])]
        minus = [x - h * e if j == i else x for j, x in enumerate(inputs[:4])]
        numeric = (loss(plus) - loss(minus)) / (2 * h)
        analytic = float((grad * e).sum())
        assert math.isclose(numeric, analytic, rel_tol=1e-6, abs_tol=1e-8), (i, numeric, analytic)

def test_moe_permute_unpermute_round_trip():
    g = torch.Generator().manual_seed(5)
    N, E, K, C = 9, 4, 2, 3
    x, indices = randn(g, N, C), topk_indices(g, N, E, K)
    offsets, = _run("moe_compute_offsets", [indices], num_experts=E)
    permuted, scatter = _run("moe_permute", [x, indices, offsets])
    assert scatter.dtype == I32 and sorted(scatter.tolist()) == list(range(N * K))
    flat = indices.reshape(-1)
    for e in range(E):  # rows offsets[e] .. offsets[e+1]-1 are expert e's, in token order
        rows = scatter[offsets[e]:offsets[e + 1]].long()
        assert (flat[rows] == e).all() and rows.tolist() == sorted(rows.tolist())
    assert_close(permuted, x[scatter.long() // K], 0, "permuted")
    weights = torch.rand(N, K, generator=g, dtype=F64)
    weights = weights / weights.sum(-1, keepdim=True)
    combined, = _run("moe_unpermute", [permuted, weights, scatter])
    assert_close(combined, x, 1e-14, "round trip (weights sum to 1)")
    ones, = _run("moe_unpermute", [permuted, torch.ones(N, K, dtype=F64), scatter])
    assert_close(ones, K * x, 1e-14, "round trip (unit weights)")
    # moe_permute's backward is moe_unpermute with unit weights
    d_x, = KERNELS["moe_permute"].backward([permuted, scatter], {"input_shapes": {"x": [N, C]}})
    assert_close(d_x, ones, 1e-14, "moe_permute backward")


def test_grouped_gemm_is_per_group_matmul():
    g = torch.Generator().manual_seed(6)
    offsets = torch.tensor([0, 2, 2, 5], dtype=I32)
    x, w = randn(g, 5, 4), randn(g, 3, 6, 4)
    out, = _run("grouped_gemm", [x, w, offsets])
    for e, (lo, hi) in enumerate([(0, 2), (2, 2), (2, 5)]):
        assert_close(out[lo:hi], x[lo:hi] @ w[e].T, 1e-14, f"group {e}")
    out_nn, = _run("grouped_gemm", [x, w.transpose(1, 2).contiguous(), offsets], transpose="NN")
    assert_close(out_nn, out, 1e-14, "NN with W^T")


def test_moe_router_statistics_and_normalization():
    g = torch.Generator().manual_seed(7)
    x, gate = randn(g, 16, 8), randn(g, 5, 8)
    weights, indices, stats = _run("moe_router", [x, gate], top_k=2)
    assert_close(weights.sum(-1), torch.ones(16, dtype=F64), 1e-14, "normalized")
    probs = torch.softmax(x @ gate.T, -1)
    f = torch.stack([(indices == e).sum() for e in range(5)]).to(F64) / 16
    assert stats.shape == (2, 5)  # fraction of assignments, mean probability per expert
    assert_close(stats[0], f, 1e-15, "fractions")
    assert_close(stats[1], probs.mean(0), 1e-14, "mean probabilities")
    assert (torch.gather(probs, 1, indices.long()) >= probs.topk(2, -1).values[:, -1:]).all()


@pytest.mark.parametrize("name", ["fused_residual_rmsnorm", "fused_residual_layernorm"])
def test_fused_residual_norms_write_one_gradient(name):
    g = torch.Generator().manual_seed(8)
    kernel = KERNELS[name]
    r, i, w = randn(g, 3, 8), randn(g, 3, 8), randn(g, 8)
    extra = [randn(g, 8)] if name == "fused_residual_layernorm" else []  # the bias
    residual_out, y, *stats = kernel.forward([r, i, w, *extra], default_attrs(kernel.name))
    d_residual, d_input, *_ = kernel.backward(
        [randn(g, 3, 8), randn(g, 3, 8), residual_out, w, *stats], default_attrs(kernel.name))
    assert d_residual is d_input


def test_dtype_policy_in_bfloat16():
    g = torch.Generator().manual_seed(9)
    logits = randn(g, 4, 10).to(torch.bfloat16)
    labels = torch.tensor([1, -100, 3, 9], dtype=I32)
    loss, lse = _run("cross_entropy", [logits, labels])
    assert loss.dtype == lse.dtype == torch.float32 and loss[1] == 0
    y, rstd = _run("rmsnorm", [randn(g, 4, 8).to(torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)])
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    values, indices = _run("reduce_max", [randn(g, 3, 4).to(torch.bfloat16)], dim=-1)
    assert values.dtype == torch.bfloat16 and indices.dtype == I32


def test_reduce_max_points_at_the_first_maximum():
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], dtype=F64)
    values, indices = _run("reduce_max", [x], dim=-1)
    assert indices.tolist() == [1, 0] and values.tolist() == [3.0, 2.0]


def test_default_attrs():
    assert default_attrs("matmul") == {"transpose": "NN", "accumulate": False, "alpha": 1.0, "beta": 0.0}
    assert default_attrs("grouped_gemm")["transpose"] == "NT"
    assert default_attrs("concat") == {"dim": -1}
    with pytest.raises(KeyError):
        default_attrs("moe_router")  # top_k has no default
    with pytest.raises(KeyError):
        default_attrs("rmsnorm", epsilon=1.0)


def test_signature_names_match_the_kernel_functions():
    """The kernel functions take the signature's inputs positionally, in order."""
    def positional(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind == p.POSITIONAL_OR_KEYWORD]
    for name, kernel in KERNELS.items():
        assert len(positional(kernel.forward_fn)) == len(kernel.forward_inputs), name
        if kernel.backward_fn is not None:
            assert len(positional(kernel.backward_fn)) == len(kernel.backward_inputs), name


def test_gradients_that_are_not_there():
    g = torch.Generator().manual_seed(10)
    # split: a part without gradient counts as zeros
    d_x, = KERNELS["split"].backward([[randn(g, 2, 2), None, randn(g, 2, 4)]],
                                     {"sizes": [2, 3, 4], "dim": -1, "input_shapes": {"x": [2, 9]}})
    assert d_x.shape == (2, 9) and (d_x[:, 2:5] == 0).all()
    # moe_router: unused statistics (or weights) have no gradient
    x, gate = randn(g, 6, 4), randn(g, 3, 4)
    attrs = default_attrs("moe_router", top_k=2)
    weights, indices, stats = KERNELS["moe_router"].forward([x, gate], attrs)
    d_w = randn(g, 6, 2)
    only_w = KERNELS["moe_router"].backward([d_w, None, x, gate, indices], attrs)
    both = KERNELS["moe_router"].backward([d_w, torch.zeros(2, 3, dtype=F64), x, gate, indices],
                                          attrs)
    for a, b in zip(only_w, both):
        assert_close(a, b, 1e-15, "d_stats None is zero")


def test_gradient_has_its_inputs_dtype():
    """bf16 activations with an fp32 weight: d_x is bf16, d_weight fp32."""
    g = torch.Generator().manual_seed(11)
    x, w = randn(g, 3, 8).to(torch.bfloat16), randn(g, 8).to(torch.float32)
    kernel = KERNELS["rmsnorm"]
    y, rstd = kernel.forward([x, w], default_attrs("rmsnorm"))
    d_x, d_w = kernel.backward([y, x, w, rstd], default_attrs("rmsnorm"))
    assert y.dtype == d_x.dtype == torch.bfloat16 and d_w.dtype == torch.float32
