"""LoRA (issue 6): the `lora` pass adapts the `@adapter(lora)` matmuls, the reference runtime
trains only the adapters, and they export under PEFT's names (docs/training.md, "LoRA")."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from modulec.lower.build import BuildRequest, build
from modulec.lower.lora import LoraOptions, parse_lora

torch = pytest.importorskip("torch")

from runtime.model import Model  # noqa: E402
from tests.runtime_models import TINY, token_inputs  # noqa: E402

LLAMA, DENSE = TINY["llama"]
SHAPES = {"B": 2, "T": 6}


def _model(lora=None, std=0.3) -> Model:
    return Model.from_module(LLAMA, settings=DENSE, lora=lora).init_random(0, std=std)


def _randomize_b(model: Model, seed: int = 1) -> None:
    """Trained-looking adapters: B = 0 at init makes every delta vanish."""
    generator = torch.Generator().manual_seed(seed)
    for path, value in model.params.items():
        if path.endswith("lora_B"):
            model.params[path] = torch.randn(value.shape, generator=generator,
                                             dtype=value.dtype) * 0.2


def _build(path=LLAMA, lora=None, settings=None, model=None, shapes=SHAPES):
    settings = {k: str(v) for k, v in (DENSE if settings is None else settings).items()}
    return build(BuildRequest(Path(path), model=model, settings=settings, shapes=shapes,
                              lora=lora))


# ====================================================================== options
def test_the_option_text_parses():
    assert parse_lora("rank=8,alpha=16,targets=[q,v]") == LoraOptions(8, 16.0, ("q", "v"))
    assert parse_lora("targets=q+o") == LoraOptions(None, None, ("q", "o"))
    assert parse_lora("") == LoraOptions()
    with pytest.raises(ValueError):
        parse_lora("rank=0")
    with pytest.raises(ValueError):
        LoraOptions.of({"ranks": 4})


# ====================================================================== the pass
def test_lora_off_leaves_the_graph_alone():
    plain = _build()
    entry = plain.graph.function("CausalSelfAttention#1")
    assert not any(p.id.endswith("lora_A") for p in entry.params)
    assert "lora" not in plain.document["metadata"]


def test_an_adapted_matmul_gets_a_low_rank_delta_and_the_base_is_frozen():
    result = _build(lora=LoraOptions(4, 8.0, ("o",)))
    attention = result.graph.function("CausalSelfAttention#1")
    ops = [(n.target, n.inputs) for n in attention.nodes][-4:]
    assert [o[0] for o in ops] == ["matmul", "matmul", "matmul", "add"]
    assert ops[1][1][1] == "param:out_weight.lora_A" and ops[2][1][1] == "param:out_weight.lora_B"
    scaled = attention.nodes[-2]
    assert scaled.attr("alpha") == 2.0  # alpha / rank
    shapes = {p.id: p.shape for p in attention.params}
    assert shapes["param:out_weight.lora_A"] == ("4", "32")
    assert shapes["param:out_weight.lora_B"] == ("32", "4")
    assert "param:out_weight" in attention.no_gradient
    assert "param:qkv_weight" in attention.no_gradient
    grads = dict(result.graph.function("CausalSelfAttention#1.backward").param_grads)
    assert set(grads) == {"out_weight.lora_A", "out_weight.lora_B"}
    assert not any(f.param_grads for f in result.graph.functions
                   if f.name.startswith(("Llama", "Dense", "SwiGLU")))


def test_a_fused_projection_gets_one_adapter_per_selected_part():
    result = _build(lora=LoraOptions(4, 8.0, ("q", "v")))
    attention = result.graph.function("CausalSelfAttention#1")
    shapes = {p.id: p.shape for p in attention.params if "lora" in p.id}
    assert shapes == {"param:qkv_weight.q.lora_A": ("4", "32"),
                      "param:qkv_weight.q.lora_B": ("32", "4"),   # 4 heads x 8
                      "param:qkv_weight.v.lora_A": ("4", "32"),
                      "param:qkv_weight.v.lora_B": ("16", "4")}  # 2 kv heads x 8
    # one delta for the whole fused output: the selected parts' A stacked, their B laid
    # block-diagonally (k's rows zero), one add into the base output; no split / concat
    # of the [.., 64] output
    assert not any(n.target == "split" and n.inputs[0].startswith("%lora")
                   for n in attention.nodes)
    matmuls = [n for n in attention.nodes if n.target == "matmul"][:3]
    shapes = [attention.value(n.inputs[1]).shape for n in matmuls]
    assert shapes == [("64", "32"), ("8", "32"), ("64", "8")]
    adapters = result.document["metadata"]["lora"]["adapters"]
    assert {(a["target"], tuple(a["rows"]), a["hf_module"]) for a in adapters} == {
        ("q", (0, 32), "model.layers.{i}.self_attn.q_proj"),
        ("v", (48, 64), "model.layers.{i}.self_attn.v_proj")}


def test_the_delta_adds_derived_backward_hands_on_the_gradient_without_a_copy():
    """y = base + delta (one shape and dtype, no broadcasting): the derived backward has
    no add_backward (it copied d_y twice); base's and the delta's matmul backward both
    read d_y itself. An add reading a function's input keeps its node (its gradient could
    be the backward's result as it is): Mixtral's block adds its router_stats input."""
    result = _build(lora=LoraOptions(4, 8.0, ("q", "k", "v", "o", "gate", "up", "down")))
    for name in ("CausalSelfAttention#1", "SwiGLU_MLP#1"):
        forward = result.graph.function(name)
        backward = result.graph.function(f"{name}.backward")
        assert not any(n.target == "add_backward" for n in backward.nodes)
        (d_y,) = [v.id for v in backward.inputs]
        producer = {o: n.id for n in forward.nodes for o in n.outputs}
        (add,) = [n for n in forward.nodes if n.target == "add" and forward.outputs[0] in n.outputs]
        readers = {n.attr("forward_node") for n in backward.nodes if d_y in n.inputs}
        assert readers == {producer[v] for v in add.inputs}  # base's and the delta's matmul
    kept = _build(path="std/models/mixtral.module", settings=DENSE | {
        "num_experts": 4, "top_k": 2}, lora=LoraOptions(4, 8.0, ()))
    assert any(n.target == "add_backward" for f in kept.graph.functions for n in f.nodes)


def test_the_build_is_verified_and_deterministic(tmp_path):
    from modulec.cli.build_cmd import verify_document
    from modulec.ir.serialize import dumps

    first = dumps(_build(lora=LoraOptions(4, 8.0, ("q", "v", "up"))).document)
    second = dumps(_build(lora=LoraOptions(4, 8.0, ("q", "v", "up"))).document)
    assert first == second
    path = tmp_path / "lora.ir"
    path.write_text(first)
    assert verify_document(path) == []


def test_an_unknown_target_is_an_error():
    result = _build(lora=LoraOptions(targets=("q", "x_proj")))
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E008"]
    assert "`x_proj`" in errors[0].message and "gate" in " ".join(errors[0].help)


TOY = """
module Toy(d: int, r: int = 2):
  params:
    w: [d, d]
    v: [d, d]
  forward:
    in: x: [B, d]
    out: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> h @adapter(lora, rank=r, alpha=6.0)
      h -> MARK -> out
"""


def _toy(tmp_path, last: str, lora=LoraOptions()):
    path = tmp_path / "toy.module"
    path.write_text(textwrap.dedent(TOY).replace("MARK", last))
    return path, _build(path, lora, {"d": 8}, "Toy", {"B": 3})


def test_rank_and_alpha_come_from_the_annotation_and_the_option_overrides(tmp_path):
    _, result = _toy(tmp_path, "matmul(v, transpose=NT)")
    adapters = result.document["metadata"]["lora"]["adapters"]
    assert [(a["weight"], a["rank"], a["alpha"]) for a in adapters] == [("w", 2, 6.0)]
    _, result = _toy(tmp_path, "matmul(v, transpose=NT)", LoraOptions(rank=3))
    assert [(a["rank"], a["alpha"]) for a in result.document["metadata"]["lora"]["adapters"]] \
        == [(3, 6.0)]


def test_a_misplaced_adapter_is_reported_at_the_annotation(tmp_path):
    path, result = _toy(tmp_path, "gelu() @adapter(lora)")
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E008"]
    assert "`gelu`" in errors[0].message
    text = path.read_text()
    span = errors[0].primary_span
    assert text[span.start:span.end] == "@adapter(lora)"
    assert span.line == 11


def test_a_misplaced_adapter_is_harmless_without_lora(tmp_path):
    _, result = _toy(tmp_path, "gelu() @adapter(lora)", lora=None)
    assert result.document is not None


# ====================================================================== the runtime
def test_at_init_the_adapted_model_is_the_base_model_exactly():
    base = _model()
    adapted = _model(dict(rank=4, alpha=8))
    inputs = token_inputs(base)
    assert set(base.params) < set(adapted.params)
    assert all(torch.equal(base.params[p], adapted.params[p]) for p in base.params)
    assert torch.equal(base.forward(**inputs)["logits"], adapted.forward(**inputs)["logits"])
    b = adapted.params["blocks[0].attention.qkv_weight.q.lora_B"]
    a = adapted.params["blocks[0].attention.qkv_weight.q.lora_A"]
    assert not b.any() and a.abs().max() <= 1 / 32 ** 0.5 and a.std() > 0


def test_gradients_are_the_adapters_only_and_match_autograd():
    model = _model(dict(rank=4, alpha=8))
    _randomize_b(model)
    inputs = token_inputs(model)
    adapters = [p for p in model.params if "lora" in p]
    for path in adapters:
        model.params[path].requires_grad_(True)
    logits = model.forward(**inputs)["logits"]
    seed = torch.randn_like(logits)
    expected = torch.autograd.grad(logits, [model.params[p] for p in adapters], seed)
    with torch.no_grad():
        model.forward(**inputs)
        grads = model.backward(logits=seed).params
    assert set(grads) == set(adapters)
    for path, want in zip(adapters, expected):
        error = (grads[path] - want).abs().max() / want.abs().max()
        assert error < 1e-10, (path, float(error))


def test_directional_finite_difference_agrees_with_the_backward():
    model = _model(dict(rank=2, alpha=4, targets=["q", "v", "down"]))
    _randomize_b(model)
    inputs = token_inputs(model)
    logits = model.forward(**inputs)["logits"]
    seed = torch.randn_like(logits)
    grads = model.backward(logits=seed).params
    generator = torch.Generator().manual_seed(3)
    direction = {p: torch.randn(g.shape, generator=generator, dtype=g.dtype)
                 for p, g in grads.items()}
    analytic = sum((grads[p] * d).sum() for p, d in direction.items())
    eps, base = 1e-6, {p: model.params[p].clone() for p in direction}

    def loss(sign):
        for p, d in direction.items():
            model.params[p] = base[p] + sign * eps * d
        return (model.forward(**inputs)["logits"] * seed).sum()

    numeric = (loss(1) - loss(-1)) / (2 * eps)
    assert abs(float(numeric - analytic)) <= 1e-7 * max(1.0, abs(float(analytic)))


def test_targets_restrict_the_rows_that_change():
    """Adapters on q and v equal the base model with W += (alpha/r) B A merged into the
    q and v rows of qkv_weight only (k rows and every other weight unchanged)."""
    adapted = _model(dict(rank=4, alpha=8, targets=["q", "v"]))
    _randomize_b(adapted)
    merged = _model()
    for layer in range(2):
        prefix = f"blocks[{layer}].attention.qkv_weight"
        weight = merged.params[prefix].clone()
        for part, rows in (("q", slice(0, 32)), ("v", slice(48, 64))):
            a, b = (adapted.params[f"{prefix}.{part}.lora_{m}"] for m in "AB")
            weight[rows] += 2.0 * b @ a
        merged.params[prefix] = weight
    inputs = token_inputs(adapted)
    want = merged.forward(**inputs)["logits"]
    got = adapted.forward(**inputs)["logits"]
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert sorted({p.split(".")[-2] for p in adapted.params if "lora" in p}) == ["q", "v"]


def test_adapters_export_under_peft_names_and_load_back(tmp_path):
    from safetensors.torch import load_file

    from runtime.lora import load_lora, save_lora

    model = _model(dict(rank=4, alpha=8, targets=["q", "o", "gate"]))
    _randomize_b(model)
    path = save_lora(model, tmp_path / "adapter")
    tensors = load_file(str(path))
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    assert torch.equal(tensors[name], model.params["blocks[1].attention.qkv_weight.q.lora_B"])
    assert tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"].shape == (4, 32)
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"].shape \
        == (32, 4)
    assert len(tensors) == 2 * 3 * 2
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == ["gate_proj", "o_proj", "q_proj"]
    fresh = _model(dict(rank=4, alpha=8, targets=["q", "o", "gate"]))
    load_lora(fresh, tmp_path / "adapter")
    assert all(torch.equal(fresh.params[p], model.params[p]) for p in model.params)


DROPOUT = """\
model Adapted(d: int = 6, v: int = 5):
  params:
    w: [v, d]
  forward:
    in: x: [B, d]
    out: y: [B, v]
    graph:
      x -> matmul(w, transpose=NT) -> y @adapter(lora, rank=2, alpha=4.0, dropout={p})
"""


def _dropout_model(tmp_path, p: float):
    from runtime.model import Model

    path = tmp_path / f"dropout{p}.module"
    path.write_text(DROPOUT.format(p=p), encoding="utf-8")
    model = Model.from_module(path, dtype=torch.float64, lora={}).init_random(0, std=0.5)
    model.params["w.lora_B"] = torch.randn(5, 2, generator=torch.Generator().manual_seed(3),
                                           dtype=torch.float64)  # a delta that shows
    return model


def test_lora_dropout_drops_in_training_only(tmp_path):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain, dropped = _dropout_model(tmp_path, 0.0), _dropout_model(tmp_path, 0.5)
    dropped.params.update(plain.params)
    inference = plain.forward(x=x)["y"]
    assert torch.equal(dropped.forward(x=x)["y"], inference)  # no seed: no dropout
    dropped.rng_seed = 7
    first = dropped.forward(x=x)["y"]
    assert not torch.allclose(first, inference)  # was: dropout ignored
    assert torch.equal(dropped.forward(x=x)["y"], first)  # one seed, one mask
    dropped.rng_seed = 8
    assert not torch.allclose(dropped.forward(x=x)["y"], first)
    base = x @ plain.params["w"].T  # the base output does not drop
    a, b = plain.params["w.lora_A"], plain.params["w.lora_B"]
    delta = first - base  # each element of x kept (scaled by 2) or dropped
    full = 2.0 * (x @ a.T) @ b.T
    assert not torch.allclose(delta, full) and not torch.allclose(delta, torch.zeros_like(delta))


def test_lora_dropout_gradients_match_finite_differences(tmp_path):
    model = _dropout_model(tmp_path, 0.3)
    model.rng_seed = 11
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    seed = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    model.forward(x=x)
    grads = model.backward(y=seed)
    for path in ("w.lora_A", "w.lora_B"):
        direction = torch.randn(model.params[path].shape, generator=generator,
                                dtype=torch.float64)
        start, eps, values = model.params[path].clone(), 1e-6, []
        for sign in (1, -1):
            model.params[path] = start + sign * eps * direction
            values.append(float((model.forward(x=x)["y"] * seed).sum()))
        model.params[path] = start
        numeric = (values[0] - values[1]) / (2 * eps)
        assert numeric == pytest.approx(float((grads.params[path] * direction).sum()),
                                        rel=1e-6)
    assert "w" not in grads.params  # the base stays frozen


def test_lora_dropout_option_overrides_the_annotation(tmp_path):
    """`--lora dropout=p` (LoraOptions.dropout) replaces the annotation's `dropout=`: 0
    turns it off, p > 0 turns it on where the annotation has none."""
    path = tmp_path / "dropout.module"
    path.write_text(DROPOUT.format(p=0.5), encoding="utf-8")

    def dropouts(lora) -> list:
        model = Model.from_module(path, dtype=torch.float64, lora=lora)
        graph = model.source.program(planned=False).graph
        return [dict(n.attrs).get("p") for f in graph.functions for n in f.nodes
                if n.target == "dropout"]

    assert parse_lora("rank=2,dropout=0.25") == LoraOptions(2, None, (), 0.25)
    assert dropouts({}) == [0.5]
    assert dropouts(parse_lora("dropout=0.25")) == [0.25]
    assert dropouts({"dropout": 0}) == []
    from runtime.lora import peft_config

    model = Model.from_module(path, dtype=torch.float64, lora=parse_lora("dropout=0.25"))
    assert peft_config(model)["lora_dropout"] == 0.25  # adapter_config.json says it (was 0)
    with pytest.raises(ValueError, match="probability below 1"):
        LoraOptions.of({"dropout": 1.0})
    with pytest.raises(ValueError, match=r"known: rank, alpha, targets, dropout"):
        LoraOptions.of({"droput": 0.1})


IA3 = """\
model Scaled(d: int = 6, v: int = 5):
  params:
    w: [v, d]
    u: [v, v]
  forward:
    in: x: [B, d]
    out: y: [B, v]
    graph:
      x -> matmul(w, transpose=NT) -> k @adapter(ia3)
      k -> matmul(u, transpose=NT) -> y
"""


def test_ia3_scales_its_value_by_a_trained_vector(tmp_path):
    path = tmp_path / "ia3.module"
    path.write_text(IA3, encoding="utf-8")
    model = Model.from_module(path, dtype=torch.float64, lora={}).init_random(0, std=0.5)
    assert torch.equal(model.params["w.ia3_l"], torch.ones(5, dtype=torch.float64))
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    w, u = model.params["w"], model.params["u"]
    assert torch.allclose(model.forward(x=x)["y"], x @ w.T @ u.T)  # l = 1: the base model
    scale = torch.randn(5, generator=generator, dtype=torch.float64)
    model.params["w.ia3_l"] = scale
    assert torch.allclose(model.forward(x=x)["y"], ((x @ w.T) * scale) @ u.T)  # was: ignored
    d_y = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    grads = model.backward(y=d_y).params
    assert set(grads) == {"w.ia3_l"}  # the base weights are frozen
    assert torch.allclose(grads["w.ia3_l"], ((d_y @ u) * (x @ w.T)).sum(0))
