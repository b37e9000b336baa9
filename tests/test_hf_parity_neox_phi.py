"""Parity of std GPT-NeoX and Phi-3 with transformers in float64 (issue 18 item 2): the
logits and every parameter gradient of sum(logits * d_logits), 1e-9 relative, on tiny
random checkpoints saved by `save_pretrained`. GPT-NeoX: parallel and sequential residual,
head-interleaved fused QKV, LayerNorms with biases, rotary on a quarter / half of each
head; Phi-3: fused qkv_proj and gate_up_proj loaded as they are, partial rotary, a
sliding window shorter than the sequence, the pad token's embedding row.

HF computes RoPE's cos/sin and RMSNorm in float32 whatever the model's dtype; the same
formulas in float64 are patched in (as tests/test_hf_parity.py does)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.model import Model  # noqa: E402
from tests.test_hf_parity import _relative, _rmsnorm_in_input_dtype  # noqa: E402

F64 = torch.float64
COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              max_position_embeddings=64)
CASES = {  # name: (module, HF prefix, HF config)
    "gpt_neox-parallel": ("std/models/gpt_neox.module", "GPTNeoX", dict(
        num_hidden_layers=2, rotary_pct=0.25, use_parallel_residual=True)),
    "gpt_neox-sequential": ("std/models/gpt_neox.module", "GPTNeoX", dict(
        num_hidden_layers=2, rotary_pct=0.5, rotary_emb_base=500.0,
        use_parallel_residual=False)),
    "phi3": ("std/models/phi3.module", "Phi3", dict(
        num_hidden_layers=2, num_key_value_heads=2, partial_rotary_factor=0.75,
        pad_token_id=0, sliding_window=4)),
}


def _rotary_in_float64(rotary, config):
    """HF's partial RoPE: int(head_dim * partial_rotary_factor) channels, in float64."""
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=F64) / dim)

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(F64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rotary.forward = forward


def _hf_model(case: str, directory):
    _, prefix, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **extra)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():  # weights of a trained size, norms and biases off their init
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(directory)
    if case == "gpt_neox-sequential":  # the hub's spelling (Pythia): read under either name
        path = directory / "config.json"
        saved = json.loads(path.read_text())
        rope = saved.pop("rope_parameters")
        saved.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
        path.write_text(json.dumps(saved))
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            _rotary_in_float64(module, config)
        if type(module).__name__.endswith("RMSNorm"):
            _rmsnorm_in_input_dtype(module)
    return model.to(F64).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(case, tmp_path):
    hf = _hf_model(case, tmp_path)
    ours = Model.from_module(CASES[case][0], hf_weights=tmp_path, dtype=F64)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=generator)
    ids[:, 3] = 0  # Phi-3's pad token: its embedding row gets no gradient
    logits = hf(input_ids=ids).logits
    out = ours.forward(token_ids=ids.to(torch.int32))
    assert _relative(out["logits"], logits.detach()) < 1e-9
    seed = torch.randn(logits.shape, generator=generator, dtype=F64)
    # transformers 5 names GPT-NeoX's head `lm_head` in memory, `embed_out` in its files
    names = ["embed_out.weight" if n == "lm_head.weight" and case.startswith("gpt_neox") else n
             for n, _ in hf.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(logits, list(hf.parameters()), seed)))
    grads = ours.hf_gradients(ours.backward(logits=seed))
    assert set(grads) == set(expected)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < 1e-9, sorted(worst.items(), key=lambda x: -x[1])[:3]
