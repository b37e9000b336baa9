"""Parity of std Qwen3-MoE and Mixtral with transformers in float64, the load-balancing
loss included (issue 18 items 2 and 4): logits, `aux_loss`, and every parameter
gradient of sum(logits * d_logits) + router_aux_loss_coef * aux_loss, with
output_router_logits=True. Qwen3-MoE with decoder_sparse_step 1 (every layer sparse,
norm_topk_prob false) and 2 (dense and sparse layers alternate, norm_topk_prob true).

HF computes the router softmax and the load-balancing statistics in float32 whatever the
model's dtype; the same formulas without those casts are patched in (as test_hf_parity
does for RMSNorm and RoPE)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.model import Model  # noqa: E402
from tests.test_hf_parity import _relative, _rmsnorm_in_input_dtype  # noqa: E402

F64 = torch.float64
COEF = 0.3
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True,
             router_aux_loss_coef=COEF, num_experts_per_tok=2)
CASES = {
    "qwen3_moe-every-layer": ("std/models/qwen3_moe.module", "Qwen3Moe", dict(
        num_hidden_layers=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
        norm_topk_prob=False, decoder_sparse_step=1)),
    "qwen3_moe-every-2nd": ("std/models/qwen3_moe.module", "Qwen3Moe", dict(
        num_hidden_layers=4, head_dim=8, moe_intermediate_size=16, num_experts=4,
        norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("std/models/mixtral.module", "Mixtral", dict(
        num_hidden_layers=2, num_local_experts=4)),
}


def _rotary_in_float64(rotary, config):
    """HF's RoPE cos/sin (computed in float32 by HF) in float64."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=F64) / dim)

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(F64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rotary.forward = forward


def _router_in_input_dtype(router):
    """The top-k router without its float32 softmax; norm_topk_prob as configured."""
    normalize = getattr(router, "norm_topk_prob", True)

    def forward(hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True) if normalize else top, index
    router.forward = forward


def _balance_loss_in_input_dtype(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (no mask) with its float32 sums in the
    logits' dtype."""
    logits = torch.cat(list(gate_logits), dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    counts = torch.nn.functional.one_hot(selected, num_experts).sum(dim=(0, 1)).to(probs.dtype)
    return torch.sum(counts / logits.shape[0] * probs.mean(0)) * num_experts


def _hf_model(case: str, directory, monkeypatch):
    _, prefix, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**SMALL, **extra)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(directory)
    _rotary_in_float64(model.model.rotary_emb, config)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            _rmsnorm_in_input_dtype(module)
        if type(module).__name__.endswith("TopKRouter"):
            _router_in_input_dtype(module)
    monkeypatch.setattr(sys.modules[type(model).__module__], "load_balancing_loss_func",
                        _balance_loss_in_input_dtype)
    return model.to(F64).eval()


def _checkpoint_names(grads: dict, experts: str, parts: tuple) -> dict:
    """transformers 5 holds the experts fused (`mlp.experts.gate_up_proj` [E, 2F, D],
    `down_proj` [E, D, F]) but writes one tensor per expert: `{experts}.{e}.{gate}` etc."""
    out = {}
    for name, grad in grads.items():
        layer, _, rest = name.partition(".mlp.")
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            for e, part in enumerate(grad):
                prefix = f"{layer}.{experts}.{e}"
                if rest.endswith("down_proj"):
                    out[f"{prefix}.{parts[2]}.weight"] = part
                else:
                    gate, up = part.chunk(2)
                    out[f"{prefix}.{parts[0]}.weight"], out[f"{prefix}.{parts[1]}.weight"] = gate, up
        elif rest == "gate.weight" and experts.startswith("block_sparse_moe"):
            out[f"{layer}.block_sparse_moe.gate.weight"] = grad
        else:
            out[name] = grad
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_aux_loss_and_every_gradient_match_transformers(case, tmp_path, monkeypatch):
    hf = _hf_model(case, tmp_path, monkeypatch)
    ours = Model.from_module(CASES[case][0], hf_weights=tmp_path, dtype=F64)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7), generator=generator)
    result = hf(input_ids=ids)
    out = ours.forward(token_ids=ids.to(torch.int32))
    assert _relative(out["logits"], result.logits.detach()) < 1e-9
    # our aux_loss is the term HF adds to its loss: the coefficient times its aux_loss
    assert abs(float(out["aux_loss"]) - COEF * float(result.aux_loss.detach())) < 1e-12
    assert float(result.aux_loss.detach()) > 1.0  # a live loss (E * sum f P >= 1 for these routings)
    seed = torch.randn(result.logits.shape, generator=generator, dtype=F64)
    total = (result.logits * seed).sum() + COEF * result.aux_loss
    names = [n for n, _ in hf.named_parameters()]
    mixtral = case == "mixtral"
    expected = _checkpoint_names(
        dict(zip(names, torch.autograd.grad(total, list(hf.parameters())))),
        "block_sparse_moe.experts" if mixtral else "mlp.experts",
        ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
    grads = ours.hf_gradients(ours.backward(logits=seed, aux_loss=torch.ones((), dtype=F64)))
    assert set(grads) == set(expected)
    worst = {n: _relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < 1e-9, sorted(worst.items(), key=lambda x: -x[1])[:3]


def test_the_aux_loss_changes_the_router_gradients(tmp_path, monkeypatch):
    """The router gradients with and without the load-balancing term differ: the term is
    not silently dropped from the backward."""
    _hf_model("qwen3_moe-every-layer", tmp_path, monkeypatch)
    ours = Model.from_module(CASES["qwen3_moe-every-layer"][0], hf_weights=tmp_path, dtype=F64)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(2))
    out = ours.forward(token_ids=ids.to(torch.int32))
    zero = torch.zeros_like(out["logits"])
    grads = ours.hf_gradients(ours.backward(logits=zero, aux_loss=torch.ones((), dtype=F64)))
    gate = grads["model.layers.0.mlp.gate.weight"]
    assert gate.abs().max() > 1e-6
    # the last layer's experts feed no router: the term gives them no gradient
    assert grads["model.layers.1.mlp.experts.0.down_proj.weight"].abs().max() == 0


def test_training_loss_adds_the_aux_loss_as_transformers(tmp_path, monkeypatch):
    """`modulec train`'s loss on the CPU (CPUTrainer) is transformers' loss with labels:
    the cross-entropy plus router_aux_loss_coef * aux_loss, and its gradients match."""
    from runtime.train.backends import CPUTrainer, split_window
    from runtime.train.optim import AdamW

    hf = _hf_model("qwen3_moe-every-2nd", tmp_path, monkeypatch)
    ours = Model.from_module(CASES["qwen3_moe-every-2nd"][0], hf_weights=tmp_path, dtype=F64)
    window = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    loss, grads = CPUTrainer(ours, 2, 7, AdamW())._loss_and_gradients(window)
    tokens, labels = split_window(window)
    result = hf(input_ids=tokens.long(), labels=labels, shift_labels=labels)
    assert abs(float(loss) - float(result.loss.detach())) < 1e-6 * float(result.loss.detach())
    assert COEF * float(result.aux_loss.detach()) > 1e-3 * float(result.loss.detach())  # the term counts
    names = [n for n, _ in hf.named_parameters()]
    expected = _checkpoint_names(dict(zip(names, torch.autograd.grad(result.loss, list(hf.parameters())))),
                                 "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    ours_hf = ours.hf_gradients(SimpleNamespace(params=grads))
    worst = {n: _relative(ours_hf[n], expected[n]) for n in expected}
    # the cross-entropy runs in float32 on both sides (HF: logits.float(); ours: the
    # trainer's fp32 loss kernel), so d_logits agree to float32 rounding only
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda x: -x[1])[:3]


def test_saved_checkpoint_loads_in_transformers(tmp_path, monkeypatch):
    """Export through the nested stack's index arithmetic ({i * 2 + j}, {i * 2 + 1}):
    the written checkpoint is every tensor of the original, equal, and transformers loads
    it into a model computing the original's logits."""
    import json

    from safetensors.torch import load_file

    _hf_model("qwen3_moe-every-2nd", tmp_path / "in", monkeypatch)
    ours = Model.from_module(CASES["qwen3_moe-every-2nd"][0], hf_weights=tmp_path / "in",
                             dtype=F64)
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    ours.save_hf(tmp_path / "out", config)
    original, saved = (load_file(tmp_path / d / "model.safetensors") for d in ("in", "out"))
    assert set(saved) == set(original)
    assert all(torch.equal(saved[n].to(original[n].dtype), original[n]) for n in original)
    first, second = (transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / d)
                     for d in ("in", "out"))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(second(input_ids=ids).logits, first(input_ids=ids).logits)
