"""The GPU training step of std's GPT-NeoX and Phi-3 against transformers in bf16
(`-m cuda`; skipped without CUDA): one step's loss within 1e-2 relative and every
parameter gradient's cosine >= 0.999, on the same weights and batch (as
tests/test_cuda_std_models.py). GPT-NeoX: parallel residual, head-interleaved QKV, rotary
on a quarter of each head (Pythia's rotary_pct); Phi-3: fused qkv / gate_up, partial
rotary 0.75, a sliding window shorter than T, pad tokens in the batch, and with the 128k
checkpoints' longrope (long factors: T above original_max_position_embeddings)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.bf16_parity import (  # noqa: E402
    cosine, hf_loss_and_gradients, step_gradients, tiny_hf_checkpoint,
)
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

B, T, VOCAB = 2, 128, 512
# Phi-3 longrope: 256 / 4 * 0.75 = 48 rotary channels, 24 frequencies
SHORT = [1.0 + 0.05 * i for i in range(24)]
LONG = [1.0 + 0.5 * i for i in range(24)]
MODELS = {  # name: (module, HF prefix, HF config, our settings)
    "gpt_neox": ("std/models/gpt_neox.module", "GPTNeoX",
                 dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=1024, rotary_pct=0.25),
                 dict(d_model=256, n_layers=2, num_heads=4, d_ff=1024,
                      partial_rotary_factor=0.25)),
    "phi3": ("std/models/phi3.module", "Phi3",
             dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=512, partial_rotary_factor=0.75,
                  sliding_window=64, pad_token_id=0),
             dict(d_model=256, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=512,
                  partial_rotary_factor=0.75, window_size=64, padding_idx=0)),
    # the 128k checkpoints' longrope: T = 128 > original 64, so both sides use long_factor
    "phi3-longrope": ("std/models/phi3.module", "Phi3",
                      dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=512,
                           partial_rotary_factor=0.75, sliding_window=64, pad_token_id=0,
                           original_max_position_embeddings=64,
                           rope_scaling=dict(type="longrope", short_factor=SHORT,
                                             long_factor=LONG)),
                      dict(d_model=256, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=512,
                           partial_rotary_factor=0.75, window_size=64, padding_idx=0,
                           rope_type='"longrope"', rope_original_max_seq=64,
                           rope_short_factor=SHORT, rope_long_factor=LONG)),
}


def _hf_checkpoint(name: str, folder):
    _, prefix, config, _ = MODELS[name]
    return tiny_hf_checkpoint(folder, f"{prefix}Config", f"{prefix}ForCausalLM",
                              vocab_size=VOCAB, max_position_embeddings=T, **config)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_step_matches_transformers_in_bf16(name, tmp_path):
    path, _, _, settings = MODELS[name]
    hf = _hf_checkpoint(name, tmp_path).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7),
                           dtype=torch.int32)
    if name.startswith("phi3"):
        tokens[:, ::9] = 0  # pad tokens: their embedding row gets no gradient
    loss, ours = step_gradients(path, dict(settings, vocab_size=VOCAB, max_seq=T), tmp_path,
                                tokens)
    # transformers 5 names GPT-NeoX's head `lm_head` in memory, `embed_out` in its files
    hf_loss, hf_grads = hf_loss_and_gradients(
        hf, tokens, lambda n: "embed_out.weight" if n == "lm_head.weight" and
        name == "gpt_neox" else n)
    assert abs(loss - hf_loss) / hf_loss < 1e-2
    assert ours.keys() == hf_grads.keys()
    worst = min((cosine(ours[n], hf_grads[n]), n) for n in ours)
    assert worst[0] >= 0.999, worst
