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

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

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


def _cos(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def _hf_checkpoint(name: str, folder):
    import transformers

    _, prefix, config, _ = MODELS[name]
    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{prefix}Config")(vocab_size=VOCAB,
                                                         max_position_embeddings=T, **config)
    hf_config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{prefix}ForCausalLM")(hf_config)
    with torch.no_grad():  # norms off their init, biases off 0
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_step_matches_transformers_in_bf16(name, tmp_path):
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import export_hf_tensors, load_hf_weights

    path, _, _, settings = MODELS[name]
    hf = _hf_checkpoint(name, tmp_path).to("cuda", torch.bfloat16)
    step = TrainStep.from_module(path, dict(settings, vocab_size=VOCAB, max_seq=T), batch=B,
                                 seq=T, dtype=torch.bfloat16)
    weights = load_hf_weights(step.program.weight_schema, tmp_path, dtype=torch.float32,
                              device="cuda")
    step.load(weights)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7),
                           dtype=torch.int32)
    if name.startswith("phi3"):
        tokens[:, ::9] = 0  # pad tokens: their embedding row gets no gradient
    tokens = tokens.cuda()
    step.set_batch(tokens)
    loss, grads = step.loss_and_gradients()
    hf_loss = hf(input_ids=tokens.long(), labels=tokens.long()).loss
    hf_loss.backward()
    assert abs(float(loss) - float(hf_loss)) / float(hf_loss) < 1e-2
    ours = export_hf_tensors(step.program.weight_schema, {p: g.float() for p, g in grads.items()},
                             gradients=True, layout=weights.layout)
    # transformers 5 names GPT-NeoX's head `lm_head` in memory, `embed_out` in its files
    hf_grads = {("embed_out.weight" if n == "lm_head.weight" and name == "gpt_neox" else n):
                p.grad for n, p in hf.named_parameters()}
    assert ours.keys() == hf_grads.keys()
    worst = min((_cos(ours[n], hf_grads[n]), n) for n in ours)
    assert worst[0] >= 0.999, worst
