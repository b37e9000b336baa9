"""Issue 15, item 4: a config field that changes the computation is mapped by the
program's `hf_config` or refused (E010 naming the field and its value) when it asks for
something the program does not compute; a mapped field the config lacks is a warning in
every command that loads (`build --config`, and `run` / `train` through the runtime)."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import run

LLAMA = "std/models/llama.module"
GPT2 = "std/models/gpt2.module"
LLAMA_CONFIG = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False}
GPT2_CONFIG = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
               "layer_norm_epsilon": 1e-5}


def build(tmp_path, model: str, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return run("build", model, "--config", path, "--shape", "B=1", "--shape", "T=8")


@pytest.mark.parametrize("field, value, shown", [
    ("partial_rotary_factor", 0.25, "`partial_rotary_factor` is `0.25`"),
    ("rotary_pct", 0.25, "`rotary_pct` is `0.25`"),
    ("attention_bias", True, "`attention_bias` is `true`"),
    ("mlp_bias", True, "`mlp_bias` is `true`"),
    ("sliding_window", 4096, "`sliding_window` is `4096`"),
    ("use_sliding_window", True, "`use_sliding_window` is `true`"),
    ("norm_topk_prob", False, "`norm_topk_prob` is `false`"),
    ("use_bidirectional_attention", True, "`use_bidirectional_attention` is `true`"),
    ("final_logit_softcapping", 30.0, "`final_logit_softcapping` is `30.0`"),
])
def test_a_field_the_program_does_not_compute_is_refused(tmp_path, field, value, shown):
    result = build(tmp_path, LLAMA, LLAMA_CONFIG | {field: value})
    assert result.exit_code == 1, result.output
    assert "error[E010]" in result.output and shown in result.output
    assert "which this program does not compute" in result.output


@pytest.mark.parametrize("extra", [
    {"partial_rotary_factor": 1.0, "attention_bias": False, "mlp_bias": False},
    {"sliding_window": None, "rotary_pct": 1},
    {"sliding_window": 4096, "use_sliding_window": False},   # Qwen's configs
])
def test_neutral_values_build(tmp_path, extra):
    result = build(tmp_path, LLAMA, LLAMA_CONFIG | extra)
    assert result.exit_code == 0, result.output


MAMBA_CONFIG = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4,
                "conv_kernel": 4, "expand": 2, "time_step_rank": 2, "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": True, "use_bias": False, "use_conv_bias": True}


@pytest.mark.parametrize("field, value", [("use_bias", True), ("use_conv_bias", False)])
def test_mamba_bias_switches_are_refused_unless_neutral(tmp_path, field, value):
    """std's Mamba has no projection biases and a conv bias (HF's defaults)."""
    assert build(tmp_path, "std/models/mamba.module", MAMBA_CONFIG).exit_code == 0
    result = build(tmp_path, "std/models/mamba.module", MAMBA_CONFIG | {field: value})
    assert result.exit_code == 1 and "error[E010]" in result.output, result.output
    assert f"`{field}`" in result.output


def test_a_mapped_field_is_the_programs_to_honour(tmp_path):
    """std's Mistral maps sliding_window to its window size."""
    config = LLAMA_CONFIG | {"sliding_window": 16}
    assert build(tmp_path, "std/models/mistral.module", config).exit_code == 0


def test_unmapped_tie_word_embeddings_must_match_the_program(tmp_path):
    """std/models/gpt2.module ties its LM head and does not map the field."""
    assert build(tmp_path, GPT2, GPT2_CONFIG | {"tie_word_embeddings": True}).exit_code == 0
    result = build(tmp_path, GPT2, GPT2_CONFIG | {"tie_word_embeddings": False})
    assert result.exit_code == 1
    assert "`tie_word_embeddings` is `false`, but the program ties its LM head" in result.output


def test_a_missing_mapped_field_warns_where_the_runtime_loads(tmp_path, capsys):
    """`modulec run` and `train` build through runtime.program.ModuleSource."""
    pytest.importorskip("torch")
    from runtime.model import Model

    config = dict(LLAMA_CONFIG)
    del config["rope_theta"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    model = Model.from_module(LLAMA, config=path)
    model.source.program(planned=False)
    model.source.program({"B": 1, "T": 4}, planned=False)  # a second build: warned once
    warned = capsys.readouterr().err
    assert warned.count("`rope_theta` is missing; `rope_theta` keeps its default") == 1


def test_an_optional_int_may_be_zero(tmp_path):
    """Gemma's `padding_idx: int?` takes HF's pad_token_id 0 (a plain `int` is a size, at
    least 1: `d_model = 0` stays E027); a pad_token_id outside the vocabulary is refused by
    the model's constraint."""
    config = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "intermediate_size": 48, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": True}
    gemma = "std/models/gemma.module"
    assert build(tmp_path, gemma, config | {"pad_token_id": 0}).exit_code == 0
    assert build(tmp_path, gemma, config | {"pad_token_id": None}).exit_code == 0
    result = build(tmp_path, gemma, config | {"pad_token_id": 64})
    assert result.exit_code == 1 and "padding_idx must be a row of the embedding" in result.output
    result = build(tmp_path, gemma, config | {"hidden_size": 0})
    assert result.exit_code == 1 and "`d_model = 0` is not a usable size" in result.output
