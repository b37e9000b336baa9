"""Mixed layer stacks (issue 18 item 2): index arithmetic in checkpoint names, a second
stack continuing the layer numbering, and the weight schema the runtime fills."""

from __future__ import annotations

import pytest

from modulec.check.weight_index import IndexError_, canonical_string, parse_index
from runtime.hf_weights.schema import fill


def test_index_expressions_parse_and_canonicalize():
    assert parse_index("i").bare == "i"
    assert parse_index("i * step + j").names == ("i", "step", "j")
    text = canonical_string("model.layers.{layer * step + step - 1}.mlp",
                            {"layer": "i"}, {"step": 3})
    assert text == "model.layers.{i * 3 + 3 - 1}.mlp"
    assert canonical_string("a.{i}.{e}", {"i": "i", "e": "e"}, {}) == "a.{i}.{e}"
    for bad in ("i +", "i / 2", "f(i)", "i.x", "1.5"):
        with pytest.raises(IndexError_):
            parse_index(bad)


def test_runtime_fills_index_expressions():
    assert fill("model.layers.{i + 3}.w", {"i": 2}) == "model.layers.5.w"
    assert fill("l.{i * 2 + j}.{(i + 1) // 2 % 5}", {"i": 4, "j": 1}) == "l.9.2"
    assert fill("l.{i}.experts.{e}", {"i": 1}) == "l.1.experts.{e}"  # e filled later
    assert fill("l.{-i + 7}", {"i": 2}) == "l.5"


def test_first_k_dense_then_moe_matches_transformers(tmp_path, monkeypatch):
    """tests/data/first_k_dense_moe.module (a dense array, then an MoE array mapped with
    `{i + first_k_dense}`) against Qwen3MoeForCausalLM whose mlp_only_layers are its first
    layer, with the checkpoint's config in DeepSeek's spelling (first_k_dense_replace):
    logits, aux_loss and every gradient in float64."""
    import json
    import sys

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from runtime.model import Model
    from tests import test_hf_parity_moe as moe

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.3)
    config._attn_implementation, config._experts_implementation = "sdpa", "eager"
    hf = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["mlp_only_layers"]
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, first_k_dense_replace=1)))
    moe._rotary_in_float64(hf.model.rotary_emb, config)
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            moe._rmsnorm_in_input_dtype(module)
        if type(module).__name__.endswith("TopKRouter"):
            moe._router_in_input_dtype(module)
    monkeypatch.setattr(sys.modules[type(hf).__module__], "load_balancing_loss_func",
                        moe._balance_loss_in_input_dtype)
    hf = hf.to(torch.float64).eval()
    ours = Model.from_module("tests/data/first_k_dense_moe.module", hf_weights=tmp_path,
                             dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 7), generator=generator)
    result = hf(input_ids=ids)
    out = ours.forward(token_ids=ids.to(torch.int32))
    assert moe._relative(out["logits"], result.logits.detach()) < 1e-9
    assert abs(float(out["aux_loss"]) - 0.3 * float(result.aux_loss.detach())) < 1e-12
    seed = torch.randn(result.logits.shape, generator=generator, dtype=torch.float64)
    total = (result.logits * seed).sum() + 0.3 * result.aux_loss
    names = [n for n, _ in hf.named_parameters()]
    expected = moe._checkpoint_names(
        dict(zip(names, torch.autograd.grad(total, list(hf.parameters())))),
        "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    grads = ours.hf_gradients(ours.backward(logits=seed, aux_loss=torch.ones((), dtype=torch.float64)))
    assert set(grads) == set(expected)
    assert "model.layers.0.mlp.gate_proj.weight" in grads  # layer 0 dense, 1 and 2 MoE
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in grads
    worst = {n: moe._relative(grads[n], expected[n]) for n in expected}
    assert max(worst.values()) < 1e-9, sorted(worst.items(), key=lambda x: -x[1])[:3]
