"""The GPU training step of std's Qwen2, Gemma and GPT-2 against transformers in bf16
(`-m cuda`; skipped without CUDA): one step's loss within 1e-2 relative of transformers'
fp32 loss and every parameter gradient as tests/bf16_parity.py says (cosine >= 0.999 with
transformers' fp32 gradient, or no further from it than twice transformers' own bf16
run), on the same weights and batch (as
tests/test_cuda_train.py does for Llama). Gemma's shape has d_model 320 (sqrt is not a
bf16 number: the normalizer is rounded as HF rounds it), head_dim 64 with 4 query heads
sharing 1 K/V head (q width 256 != d_model, as Gemma-7B's), and padding tokens in the
batch; Qwen2's q/k/v biases and GPT-2's tied head and position ids are trained."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.bf16_parity import far_gradients, fp32_and_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

B, T, VOCAB = 2, 128, 512
MODELS = {  # name: (module, HF config class, HF model class, HF config, our settings)
    "qwen2": ("std/models/qwen2.module", "Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, intermediate_size=512, rms_norm_eps=1e-6),
              # transformers' Qwen2Config defaults to theta 1e4; std Qwen2's default is
              # Qwen2.5's 1e6 (the step is built from settings, not from config.json)
              dict(d_model=256, n_layers=2, num_heads=8, num_kv_heads=2, d_ff=512, eps=1e-6,
                   rope_theta=10000.0)),
    "gemma": ("std/models/gemma.module", "GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=320, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=64, intermediate_size=512,
                   rms_norm_eps=1e-6, pad_token_id=0),
              dict(d_model=320, n_layers=2, num_heads=4, num_kv_heads=1, head_dim=64, d_ff=512,
                   eps=1e-6, padding_idx=0)),
    "gpt2": ("std/models/gpt2.module", "GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=256, n_layer=2, n_head=8, n_positions=T),
             dict(d_model=256, n_layers=2, num_heads=8)),
}


def _hf_checkpoint(name: str, folder):
    import transformers

    _, config_class, model_class, config, _ = MODELS[name]
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB) | ({} if name == "gpt2" else dict(max_position_embeddings=T))
    hf_config = getattr(transformers, config_class)(**sizes, **config)
    hf_config._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(hf_config).eval()  # GPT-2's dropout off
    with torch.no_grad():  # norms off their init (Gemma's 0, others' 1), biases off 0
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def _tokens(name: str):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (B, T), generator=g, dtype=torch.int32)
    if name == "gemma":
        tokens[:, ::9] = 0  # padding tokens: the embedding's row 0 gets the head's gradient only
    return tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_step_matches_transformers_in_bf16(name, tmp_path):
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import export_hf_tensors, load_hf_weights

    path, *_, settings = MODELS[name]
    hf32, hf = fp32_and_bf16(_hf_checkpoint(name, tmp_path))
    step = TrainStep.from_module(path, dict(settings, vocab_size=VOCAB, max_seq=T), batch=B,
                                 seq=T, dtype=torch.bfloat16)
    weights = load_hf_weights(step.program.weight_schema, tmp_path, dtype=torch.float32,
                              device="cuda")
    step.load(weights)
    tokens = _tokens(name).cuda()
    step.set_batch(tokens)
    loss, grads = step.loss_and_gradients()
    for model in (hf, hf32):
        model(input_ids=tokens.long(), labels=tokens.long()).loss.backward()
    fp32_loss = float(hf32(input_ids=tokens.long(), labels=tokens.long()).loss)
    assert abs(float(loss) - fp32_loss) / fp32_loss < 1e-2
    ours = export_hf_tensors(step.program.weight_schema, {p: g.float() for p, g in grads.items()},
                             gradients=True, layout=weights.layout)
    bf16, fp32 = ({n: p.grad for n, p in m.named_parameters()} for m in (hf, hf32))
    assert ours.keys() == fp32.keys()
    assert not far_gradients(ours, bf16, fp32)
