"""HuggingFace config fields that change the computation (issue 15, item 4).

A checkpoint's config.json may ask for something the program does not model: rotary
embedding on part of each head, biases on the projections, a sliding window, scaled RoPE,
another routing of the experts. A field the program's `hf_config.param_mapping` maps is
the program's to honour; any other such field must hold the value under which it changes
nothing (the program computes that), else the build is refused (E010 naming the field and
its value) rather than loading a checkpoint into a model that computes something else.
`tie_word_embeddings` is compared with what the program does: it ties when its weight
schema has a tied parameter. docs/decisions.md, "HF config fields", lists the choices.
"""

from __future__ import annotations

from pathlib import Path

from modulec.diagnostics import Diagnostic, error

# field -> (the value that changes nothing, what another value asks for); None: absent
NEUTRAL = {
    "partial_rotary_factor": (1.0, "rotary embedding on part of each head"),
    "rotary_pct": (1.0, "rotary embedding on part of each head"),
    "attention_bias": (False, "biases on the attention projections"),
    "qkv_bias": (False, "biases on the q/k/v projections"),
    "mlp_bias": (False, "biases on the MLP projections"),
    "use_sliding_window": (False, "sliding-window attention"),
    "use_qk_norm": (False, "an RMSNorm on q and k"),
    "qk_layernorm": (False, "a LayerNorm on q and k"),
    "norm_topk_prob": (True, "top-k routing weights that are not renormalized"),
    "decoder_sparse_step": (1, "MoE layers only every few layers"),
    "mlp_only_layers": ([], "dense MLP layers among the MoE layers"),
    "first_k_dense_replace": (0, "dense MLP layers before the MoE layers"),
    "shared_expert_intermediate_size": (0, "a shared expert beside the routed ones"),
    "n_shared_experts": (0, "shared experts beside the routed ones"),
    "use_bidirectional_attention": (False, "attention that is not causal"),
    "attn_logit_softcapping": (None, "soft-capped attention scores"),
    "final_logit_softcapping": (None, "soft-capped logits"),
    "use_bias": (False, "biases on the in/out projections (Mamba)"),
    "use_conv_bias": (True, "a conv without bias (Mamba)"),
}
# a field one transformers version writes under another name: read under either, and
# mapping one maps both (transformers 5 saves Qwen3-MoE's `num_experts` as
# `num_local_experts`, GPT-NeoX's `rotary_pct` / `rotary_emb_base` as rope_parameters'
# `partial_rotary_factor` / `rope_theta`; the hub's checkpoints have the older names)
FIELD_ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",),
                 "partial_rotary_factor": ("rotary_pct",), "rope_theta": ("rotary_emb_base",)}


def with_aliases(fields: set[str]) -> set[str]:
    """Mapped config fields and their other names."""
    return fields | {alias for name in fields for alias in FIELD_ALIASES.get(name, ())}


# sliding_window counts where no use_sliding_window switch says (the switch's own rule)
WINDOW, WINDOW_SWITCH = "sliding_window", "use_sliding_window"
TIE = "tie_word_embeddings"
# a null field means the same as an absent one: the neutral value
ALSO_NEUTRAL = (None,)


def unmapped_field_problems(config: dict, mapped: set[str], path: Path) -> list[Diagnostic]:
    """E010 for every computing field of `config` the program neither maps nor matches."""
    problems = []
    for name, (neutral, meaning) in NEUTRAL.items():
        if name in mapped or name not in config:
            continue
        value = config[name]
        if value in ALSO_NEUTRAL or _same(value, neutral):
            continue
        problems.append(_refused(path, name, value, meaning, _text(neutral)))
    window = config.get(WINDOW)
    if WINDOW not in mapped and window is not None and WINDOW_SWITCH not in config:
        problems.append(_refused(path, WINDOW, window, "sliding-window attention", "null"))
    return problems


def tie_problem(config: dict, mapped: set[str], schema: list, path: Path) -> list[Diagnostic]:
    """An unmapped `tie_word_embeddings` must say what the program does."""
    value = config.get(TIE)
    if TIE in mapped or not isinstance(value, bool):
        return []
    ties = any(entry.get("kind") == "tied" for entry in schema)
    if value == ties:
        return []
    does = "ties its LM head to the embedding" if ties else "has an LM head of its own"
    return [error("E010", f"{path}: `{TIE}` is `{_text(value)}`, but the program {does}",
                  None, help=[f"map it in `hf_config.param_mapping` (`...: {TIE}`), or use "
                              "a checkpoint of this architecture"])]


def _refused(path: Path, name: str, value, meaning: str, neutral: str) -> Diagnostic:
    return error("E010", f"{path}: `{name}` is `{_text(value)}` ({meaning}), which this "
                 f"program does not compute", None,
                 help=[f"the program computes `{name}: {neutral}`; map the field to a "
                       "parameter in `hf_config.param_mapping` of a program that models "
                       "it, or use a checkpoint of this architecture"])


def _same(value, neutral) -> bool:
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral or (value == neutral and type(value) is type(neutral))
    if isinstance(neutral, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(neutral)
    return value == neutral


def _text(value) -> str:
    import json

    return json.dumps(value)
