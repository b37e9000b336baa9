"""HuggingFace weights in and out (runtime/hf_weights) against the weight schemas of the
std models and the examples, and against transformers' own models.

- Round trip: random checkpoint tensors, named and shaped as each model's schema says,
  saved with safetensors (one file, or shards with an index) -> load_hf_weights ->
  export_hf_tensors gives back exactly the same names and values.
- transformers (skipped without it): a tiny Llama / Qwen3 (untied and tied) / Mistral /
  Mixtral / GPT-2 saved by save_pretrained loads into our model built from its config.json
  (fused qkv is cat(q, k, v); Mixtral's stacked experts equal transformers' own fused
  expert tensors; GPT-2's Conv1D weights are transposed, its head tied), and
  save_hf_weights writes a directory from_pretrained reads back to the same state_dict.
- Gradients: tied gradients add up; transforms apply their chain rule (checked against
  autograd).
- Mistakes are one WeightLoadError naming every problem: missing tensors (with did you
  mean), unused tensors, wrong shapes, no checkpoint.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `runtime` is not installed

from modulec.lower.build import BuildRequest, build  # noqa: E402
from modulec.paths import REPO_DIR  # noqa: E402
from runtime.hf_weights import (WeightLoadError, export_hf_tensors,  # noqa: E402
                                load_hf_weights, save_hf_weights)

TINY = dict(vocab_size=64, d_model=32, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
            max_seq=64)
MODELS = {
    "std/models/llama.module": TINY,
    "std/models/qwen3.module": {**TINY, "head_dim": 8},
    "std/models/mistral.module": TINY,
    "std/models/mixtral.module": {**TINY, "num_experts": 4},
    "std/models/qwen2.module": TINY,
    "std/models/gemma.module": {**TINY, "head_dim": 8},
    "examples/llama.module": TINY,
    "examples/qwen3.module": {**TINY, "head_dim": 8},
    "examples/mistral.module": {**TINY, "window": 16},
    "examples/mixtral.module": {**TINY, "num_experts": 4},
    "std/models/gpt2.module": dict(vocab_size=64, d_model=32, n_layers=2, num_heads=4,
                                 max_seq=64),
    "examples/mamba.module": dict(vocab_size=64, d_model=32, n_layers=2, d_state=16,
                                  head_dim=16),
}


# ============================================================================ helpers
@lru_cache(maxsize=None)
def _schema(module: str, settings: tuple, config: str | None = None) -> str:
    request = BuildRequest(REPO_DIR / module, settings={k: str(v) for k, v in settings},
                           shapes={"B": 1, "T": 8}, config=Path(config) if config else None)
    result = build(request)
    assert result.document is not None, [d.message for d in result.diagnostics]
    return json.dumps(result.document["weight_schema"])


def schema_of(module: str, config: Path | None = None, **settings) -> list[dict]:
    """The build's weight schema (a fresh copy: tests may edit it)."""
    settings = settings if settings or config else MODELS[module]
    return json.loads(_schema(module, tuple(sorted(settings.items())),
                              str(config) if config else None))


def layers(entry: dict) -> list[dict]:
    """The placeholder values of every layer of a schema entry."""
    subs = [{}]
    for stack in entry["stacks"]:
        subs = [{**s, stack["placeholder"]: i} for s in subs for i in range(stack["count"])]
    return subs


def name(text: str, subs: dict) -> str:
    for key, value in subs.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def parts(size: int, n: int) -> list[int]:
    """Unequal part sizes adding up to `size` (unequal, so that an order mix-up shows)."""
    small = max(1, size // (n + 1))
    return [size - small * (n - 1)] + [small] * (n - 1)


def fake_checkpoint(schema: list[dict], seed: int = 0) -> dict:
    """Random float64 tensors under every checkpoint name of the schema, shaped to fit,
    written out independently of runtime/hf_weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}

    def add(plan, subs, shape):
        if plan["kind"] == "fuse":
            d = plan["dim"]
            for part, size in zip(plan["hf"], parts(shape[d], len(plan["hf"]))):
                out[name(part, subs)] = torch.randn(*shape[:d], size, *shape[d + 1:],
                                                    generator=g, dtype=torch.float64)
        else:
            if plan.get("fn") == "transpose":
                shape = shape[:-2] + [shape[-1], shape[-2]]
            out[name(plan["hf"][0], subs)] = torch.randn(*shape, generator=g,
                                                         dtype=torch.float64)

    for entry in schema:
        for subs in layers(entry):
            shape = entry["shape"]
            if entry["kind"] == "stack":
                d = entry["dim"]
                for e in range(entry["count"]):
                    add(entry["inner"], {**subs, "e": e}, shape[:d] + shape[d + 1:])
            elif entry["kind"] != "tied":
                add(entry, subs, shape)
    return out


def save(tensors: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    return directory


def concrete_params(schema: list[dict]) -> set[str]:
    return {name(e["param"], subs) for e in schema for subs in layers(e)}


def raises(call, *args, **kwargs) -> str:
    with pytest.raises(WeightLoadError) as info:
        call(*args, **kwargs)
    assert info.value.help, "every error says what to do"
    return str(info.value)


# ============================================================================ round trips
@pytest.mark.parametrize("module", sorted(MODELS))
def test_round_trip(module, tmp_path):
    schema = schema_of(module)
    hf = fake_checkpoint(schema)
    weights = load_hf_weights(schema, save(hf, tmp_path), progress=False)
    assert set(weights) == concrete_params(schema)
    for entry in schema:
        for subs in layers(entry):
            assert list(weights[name(entry["param"], subs)].shape) == entry["shape"]
            assert weights[name(entry["param"], subs)].dtype == torch.float64
    exported = export_hf_tensors(schema, weights)
    assert list(exported) == [n for n in hf if n in exported] and set(exported) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(exported[key], tensor), key


def test_loaded_tensors_are_assembled_as_the_schema_says(tmp_path):
    schema = schema_of("std/models/mixtral.module")
    hf = fake_checkpoint(schema)
    w = load_hf_weights(schema, save(hf, tmp_path), progress=False)
    layer = "model.layers.1"
    q, k, v = (hf[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(w["blocks[1].attention.qkv_weight"], torch.cat([q, k, v]))
    experts = [torch.cat([hf[f"{layer}.block_sparse_moe.experts.{e}.w1.weight"],
                          hf[f"{layer}.block_sparse_moe.experts.{e}.w3.weight"]])
               for e in range(4)]
    assert torch.equal(w["blocks[1].experts.gate_up_weights"], torch.stack(experts))
    assert w.layout["blocks[{i}].attention.qkv_weight"] == [q.shape[0], k.shape[0], v.shape[0]]


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    schema = schema_of("std/models/llama.module")
    hf = fake_checkpoint(schema)
    names = list(hf)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, group in shards.items():
        safetensors_torch.save_file({n: hf[n] for n in group}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, g in shards.items() for n in g}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_hf_weights(schema, tmp_path, progress=False)
    single = load_hf_weights(schema, save(hf, tmp_path / "single"), progress=False)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_dtype_and_save_hf_weights(tmp_path):
    schema = schema_of("std/models/gpt2.module")
    hf = {k: v.to(torch.bfloat16) for k, v in fake_checkpoint(schema).items()}
    w = load_hf_weights(schema, save(hf, tmp_path / "in"), dtype=None, progress=False)
    assert w["wte"].dtype == torch.bfloat16
    out = save_hf_weights(schema, w, tmp_path / "out", config={"n_layer": 2})
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"n_layer": 2}
    again = safetensors_torch.load_file(str(out))
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]



def test_nested_stacks_and_optional_entries(tmp_path):
    """Two stack levels take every (i, j); an optional entry loads when its tensors are
    there, is left out when none are, and is missing when only some are."""
    stacks = [{"placeholder": "i", "count": 2}, {"placeholder": "j", "count": 3}]
    schema = [
        {"param": "g[{i}].l[{j}].w", "shape": [4, 2], "stacks": stacks, "optional": False,
         "kind": "fuse", "hf": ["g.{i}.l.{j}.a", "g.{i}.l.{j}.b"], "dim": 0, "fn": None},
        {"param": "g[{i}].bias", "shape": [2], "stacks": stacks[:1], "optional": True,
         "kind": "direct", "hf": ["g.{i}.bias"], "dim": None, "fn": None},
    ]
    hf = fake_checkpoint(schema)
    assert len(hf) == 2 * 3 * 2 + 2
    bias = {k: hf.pop(k) for k in ("g.0.bias", "g.1.bias")}
    w = load_hf_weights(schema, save(hf, tmp_path / "a"), progress=False)
    assert set(w) == {f"g[{i}].l[{j}].w" for i in range(2) for j in range(3)}
    assert torch.equal(w["g[1].l[2].w"], torch.cat([hf["g.1.l.2.a"], hf["g.1.l.2.b"]]))
    assert export_hf_tensors(schema, w).keys() == hf.keys()
    w = load_hf_weights(schema, save({**hf, **bias}, tmp_path / "b"), progress=False)
    assert torch.equal(w["g[1].bias"], bias["g.1.bias"])
    message = raises(load_hf_weights, schema, save({**hf, "g.0.bias": bias["g.0.bias"]},
                                                    tmp_path / "c"), progress=False)
    assert "`g.1.bias` (for `g[1].bias`)" in message and "g.0.bias" not in message


# ============================================================================ tied, gradients
def test_tied_parameter_shares_its_target_and_exports_nothing(tmp_path):
    schema = schema_of("std/models/gpt2.module")
    w = load_hf_weights(schema, save(fake_checkpoint(schema), tmp_path), progress=False)
    assert w["lm_head"] is w["wte"]
    assert "lm_head" not in "".join(export_hf_tensors(schema, w))
    untied = dict(w, lm_head=w["wte"] + 1)
    message = raises(export_hf_tensors, schema, untied, layout=w.layout)
    assert "`lm_head` differs from `wte`" in message


def test_gradients_of_tied_parameters_add_up(tmp_path):
    schema = schema_of("std/models/gpt2.module")
    w = load_hf_weights(schema, save(fake_checkpoint(schema), tmp_path), progress=False)
    grads = {k: torch.randn_like(v) for k, v in w.items() if not k.startswith("wpe")}
    hf = export_hf_tensors(schema, grads, gradients=True)
    assert torch.equal(hf["transformer.wte.weight"], grads["wte"] + grads["lm_head"])
    assert "transformer.wpe.weight" not in hf  # no gradient given (frozen): none exported
    c_attn = hf["transformer.h.1.attn.c_attn.weight"]
    assert torch.equal(c_attn, grads["blocks[1].attn.qkv_weight"].T)


@pytest.mark.parametrize("fn", ["identity", "neg", "exp", "log", "negate_exp", "transpose"])
def test_gradient_export_is_the_chain_rule(fn, tmp_path):
    """For param = f(x): export of dL/dparam is dL/dx, as autograd computes it."""
    entry = {"param": "A", "shape": [3, 4], "stacks": [], "optional": False,
             "kind": "transform", "hf": ["a"], "dim": None, "fn": fn}
    x = torch.rand(4, 3, dtype=torch.float64) + 0.5 if fn == "transpose" else \
        torch.rand(3, 4, dtype=torch.float64) + 0.5
    w = load_hf_weights([entry], save({"a": x}, tmp_path), progress=False)
    assert torch.allclose(export_hf_tensors([entry], w)["a"], x, rtol=1e-12, atol=0)
    x_grad = x.clone().requires_grad_()
    forward = {"identity": lambda t: t, "neg": torch.neg, "exp": torch.exp, "log": torch.log,
               "negate_exp": lambda t: -torch.exp(t), "transpose": lambda t: t.T}[fn]
    upstream = torch.randn(3, 4, dtype=torch.float64)
    (forward(x_grad) * upstream).sum().backward()
    got = export_hf_tensors([entry], {"A": upstream}, gradients=True, weights=w)["a"]
    assert torch.allclose(got, x_grad.grad, rtol=1e-12, atol=0)
    if fn in ("exp", "log", "negate_exp"):
        message = raises(export_hf_tensors, [entry], {"A": upstream}, gradients=True)
        assert "`A` (fn `" + fn + "`)" in message and "weights=" in message


# ============================================================================ mistakes
@pytest.fixture
def llama(tmp_path):
    schema = schema_of("std/models/llama.module")
    return schema, fake_checkpoint(schema), tmp_path


def test_every_missing_tensor_is_named_with_did_you_mean(llama):
    schema, hf, tmp = llama
    del hf["model.layers.1.self_attn.k_proj.weight"]
    hf["model.nrom.weight"] = hf.pop("model.norm.weight")
    message = raises(load_hf_weights, schema, save(hf, tmp), progress=False)
    assert "2 tensors the model needs are not in the checkpoint" in message
    assert "`model.layers.1.self_attn.k_proj.weight` (for `blocks[1].attention.qkv_weight`)" \
        in message
    assert "`model.norm.weight` (for `final_norm.weight`) (did you mean `model.nrom.weight`?)" \
        in message
    assert "1 checkpoint tensor is used by no parameter" in message


def test_extra_tensors_are_an_error_unless_allowed(llama):
    schema, hf, tmp = llama
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4, dtype=torch.float64)
    message = raises(load_hf_weights, schema, save(hf, tmp), progress=False)
    assert "`model.layers.0.self_attn.rotary_emb.inv_freq`" in message and \
        "allow_extra=True" in message
    # the hint says where the keyword goes (a CLI user has no such option)
    assert "pass allow_extra=True" not in message and \
        "`load_hf_weights(schema, directory, allow_extra=True)`" in message
    w = load_hf_weights(schema, tmp, progress=False, allow_extra=True)
    assert w.unused == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert "embedding" in w


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_weights_that_are_not_floats_are_refused_by_name(llama, dtype):
    schema, hf, tmp = llama
    hf["model.norm.weight"] = hf["model.norm.weight"].to(dtype)
    message = raises(load_hf_weights, schema, save(hf, tmp), progress=False)
    assert f"checkpoint tensor model.norm.weight is {str(dtype)[6:]}" in message


def test_wrong_shapes_name_tensor_parameter_and_both_shapes(llama):
    schema, hf, tmp = llama
    hf["model.norm.weight"] = torch.zeros(31, dtype=torch.float64)
    hf["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(20, 32, dtype=torch.float64)
    hf["model.layers.1.mlp.up_proj.weight"] = torch.zeros(48, 33, dtype=torch.float64)
    message = raises(load_hf_weights, schema, save(hf, tmp), progress=False)
    assert "3 tensors of the wrong shape" in message
    assert "`model.norm.weight` is [31]; `final_norm.weight` needs [32]" in message
    assert "`blocks[0].attention.qkv_weight` is [64, 32], but its parts add up to 32 + 16 + " \
        "20 = 68 along dim 0" in message
    assert "`model.layers.1.mlp.up_proj.weight` is [48, 33]; as a part of " \
        "`blocks[1].mlp.up_weight` [96, 32], fused along dim 0, it must be [*, 32]" in message
    assert "--config" in message


def test_expert_shapes_name_the_expert(tmp_path):
    schema = schema_of("std/models/mixtral.module")
    hf = fake_checkpoint(schema)
    hf["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(32, 40)
    message = raises(load_hf_weights, schema, save(hf, tmp_path), progress=False)
    assert "`model.layers.0.block_sparse_moe.experts.2.w2.weight` is [32, 40]; " \
        "`blocks[0].experts.down_weights` (expert 2) needs [32, 48]" in message


def test_no_checkpoint(tmp_path):
    schema = schema_of("std/models/llama.module")
    assert "does not exist" in raises(load_hf_weights, schema, tmp_path / "nope")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    message = raises(load_hf_weights, schema, tmp_path)
    assert f"no model.safetensors or model.safetensors.index.json in {tmp_path}" in message
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read" in raises(load_hf_weights, schema, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    assert "model-00001-of-00002.safetensors" in raises(load_hf_weights, schema, tmp_path)


def test_export_mistakes(llama):
    schema, hf, tmp = llama
    w = load_hf_weights(schema, save(hf, tmp), progress=False)
    wrong = {("final_norm.wieght" if k == "final_norm.weight" else k): v for k, v in w.items()}
    message = raises(export_hf_tensors, schema, wrong)
    assert "`final_norm.wieght` (did you mean `final_norm.weight`?)" in message
    assert "parameters not given" in message and "  `final_norm.weight`" in message
    plain = dict(w)  # a plain dict has no layout: fused weights cannot be split
    message = raises(export_hf_tensors, schema, plain)
    assert "`blocks[0].attention.qkv_weight` [64, 32] into 3 parts along dim 0: sizes " \
        "unknown" in message
    layout = {"blocks[{i}].attention.qkv_weight": [32, 16, 16],
              "blocks[{i}].mlp.up_weight": [48, 48]}
    assert export_hf_tensors(schema, plain, layout=layout).keys() == hf.keys()
    message = raises(export_hf_tensors, schema, dict(w, embedding=torch.zeros(3, 3)),
                     layout=layout)
    assert "`embedding` is [3, 3], the model's is [64, 32]" in message


# ============================================================================ transformers
DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=48, vocab_size=64,
               max_position_embeddings=64)
ARCHITECTURES = {  # name: (module, config class, model class, config)
    "llama": ("std/models/llama.module", "LlamaConfig", "LlamaForCausalLM", DECODER),
    "qwen3": ("std/models/qwen3.module", "Qwen3Config", "Qwen3ForCausalLM",
              {**DECODER, "head_dim": 8}),
    "qwen3-tied": ("std/models/qwen3.module", "Qwen3Config", "Qwen3ForCausalLM",
                   {**DECODER, "head_dim": 8, "tie_word_embeddings": True}),
    "mistral": ("std/models/mistral.module", "MistralConfig", "MistralForCausalLM", DECODER),
    "mixtral": ("std/models/mixtral.module", "MixtralConfig", "MixtralForCausalLM",
                {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": ("std/models/gpt2.module", "GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64)),
}


def _check_layout(model: str, original, weights) -> None:
    """Our parameters hold what transformers' modules hold, assembled as the std mappings
    say: fused q/k/v, Mixtral's experts as transformers (>= 5) fuses them itself, GPT-2's
    Conv1D weights transposed and its head tied."""
    if model == "gpt2":
        block = original.transformer.h[1]
        c_attn = block.attn.c_attn.weight  # Conv1D: [in, out]
        assert torch.equal(weights["blocks[1].attn.qkv_weight"], c_attn.T.double())
        assert weights["lm_head"] is weights["wte"]
        return
    layer = original.model.layers[1]
    attention = layer.self_attn
    qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    assert torch.equal(weights["blocks[1].attention.qkv_weight"], qkv.double())
    assert ("lm_head" in weights) == (model != "qwen3-tied")
    experts = getattr(layer.mlp, "experts", None)
    if model == "mixtral" and hasattr(experts, "gate_up_proj"):
        assert torch.equal(weights["blocks[1].experts.gate_up_weights"],
                           experts.gate_up_proj.double())
        assert torch.equal(weights["blocks[1].experts.down_weights"],
                           experts.down_proj.double())


@pytest.mark.parametrize("model", sorted(ARCHITECTURES))
def test_transformers_checkpoints_load_and_save(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    module, config_class, model_class, settings = ARCHITECTURES[model]
    torch.manual_seed(0)
    original = getattr(transformers, model_class)(
        getattr(transformers, config_class)(**settings))
    original.save_pretrained(tmp_path / "hf")
    schema = schema_of(module, config=tmp_path / "hf" / "config.json")
    weights = load_hf_weights(schema, tmp_path / "hf", progress=False)
    _check_layout(model, original, weights)

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    save_hf_weights(schema, weights, tmp_path / "ours", config=hf_config, dtype=torch.float32)
    written = safetensors_torch.load_file(str(tmp_path / "ours" / "model.safetensors"))
    source = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == source.keys()
    assert all(torch.equal(written[k], source[k]) for k in source)
    reloaded = getattr(transformers, model_class).from_pretrained(tmp_path / "ours")
    want, got = original.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


# ============================================================================ progress
class _Terminal:
    """A stdout that says it is a terminal and keeps what is written."""

    def __init__(self):
        self.text = []

    def write(self, text):
        self.text.append(text)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return True


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_only_on_a_terminal_when_asked(progress, llama, monkeypatch):
    schema, hf, tmp = llama
    save(hf, tmp)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    load_hf_weights(schema, tmp, progress=progress)
    monkeypatch.undo()
    shown = "".join(terminal.text)
    assert ("loading weights" in shown) == progress, shown[:200]


# ======================================================= shard paths stay in the folder
@pytest.mark.parametrize("entry", ["../other/model.safetensors", "ABSOLUTE",
                                   "../../../../etc/passwd", "sub/../../other/model.safetensors",
                                   "link.safetensors"])
def test_index_entries_outside_the_folder_are_refused(tmp_path, entry):
    """A weight_map is downloaded data (issue 16 item 8): a '..', an absolute path or a
    link out of the folder must not read another file, let alone load it as the weights."""
    schema = schema_of("std/models/llama.module")
    other = save(fake_checkpoint(schema), tmp_path / "other") / "model.safetensors"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "link.safetensors").symlink_to(other)
    entry = str(other) if entry == "ABSOLUTE" else entry
    index = {"weight_map": {n: entry for n in fake_checkpoint(schema)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = raises(load_hf_weights, schema, folder, progress=False)
    assert "outside its folder" in message and repr(entry) in message


def test_hub_cache_snapshot_links_to_its_blobs_still_load(tmp_path):
    """HuggingFace's cache keeps shards in <repo>/blobs and links them from
    <repo>/snapshots/<rev>/: that is not an escape."""
    schema = schema_of("std/models/llama.module")
    hf = fake_checkpoint(schema)
    blob = save(hf, tmp_path / "repo" / "blobs") / "model.safetensors"
    snapshot = tmp_path / "repo" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(blob)
    index = {"weight_map": {n: "model-00001-of-00001.safetensors" for n in hf}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_hf_weights(schema, snapshot, progress=False).keys()
