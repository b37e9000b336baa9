"""longrope configs (Phi-3 128k, Phi-3.5, Phi-4-mini) read into std's models by
`build --config` (issue 18 item 2): short_factor / long_factor reach the rope op through
the model, block and attention; Phi-3's top-level original_max_position_embeddings; the
older Phi-3 type names (`su`, `yarn`) read as transformers' Phi3Config reads them; lists
not one number per rotary frequency, and models that map no factor lists, are E010."""

from __future__ import annotations

import pytest

from tests.test_rope_config import BASE, build, rope_attrs

PHI3 = "std/models/phi3.module"
# head_dim 32 / 4 = 8, partial 0.75: int(6) rotary channels, 3 frequencies
PHI3_128K = BASE | {"model_type": "phi3", "partial_rotary_factor": 0.75,
                    "original_max_position_embeddings": 16, "sliding_window": 8,
                    "pad_token_id": 0, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "longrope", "short_factor": [1, 1.5, 2.0],
                                     "long_factor": [2.0, 4.0, 8.0]}}


def test_a_phi3_128k_config_builds_with_its_factor_lists(tmp_path):
    result, ir = build(tmp_path, PHI3, PHI3_128K)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(ir)
    assert attrs["rope_type"] == "longrope" and attrs["partial_rotary_factor"] == 0.75
    assert attrs["short_factor"] == [1, 1.5, 2.0] and attrs["long_factor"] == [2.0, 4.0, 8.0]
    assert attrs["original_max_position_embeddings"] == 16
    assert attrs["max_position_embeddings"] == 128


@pytest.mark.parametrize("old", ["su", "yarn"])
def test_older_phi3_type_names_are_longrope(tmp_path, old):
    """Phi3Config renames `su` and `yarn` to longrope: so is the program's rope op."""
    config = PHI3_128K | {"rope_scaling": PHI3_128K["rope_scaling"] | {"type": old}}
    result, ir = build(tmp_path, PHI3, config)
    assert result.exit_code == 0, result.output
    assert f"`rope_scaling.type` `{old}` of a `phi3` config is read as `longrope`" \
        in result.output
    assert rope_attrs(ir)["rope_type"] == "longrope"


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral", "qwen3", "mixtral",
                                   "qwen3_moe"])
def test_longrope_configs_build_in_the_other_std_models(tmp_path, model):
    section = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
               "original_max_position_embeddings": 32, "factor": 4.0}
    config = BASE | {"rope_scaling": section, "sliding_window": None, "head_dim": 8,
                     "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 16}
    result, ir = build(tmp_path, f"std/models/{model}.module", config)
    assert result.exit_code == 0, result.output
    attrs = rope_attrs(ir)
    assert (attrs["rope_type"], attrs["short_factor"], attrs["long_factor"], attrs["factor"]) \
        == ("longrope", [1.0] * 4, [2.0] * 4, 4.0)


@pytest.mark.parametrize("key, value, shown", [
    ("short_factor", [1.0, 2.0], "`rope_scaling.short_factor` has 2 numbers; longrope needs "
     "one per rotary frequency, 3"),
    ("long_factor", [1.0] * 4, "`rope_scaling.long_factor` has 4 numbers"),
    ("long_factor", "2.0", "`rope_scaling.long_factor` is not a list of numbers"),
])
def test_factor_lists_of_the_wrong_length_are_e010(tmp_path, key, value, shown):
    config = PHI3_128K | {"rope_scaling": PHI3_128K["rope_scaling"] | {key: value}}
    result, _ = build(tmp_path, PHI3, config)
    assert result.exit_code == 1, result.output
    assert "error[E010]" in result.output and shown in result.output, result.output
    assert "head_dim 8, partial_rotary_factor 0.75" in result.output or "not a list" in shown


def test_a_model_that_maps_no_factor_lists_refuses_longrope(tmp_path):
    """Gemma maps no RoPE scaling at all; a copy of Phi-3 without the list mappings."""
    text = open(PHI3, encoding="utf-8").read().replace("      rope_short_factor: short_factor\n",
                                                       "")
    model = tmp_path / "phi3_no_short.module"
    model.write_text(text, encoding="utf-8")
    result, _ = build(tmp_path, str(model), PHI3_128K)
    assert result.exit_code == 1
    assert "`rope_scaling.short_factor` is `[1, 1.5, 2.0]` (`longrope` RoPE's `short_factor`)" \
        in result.output, result.output
