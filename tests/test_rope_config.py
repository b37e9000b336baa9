"""Issue 18 item 1: a checkpoint's RoPE scaling (`rope_parameters`, or `rope_scaling` with
`rope_type` or the oldest `type`) is read into std's models by `build --config`; what the
rope primitive cannot compute, or the program does not map, is E010; rope params that do
not fit their rope type are E003 at the call (modulec.ops.rope_params)."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import run

LLAMA = "std/models/llama.module"
BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_type": "llama3"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def build(tmp_path, model: str, config: dict, *extra: str):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "ir.json"
    result = run("build", model, "--config", path, "--shape", "B=1", "--shape", "T=8",
                 "-o", out, *extra)
    return result, out


def rope_attrs(ir_path) -> dict:
    def walk(o):
        if isinstance(o, dict):
            if o.get("target") in ("rope", "qk_norm_rope"):
                return o["attrs"]
            o = list(o.values())
        if isinstance(o, list):
            for v in o:
                found = walk(v)
                if found:
                    return found
        return None
    return walk(json.loads(ir_path.read_text()))


@pytest.mark.parametrize("section", [
    {"rope_scaling": LLAMA31},                                         # Llama-3.1's config.json
    {"rope_parameters": dict(LLAMA31, rope_theta=500000.0)},           # transformers 5
    {"rope_scaling": {k if k != "rope_type" else "type": v for k, v in LLAMA31.items()}},
])
def test_a_llama31_config_builds_with_its_rope(tmp_path, section):
    result, ir = build(tmp_path, LLAMA, BASE | section)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(ir)
    assert attrs["rope_type"] == "llama3" and attrs["factor"] == 8.0
    assert attrs["low_freq_factor"] == 1.0 and attrs["high_freq_factor"] == 4.0
    assert attrs["original_max_position_embeddings"] == 16
    assert attrs["max_position_embeddings"] == 128 and attrs["theta"] == 500000.0
    assert "`beta_fast` is missing" not in result.output  # absent scaling keys: no news


@pytest.mark.parametrize("model", ["std/models/qwen3.module", "std/models/mistral.module",
                                   "std/models/qwen2.module", "std/models/mixtral.module",
                                   "std/models/qwen3_moe.module"])
def test_yarn_configs_build_in_the_other_std_models(tmp_path, model):
    config = BASE | {"rope_scaling": YARN, "head_dim": 8, "sliding_window": None,
                     "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 16}
    result, ir = build(tmp_path, model, config)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(ir)
    assert (attrs["rope_type"], attrs["factor"], attrs["original_max_position_embeddings"]) \
        == ("yarn", 4.0, 32)


@pytest.mark.parametrize("section, shown", [
    ({"rope_type": "proportional", "factor": 2.0},
     "`rope_scaling.rope_type` is `proportional`, which the rope primitive does not compute"),
    (dict(YARN, mscale=0.7), "`rope_scaling.mscale` is `0.7`"),
    (dict(YARN, truncate=False), "`rope_scaling.truncate` is `false`"),
    ({"rope_type": "default", "mrope_section": [2, 1, 1]}, "`rope_scaling.mrope_section`"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5},
     "`rope_scaling.partial_rotary_factor` is `0.5`"),
])
def test_what_llama_cannot_compute_is_e010(tmp_path, section, shown):
    result, _ = build(tmp_path, LLAMA, BASE | {"rope_scaling": section})
    assert result.exit_code == 1, result.output
    assert "error[E010]" in result.output and shown in result.output, result.output


def test_neutral_yarn_keys_build(tmp_path):
    """beta_fast 32, beta_slow 1, truncate true are transformers' defaults: Llama need not
    map them to compute them."""
    section = dict(YARN, beta_fast=32, beta_slow=1, truncate=True)
    result, ir = build(tmp_path, LLAMA, BASE | {"rope_scaling": section})
    assert result.exit_code == 0, result.output
    assert rope_attrs(ir)["beta_fast"] == 32


def test_a_program_that_maps_no_rope_type_refuses_scaling(tmp_path):
    """A copy of std's Llama whose hf_config maps no rope_type: plain RoPE only."""
    text = open(LLAMA, encoding="utf-8").read().replace("      rope_type: rope_type\n", "")
    model = tmp_path / "plain_llama.module"
    model.write_text(text, encoding="utf-8")
    result, _ = build(tmp_path, str(model), BASE | {"rope_scaling": LLAMA31})
    assert result.exit_code == 1
    assert "`rope_scaling.rope_type` is `llama3`, but the program computes plain RoPE" \
        in result.output
    result, _ = build(tmp_path, str(model), BASE | {"rope_scaling": {"rope_type": "default"}})
    assert result.exit_code == 0, result.output


def test_a_key_the_rope_type_does_not_read_is_dropped(tmp_path):
    result, ir = build(tmp_path, LLAMA, BASE | {"rope_scaling": {"rope_type": "default",
                                                                   "factor": 4.0}})
    assert result.exit_code == 0, result.output
    assert "`factor` is not read under rope_type `default`" in result.output
    assert rope_attrs(ir)["factor"] is None


@pytest.mark.parametrize("settings, shown", [
    (["rope_type=\"bogus\""], "`rope_type` is `bogus`, which the rope primitive does not compute"),
    (["rope_factor=2.0"], "`factor` does nothing under rope_type `default`"),
    (["rope_type=\"llama3\"", "rope_factor=8.0"], "rope_type `llama3` needs `low_freq_factor`"),
    (["rope_type=\"linear\"", "rope_factor=0.0"], "`factor` is 0.0; it must be positive"),
])
def test_rope_params_that_do_not_fit_are_e003(tmp_path, settings, shown):
    args = [a for s in settings for a in ("--set", s)]
    result, _ = build(tmp_path, LLAMA, BASE, *args)
    assert result.exit_code == 1, result.output
    assert "error[E003]" in result.output and shown in result.output, result.output


def test_partial_rotary_past_the_head_dim_and_longrope_lengths(tmp_path):
    from modulec.ops.rope_params import rope_param_problem
    from modulec.types.dims import Dim

    assert rope_param_problem({"partial_rotary_factor": 0.0}, Dim.const(8))[0] \
        == "`partial_rotary_factor` is 0.0; it must be in (0, 1]"
    longrope = {"rope_type": "longrope", "short_factor": (1.0,) * 3, "long_factor": (1.0,) * 4,
                "max_position_embeddings": Dim.const(64)}
    assert "`short_factor` has 3 numbers" in rope_param_problem(longrope, Dim.const(8))[0]
    assert rope_param_problem(dict(longrope, short_factor=(1.0,) * 4), Dim.const(8)) is None
    assert rope_param_problem({"partial_rotary_factor": 0.5}, Dim.const(8)) is None
    yarn = {"rope_type": "yarn", "factor": 4.0, "max_position_embeddings": Dim.const(64)}
    assert rope_param_problem(dict(yarn, partial_rotary_factor=0.5), Dim.const(8)) is None
    assert "yarn needs an even rotary dim; int(D * partial_rotary_factor) is 5" in \
        rope_param_problem(dict(yarn, partial_rotary_factor=0.25), Dim.const(20))[0]
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": Dim.const(64)}
    assert "dynamic needs a rotary dim above 2" in \
        rope_param_problem(dict(dynamic, partial_rotary_factor=0.25), Dim.const(8))[0]
    assert "rotates no channel" in rope_param_problem({"partial_rotary_factor": 0.1},
                                                      Dim.const(8))[0]


LONGROPE_MODULE = """\
model T(d: int = 8, rt: string = "default", sf: [float]? = None, lf: [float]? = None):
  forward:
    in: (q: [B, 2, S, d], k: [B, 2, S, d])
    out: (qr: [B, 2, S, d], kr: [B, 2, S, d])
    graph:
      (q, k) -> rope(
        rope_type=rt, short_factor=sf, long_factor=lf, max_position_embeddings=32
      ) -> (qr, kr)
  hf_config:
    architecture: "T"
    config_class: "TConfig"
    param_mapping:
      rt: rope_type
      sf: short_factor
      lf: long_factor
"""


def test_longrope_factor_lists_come_from_the_config(tmp_path):
    """List fields (ints among the floats, as JSON writes 1.0) reach a `[float]?` param."""
    model = tmp_path / "t.module"
    model.write_text(LONGROPE_MODULE, encoding="utf-8")
    section = {"rope_type": "longrope", "short_factor": [1, 1.5, 2, 2.5],
               "long_factor": [3.0, 3, 3, 4]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_scaling": section}), encoding="utf-8")
    out = tmp_path / "ir.json"
    result = run("build", model, "--config", path, "--shape", "B=1", "--shape", "S=4", "-o", out)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(out)
    assert attrs["short_factor"] == [1, 1.5, 2, 2.5] and attrs["long_factor"] == [3, 3, 3, 4]
    section["short_factor"] = [1.0, 2.0]  # not one per frequency (d / 2 = 4)
    path.write_text(json.dumps({"rope_scaling": section}), encoding="utf-8")
    result = run("build", model, "--config", path, "--shape", "B=1", "--shape", "S=4")
    assert result.exit_code == 1 and "`short_factor` has 2 numbers" in result.output


LLAMA32_1B = {  # meta-llama/Llama-3.2-1B's config.json (transformers 4.45), as published
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}


def test_the_llama32_1b_config_builds_as_published(tmp_path):
    result, ir = build(tmp_path, LLAMA, LLAMA32_1B)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(ir)
    assert (attrs["rope_type"], attrs["factor"], attrs["original_max_position_embeddings"],
            attrs["max_position_embeddings"]) == ("llama3", 32.0, 8192, 131072)


NO_ROPE = """\
from std.modules.attention import CausalSelfAttention
model A(d: int = 16):
  params:
    attn: CausalSelfAttention(d, 4, 2, 16, use_rope=false{extra})
  forward:
    in: x: [B, T, d]
    out: y: [B, T, d]
    graph:
      x -> attn -> y
"""


LAYOUT_NEEDS_ROPE = "rope_type, partial_rotary_factor and rope_interleaved need use_rope"


@pytest.mark.parametrize("extra, shown", [
    ("", None),
    (", partial_rotary_factor=0.5", LAYOUT_NEEDS_ROPE),
    (", rope_interleaved=true", LAYOUT_NEEDS_ROPE),
    (", rope_factor=2.0", "the rope_* parameters need use_rope"),
    (", rope_short_factor=[1.0, 2.0]", "the rope_* parameters need use_rope"),
])
def test_rope_parameters_without_rope_are_refused(tmp_path, extra, shown):
    """use_rope=false (GPT-2) emits no rope op: a RoPE parameter given there would do nothing."""
    model = tmp_path / "a.module"
    model.write_text(NO_ROPE.format(extra=extra), encoding="utf-8")
    result = run("build", model, "--shape", "B=1", "--shape", "T=4", "-o", tmp_path / "a.json")
    if shown is None:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1 and "error[E027]" in result.output and shown in result.output
