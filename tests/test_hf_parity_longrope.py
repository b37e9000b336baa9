"""Phi-3 with the 128k checkpoints' longrope scaling (issue 18 item 2) against transformers'
Phi3ForCausalLM in float64: the logits and every parameter gradient of sum(logits *
d_logits), 1e-9 relative, below and above original_max_position_embeddings.

transformers picks the factors per call (`dynamic_rope_update`'s longrope branch): L =
max(position_ids) + 1, long_factor when L > original_max_position_embeddings, else
short_factor; the attention scaling is sqrt(1 + ln(M / original) / ln(original)) (M =
max_position_embeddings). Phi-3's top-level `original_max_position_embeddings` is the one
it reads. HF computes cos/sin in float32; the patched rotary runs HF's own forward (its
choice of factors) and returns the same formula in float64 after checking that the two
agree to float32 precision, so a wrong choice on either side fails the test."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.model import Model  # noqa: E402
from tests.test_hf_parity import _relative, _rmsnorm_in_input_dtype  # noqa: E402

F64 = torch.float64
ORIGINAL = 4
# head_dim 16, partial 0.75: 12 rotary channels, 6 frequencies
SHORT = [1.0, 1.1, 1.3, 1.6, 2, 2.5]
LONG = [1.5, 2.0, 3.5, 5.0, 8.0, 12.0]
CONFIG = dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_attention_heads=2,
              num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=16,
              original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
              pad_token_id=0, sliding_window=None,
              rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})


def _longrope_in_float64(rotary, config, choices: list):
    hf_forward = rotary.forward
    rope = config.rope_parameters
    dim = int(config.hidden_size // config.num_attention_heads * rope["partial_rotary_factor"])
    factor = config.max_position_embeddings / ORIGINAL
    scaling = math.sqrt(1 + math.log(factor) / math.log(ORIGINAL))
    assert rotary.attention_scaling == pytest.approx(scaling, rel=1e-12)
    plain = rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=F64) / dim)

    def forward(x, position_ids):
        cos32, sin32 = hf_forward(x, position_ids)
        long = int(position_ids.max()) + 1 > ORIGINAL
        choices.append(long)
        inv_freq = 1.0 / (torch.tensor(LONG if long else SHORT, dtype=F64) * plain)
        freqs = position_ids[..., None].to(F64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * scaling, angles.sin() * scaling
        assert (cos - cos32).abs().max() < 1e-5 and (sin - sin32).abs().max() < 1e-5
        return cos.to(x.dtype), sin.to(x.dtype)
    rotary.forward = forward


def _hf_model(directory, choices: list):
    torch.manual_seed(0)
    config = transformers.Phi3Config(**CONFIG)
    config._attn_implementation = "sdpa"
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(directory)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            _longrope_in_float64(module, config, choices)
        if type(module).__name__.endswith("RMSNorm"):
            _rmsnorm_in_input_dtype(module)
    return model.to(F64).eval()


def test_longrope_phi3_matches_transformers_below_and_above_the_original_length(tmp_path):
    choices: list = []
    hf = _hf_model(tmp_path, choices)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["original_max_position_embeddings"] == ORIGINAL
    ours = Model.from_module("std/models/phi3.module", hf_weights=tmp_path, dtype=F64)
    generator = torch.Generator().manual_seed(1)
    for T, long in ((ORIGINAL - 1, False), (ORIGINAL, False), (ORIGINAL + 3, True)):
        choices.clear()
        ids = torch.randint(1, CONFIG["vocab_size"], (2, T), generator=generator)
        ids[:, 1] = 0  # the pad token's embedding row gets no gradient
        logits = hf(input_ids=ids).logits
        assert choices == [long]
        out = ours.forward(token_ids=ids.to(torch.int32))
        assert _relative(out["logits"], logits.detach()) < 1e-9, T
        seed = torch.randn(logits.shape, generator=generator, dtype=F64)
        names = [n for n, _ in hf.named_parameters()]
        expected = dict(zip(names, torch.autograd.grad(logits, list(hf.parameters()), seed)))
        grads = ours.hf_gradients(ours.backward(logits=seed))
        assert set(grads) == set(expected)
        worst = {n: _relative(grads[n], expected[n]) for n in expected}
        assert max(worst.values()) < 1e-9, (T, sorted(worst.items(), key=lambda x: -x[1])[:3])
