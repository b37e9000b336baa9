"""RoPE variants (issue 18 item 1) against transformers, in float64: the frequencies and
attention scaling of every rope type against transformers' own ROPE_INIT_FUNCTIONS (run
in float64), the rotated q/k and their backward against transformers' apply functions
(Llama rotate-half, GPT-NeoX partial, GPT-J interleaved), the cos/sin of its rotary
embedding class (float32, as it computes), and a tiny Llama-3.1-style model (llama3 rope)
against LlamaForCausalLM: logits and every gradient (float64; float32 with transformers'
own rotary embedding, unpatched)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import modeling_rope_utils as hf_rope  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from runtime.kernels import KERNELS  # noqa: E402
from tests.test_hf_parity import _relative, _rmsnorm_in_input_dtype  # noqa: E402
from runtime.kernels.rope_freq import device_frequencies, frequencies  # noqa: E402

F64 = torch.float64
D, M = 16, 64  # head dim (hidden 64 / 4 heads), max_position_embeddings
LONG = [1.0 + 0.25 * i for i in range(D // 2)]
SHORT = [1.0 + 0.05 * i for i in range(D // 2)]
# name -> (HF rope_parameters beyond rope_theta, our primitive's params beyond theta)
VARIANTS = {
    "default": ({"rope_type": "default"}, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"factor": 4.0}),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, {"factor": 4.0}),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
             {"factor": 8.0, "original_max_position_embeddings": 16}),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5,
                     "truncate": False},
                    {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
                     "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5, "truncate": False}),
    "yarn_attention": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                        "attention_factor": 1.3},
                       {"factor": 4.0, "original_max_position_embeddings": 16,
                        "attention_factor": 1.3}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
               {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}),
    "longrope": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 16},
                 {"short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 16}),
}
THETA = 10000.0


def _config(name: str, partial: float = 1.0):
    hf, _ = VARIANTS[name]
    params = {"rope_theta": THETA, **hf}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return transformers.LlamaConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=M, rope_parameters=params)


def _attrs(name: str, partial: float = 1.0, interleaved: bool = False) -> dict:
    _, ours = VARIANTS[name]
    kind = VARIANTS[name][0]["rope_type"]
    return {"theta": THETA, "rope_type": kind, "max_position_embeddings": M,
            "partial_rotary_factor": partial, "interleaved": interleaved, **ours}


class _Float64Torch:
    """torch with `float` / `float32` meaning float64: transformers' init functions, run
    under it (and Tensor.float made double), compute their own formulas in float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _hf_frequencies(name: str, seq_len=None, partial: float = 1.0):
    """transformers' (inv_freq, attention_scaling) in float64 (and in its float32)."""
    kind = VARIANTS[name][0]["rope_type"]
    if kind == "default":
        fn = modeling_gpt_neox.GPTNeoXRotaryEmbedding.compute_default_rope_parameters
    else:
        fn = hf_rope.ROPE_INIT_FUNCTIONS[kind]
    fn = getattr(fn, "__func__", fn)
    fn64 = types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()},
                              fn.__name__, fn.__defaults__, fn.__closure__)
    original_float = torch.Tensor.float
    torch.Tensor.float = torch.Tensor.double  # longrope's `arange(..).float()`
    try:
        inv64, scale = fn64(_config(name, partial), device=None, seq_len=seq_len)
    finally:
        torch.Tensor.float = original_float
    inv32, scale32 = fn(_config(name, partial), device=None, seq_len=seq_len)
    assert inv64.dtype == F64 and scale == pytest.approx(scale32)
    return inv64, float(scale), inv32


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("seq_len", [None, 40, 200], ids=["init", "short", "long"])
def test_frequencies_match_transformers(name, seq_len):
    inv_hf, scale_hf, inv32 = _hf_frequencies(name, seq_len)
    inv, scale = frequencies(_attrs(name), D, seq_len)
    assert inv.dtype == F64 and inv.shape == inv_hf.shape
    torch.testing.assert_close(inv, inv_hf, rtol=1e-13, atol=0)
    torch.testing.assert_close(inv.float(), inv32, rtol=1e-6, atol=0)  # its own float32
    assert scale == pytest.approx(scale_hf, rel=1e-14)


def test_the_variants_compute_different_frequencies():
    """No variant is plain RoPE in disguise at these settings (the tests above could not
    tell a variant that does nothing)."""
    plain = frequencies(_attrs("default"), D)[0]
    for name in VARIANTS:
        if name not in ("default", "dynamic"):
            inv, scale = frequencies(_attrs(name), D, 200)
            assert not torch.allclose(inv, plain) or scale != 1.0, name
    assert not torch.allclose(frequencies(_attrs("dynamic"), D, 200)[0], plain)
    torch.testing.assert_close(frequencies(_attrs("dynamic"), D, 40)[0], plain)  # L <= M


@pytest.mark.parametrize("partial", [0.5, 0.25, 0.4])
def test_partial_rotary_frequencies(partial):
    for name in ("default", "llama3", "yarn"):
        inv_hf, scale_hf, _ = _hf_frequencies(name, None, partial)
        inv, scale = frequencies(_attrs(name, partial), D)
        torch.testing.assert_close(inv, inv_hf, rtol=1e-13, atol=0)
        assert scale == pytest.approx(scale_hf, rel=1e-14)


def _positions(B, T, top):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, top, (B, T), generator=g, dtype=torch.int32)


def _hf_rotated(q, k, pos, name, partial=1.0, interleaved=False):
    """transformers' rotation in float64: cos/sin from its float64 frequencies (L =
    max(pos) + 1, as its dynamic_rope_update), applied by Llama's apply_rotary_pos_emb
    (NeoX's with partial rotary; GPT-J's with interleaved pairs)."""
    kind = VARIANTS[name][0]["rope_type"]
    seq_len = int(pos.max()) + 1 if kind in ("dynamic", "longrope") else None
    if kind == "longrope" and seq_len <= 16:
        seq_len = None  # transformers' short factors (its buffer from init)
    inv, scale, _ = _hf_frequencies(name, seq_len, partial)
    freqs = pos.to(F64)[..., None] * inv                     # [B, T, n]
    if interleaved:
        sin, cos = freqs.sin() * scale, freqs.cos() * scale
        rot = modeling_gptj.apply_rotary_pos_emb
        R = 2 * freqs.shape[-1]

        def apply(x):
            xt = x.transpose(1, 2)                              # GPT-J's [B, T, H, D]
            y = torch.cat([rot(xt[..., :R], sin, cos), xt[..., R:]], dim=-1)
            return y.transpose(1, 2)
        return apply(q), apply(k)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    if partial != 1.0:
        return modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)
    return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)


CASES = [(n, 1.0, False) for n in sorted(VARIANTS)] + [
    ("default", 0.5, False), ("llama3", 0.25, False), ("yarn", 0.5, False),
    ("default", 1.0, True), ("default", 0.5, True), ("linear", 0.5, True)]


@pytest.mark.parametrize("name,partial,interleaved", CASES)
@pytest.mark.parametrize("top", [12, 120], ids=["short", "long"])
def test_rope_forward_and_backward_match_transformers(name, partial, interleaved, top):
    B, T = 2, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, D, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(B, 2, T, D, dtype=F64, generator=g, requires_grad=True)
    pos = _positions(B, T, top)
    attrs = _attrs(name, partial, interleaved)
    q_rot, k_rot = KERNELS["rope"].forward([q.detach(), k.detach(), pos], dict(attrs))
    hq, hk = _hf_rotated(q, k, pos, name, partial, interleaved)
    torch.testing.assert_close(q_rot, hq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_rot, hk, rtol=1e-12, atol=1e-12)
    if partial != 1.0:  # the channels past the rotary dim pass through
        R = 2 * ((int(D * partial) + 1) // 2)
        assert torch.equal(q_rot[..., R:], q.detach()[..., R:])
    dq_seed, dk_seed = torch.randn_like(q_rot), torch.randn_like(k_rot)
    eq, ek = torch.autograd.grad((hq * dq_seed).sum() + (hk * dk_seed).sum(), (q, k))
    d_q, d_k = KERNELS["rope"].backward([dq_seed, dk_seed, pos], dict(attrs))
    torch.testing.assert_close(d_q, eq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_k, ek, rtol=1e-12, atol=1e-12)


def test_default_positions_are_0_to_T_minus_1():
    B, T = 2, 6
    q, k = torch.randn(B, 4, T, D, dtype=F64), torch.randn(B, 2, T, D, dtype=F64)
    pos = torch.arange(T, dtype=torch.int32)[None].expand(B, T).contiguous()
    for name in ("dynamic", "longrope", "yarn"):
        attrs = _attrs(name)
        a = KERNELS["rope"].forward([q, k, None], dict(attrs))
        b = KERNELS["rope"].forward([q, k, pos], dict(attrs))
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_cos_sin_match_the_rotary_embedding_class(name):
    """transformers' LlamaRotaryEmbedding (float32, as it computes) against our tables."""
    from runtime.kernels.attention import rope_tables

    config = _config(name)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    pos = _positions(2, 5, 60).long()
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    ours_cos, ours_sin = rope_tables(pos.to(torch.int32), 5, D, _attrs(name), F64, "cpu")
    torch.testing.assert_close(ours_cos[:, 0].float(), cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(ours_sin[:, 0].float(), sin, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_tables_on_the_device_path(name):
    """position_ids given: the sequence length is max + 1, found without a host read."""
    attrs = _attrs(name)
    for top in (10, 100):
        pos = _positions(2, 5, top)
        inv, scale = device_frequencies(attrs, D, 5, pos, "cpu", cache={})
        want, want_scale = frequencies(attrs, D, int(pos.max()) + 1)
        torch.testing.assert_close(inv, want, rtol=1e-14, atol=0)
        assert float(scale) == pytest.approx(want_scale)


@pytest.mark.parametrize("name,partial,interleaved", [("llama3", 1.0, False), ("yarn", 0.5, True)])
def test_qk_norm_rope_is_qk_norm_then_rope(name, partial, interleaved):
    B, T = 2, 5
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 4, T, D, dtype=F64, generator=g)
    k = torch.randn(B, 2, T, D, dtype=F64, generator=g)
    qw = torch.rand(D, dtype=F64, generator=g) + 0.5
    kw = torch.rand(D, dtype=F64, generator=g) + 0.5
    pos = _positions(B, T, 30)
    attrs = _attrs(name, partial, interleaved)
    fused = KERNELS["qk_norm_rope"].forward([q, k, qw, kw, pos], dict(attrs, eps=1e-6))
    q_n, k_n, q_r, k_r = KERNELS["qk_norm"].forward([q, k, qw, kw], {"eps": 1e-6})
    want = KERNELS["rope"].forward([q_n, k_n, pos], dict(attrs))
    torch.testing.assert_close(fused[0], want[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(fused[1], want[1], rtol=1e-13, atol=1e-13)
    seeds = [torch.randn_like(fused[0]), torch.randn_like(fused[1])]
    grads = KERNELS["qk_norm_rope"].backward([*seeds, q, k, qw, kw, fused[2], fused[3], pos],
                                             dict(attrs, eps=1e-6))
    d_n = KERNELS["rope"].backward([*seeds, pos], dict(attrs))
    want_g = KERNELS["qk_norm"].backward([*d_n, q, k, qw, kw, q_r, k_r], {"eps": 1e-6})
    for a, b in zip(grads, want_g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ a tiny Llama-3.1 model
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _llama31(directory, spelling: str, dtype=F64):
    """LlamaForCausalLM with Llama-3.1's rope (the head dim's 4 frequencies: one kept, one
    smoothed, two divided by factor), saved with its config in `spelling`. In float64 its
    rotary embedding then computes transformers' own llama3 frequencies in float64 (and
    its RMSNorm without the float32 upcast); in float32 it runs as transformers has it."""
    import json

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(directory)
    if spelling == "rope_scaling":  # a config.json of transformers 4 (Llama-3.1's as published)
        path = directory / "config.json"
        data = json.loads(path.read_text())
        data["rope_theta"] = data["rope_parameters"].pop("rope_theta")
        data["rope_scaling"] = data.pop("rope_parameters")
        path.write_text(json.dumps(data))
    fn = hf_rope.ROPE_INIT_FUNCTIONS["llama3"]
    fn64 = types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()},
                              fn.__name__, fn.__defaults__, fn.__closure__)
    inv_freq, _ = fn64(config, device=None)
    if dtype != F64:
        return model.to(dtype).eval(), inv_freq

    def forward(x, position_ids):  # HF's rotary forward, without its float32 casts
        freqs = position_ids[..., None].to(F64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    model.model.rotary_emb.forward = forward
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):  # HF upcasts to float32
            _rmsnorm_in_input_dtype(module)
    return model.to(F64).eval(), inv_freq


@pytest.mark.parametrize("spelling, dtype, tolerance", [
    ("rope_parameters", F64, 1e-9), ("rope_scaling", F64, 1e-9),
    ("rope_scaling", torch.float32, 1e-4)], ids=["f64", "f64-rope_scaling", "f32"])
def test_llama31_logits_and_every_gradient_match_transformers(spelling, dtype, tolerance,
                                                              tmp_path):
    from runtime.model import Model

    hf, inv_freq = _llama31(tmp_path, spelling, dtype)
    plain = frequencies({"theta": 500000.0}, 8)[0]
    assert not torch.allclose(inv_freq, plain)  # the scaling changes this model
    ours = Model.from_module("std/models/llama.module", hf_weights=tmp_path, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=generator)
    logits = hf(input_ids=ids).logits
    out = ours.forward(token_ids=ids.to(torch.int32))
    assert _relative(out["logits"], logits.detach()) < tolerance
    seed = torch.randn(logits.shape, generator=generator, dtype=F64).to(dtype)
    names = [n for n, _ in hf.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(logits, list(hf.parameters()), seed)))
    grads = ours.hf_gradients(ours.backward(logits=seed))
    assert set(grads) == set(expected)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < tolerance, sorted(worst.items(), key=lambda x: -x[1])[:3]


def test_qwen3_yarn_matches_transformers_in_float32(tmp_path):
    """Qwen3 with yarn (cos and sin times its attention factor; the fused qk_norm_rope) as
    transformers computes it, float32, logits and every gradient."""
    from runtime.model import Model

    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
            "original_max_position_embeddings": 16}
    config = transformers.Qwen3Config(**SMALL, head_dim=16, rope_parameters=yarn)
    config._attn_implementation = "sdpa"
    hf = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    hf.save_pretrained(tmp_path)
    assert hf.model.rotary_emb.attention_scaling > 1.0  # the scaling is in play
    ours = Model.from_module("std/models/qwen3.module", hf_weights=tmp_path, dtype=torch.float32)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    logits = hf(input_ids=ids).logits
    assert _relative(ours.forward(token_ids=ids.to(torch.int32))["logits"], logits.detach()) < 1e-4
    seed = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    expected = dict(zip([n for n, _ in hf.named_parameters()],
                        torch.autograd.grad(logits, list(hf.parameters()), seed)))
    grads = ours.hf_gradients(ours.backward(logits=seed))
    assert set(grads) == set(expected)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda x: -x[1])[:3]
