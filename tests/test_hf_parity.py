"""Parity with HuggingFace transformers on tiny random models saved by `save_pretrained`:
std llama, qwen2 (q/k/v biases, tied head), qwen3, gemma (`(1 + w)` norms, GeGLU tanh,
sqrt(d) embedding scale, tied head, padding_idx), mistral (sliding window) and mixtral
against their `*ForCausalLM`, the logits and every parameter gradient, in float64 (1e-9
relative) and float32 (1e-4).

Our gradients are seeded with a random d_logits and exported under HF names; HF's are
autograd of sum(logits * d_logits)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.model import Model  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": ("std/models/llama.module", "LlamaConfig", "LlamaForCausalLM",
              dict(rope_theta=500000.0)),
    "qwen3": ("std/models/qwen3.module", "Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=16, rms_norm_eps=1e-6)),
    "qwen2": ("std/models/qwen2.module", "Qwen2Config", "Qwen2ForCausalLM",
              dict(rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "gemma": ("std/models/gemma.module", "GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=64, head_dim=32, pad_token_id=5)),
    "mistral": ("std/models/mistral.module", "MistralConfig", "MistralForCausalLM",
                dict(sliding_window=3)),
    "mixtral": ("std/models/mixtral.module", "MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0)),
}
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            activation_function="gelu_new")
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def _hf_model(name: str, directory, dtype):
    _, config_class, model_class, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**(SMALL | extra))
    config._attn_implementation = "sdpa"  # eager attention softmaxes in float32
    config._experts_implementation = "eager"  # grouped_mm has no float64
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # weights of a trained size, not init's 0.02: gradients matter
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(directory)
    if dtype == torch.float64:
        _rotary_in_float64(model.model.rotary_emb, config)
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                _rmsnorm_in_input_dtype(module, 1.0 if name == "gemma" else 0.0)
            if type(module).__name__.endswith("TopKRouter"):
                _router_in_input_dtype(module)
    return model.to(dtype).eval()


def _rmsnorm_in_input_dtype(norm, offset: float = 0.0):
    """HF's RMSNorm upcasts to float32 (`.to(torch.float32)`), which in a float64 model
    rounds to float32; the same formula without the cast (Gemma's: `(1 + w)`)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

    def forward(hidden):
        rstd = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        return (hidden * rstd) * (offset + norm.weight)
    norm.forward = forward


def _router_in_input_dtype(router):
    """Mixtral's router softmaxes `router_logits.float()`: the same without the cast."""
    def forward(hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index
    router.forward = forward


def _rotary_in_float64(rotary, config):
    """HF computes RoPE's cos/sin in float32 whatever the model's dtype (`.float()` in
    its forward); our float64 mode is exact, so compare with HF's formula in float64."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rotary.forward = forward


def _checkpoint_names(grads: dict) -> dict:
    """HF's in-memory names as in its checkpoint files: transformers 5 holds Mixtral's
    experts fused (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]) but writes
    (and our hf_mapping reads) `block_sparse_moe.experts.{e}.w1/w3/w2.weight`."""
    out = {}
    for name, grad in grads.items():
        layer, _, rest = name.partition(".mlp.")
        if rest == "gate.weight":
            out[f"{layer}.block_sparse_moe.gate.weight"] = grad
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            for e, part in enumerate(grad):
                prefix = f"{layer}.block_sparse_moe.experts.{e}"
                if rest.endswith("down_proj"):
                    out[f"{prefix}.w2.weight"] = part
                else:
                    out[f"{prefix}.w1.weight"], out[f"{prefix}.w3.weight"] = part.chunk(2)
        else:
            out[name] = grad
    return out


def _relative(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_every_gradient_match_transformers(name, dtype, tmp_path):
    hf = _hf_model(name, tmp_path, dtype)
    ours = Model.from_module(MODELS[name][0], hf_weights=tmp_path, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7), generator=generator)
    if hf.config.pad_token_id is not None:  # a padding token among the ids (Gemma's)
        ids[0, 1] = hf.config.pad_token_id
    logits = hf(input_ids=ids).logits
    out = ours.forward(token_ids=ids.to(torch.int32))
    assert _relative(out["logits"], logits.detach()) < TOLERANCE[dtype]
    seed = torch.randn(logits.shape, generator=generator, dtype=torch.float64).to(dtype)
    expected = _checkpoint_names(dict(zip(
        [n for n, _ in hf.named_parameters()],
        torch.autograd.grad(logits, list(hf.parameters()), seed))))
    grads = ours.hf_gradients(ours.backward(logits=seed))
    assert set(grads) == set(expected)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < TOLERANCE[dtype], sorted(worst.items(), key=lambda x: -x[1])[:3]


def test_gpt2_logits_and_every_gradient_match_transformers(dtype, tmp_path):
    """std/models/gpt2.module (LayerNorms with biases, Conv1D weights transposed on load,
    the LM head tied to wte) against GPT2LMHeadModel."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**GPT2)
    config._attn_implementation = "sdpa"
    hf = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    hf.save_pretrained(tmp_path)
    hf = hf.to(dtype).eval()
    ours = Model.from_module("std/models/gpt2.module", hf_weights=tmp_path, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2["vocab_size"], (2, 7), generator=generator)
    positions = torch.arange(7).repeat(2, 1)
    logits = hf(input_ids=ids, position_ids=positions).logits
    out = ours.forward(token_ids=ids.to(torch.int32), position_ids=positions.to(torch.int32))
    assert _relative(out["logits"], logits.detach()) < TOLERANCE[dtype]
    seed = torch.randn(logits.shape, generator=generator, dtype=torch.float64).to(dtype)
    names = [n for n, _ in hf.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(logits, list(hf.parameters()), seed)))
    grads = ours.hf_gradients(ours.backward(logits=seed))
    assert set(expected) <= set(grads)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < TOLERANCE[dtype], sorted(worst.items(), key=lambda x: -x[1])[:3]
