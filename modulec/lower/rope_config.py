"""A HuggingFace config's RoPE section (`rope_parameters` in transformers 5, `rope_scaling`
before, with `type` for `rope_type` in the oldest) read for `build --config`.

The rope primitive computes the rope types of modulec.ops.rope_params; a program maps the
section's keys to its parameters in `hf_config.param_mapping` (std/models/llama.module:
`rope_factor: factor`, ...). Refused (E010), so that a checkpoint is never loaded into a
model that computes other frequencies: a rope type the primitive does not compute; a
scaled type in a program that does not map `rope_type`; a key the type reads that the
program does not map (unless it holds the value that changes nothing); multimodal
`mrope_section`; a nested `partial_rotary_factor` below 1 the program does not map;
longrope factor lists that do not hold one number per rotary frequency.
A mapped key the type does not read (a `factor` beside `rope_type: default`) is dropped,
as transformers ignores it, with a notice. docs/decisions.md, "RoPE scaling".
"""

from __future__ import annotations

from pathlib import Path

from modulec.diagnostics import Diagnostic, error
from modulec.ops.rope_params import READS, ROPE_TYPES, UNSET

SECTIONS = ("rope_parameters", "rope_scaling")
ALIASES = {"rope_type": ("type",)}  # the oldest configs' `rope_scaling.type`
# read by a type, and the value under which it changes nothing (absent: no such value)
NEUTRAL = {"beta_fast": 32, "beta_slow": 1, "truncate": True, "mscale": None,
           "mscale_all_dim": None, "attention_factor": None}
# model_type -> the older rope type names its transformers config class reads as another
# (Phi3Config: the first 128k checkpoints said `su`, and `yarn` meant longrope there)
LEGACY_TYPES = {"phi3": {"su": "longrope", "yarn": "longrope"}}


def config_field(config: dict, name: str):
    """A config field, top level first, then in the RoPE sections (transformers 5 moved
    `rope_theta`, ... into `rope_parameters`); None when absent or null."""
    if config.get(name) is not None:
        return config[name]
    for section in SECTIONS:
        nested = config.get(section)
        if not isinstance(nested, dict):
            continue
        for key in (name, *ALIASES.get(name, ())):
            if nested.get(key) is not None:
                return nested[key]
    return None


def is_scaling_field(name: str) -> bool:
    """A key of the RoPE section that only some rope types read (absent otherwise)."""
    return name in UNSET or name == "rope_type"


def _section(config: dict) -> tuple[str, dict]:
    for name in SECTIONS:
        if isinstance(config.get(name), dict):
            return name, config[name]
    return SECTIONS[0], {}


def with_legacy_types(config: dict, notices: list, path: Path) -> dict:
    """The config with an older rope type name of its model_type renamed as transformers'
    config class renames it (LEGACY_TYPES), with a notice; otherwise the config itself."""
    renames = LEGACY_TYPES.get(config.get("model_type"), {})
    name, section = _section(config)
    key = "rope_type" if "rope_type" in section else "type"
    new = renames.get(section.get(key))
    if new is None:
        return config
    notices.append(f"{path}: `{name}.{key}` `{section[key]}` of a `{config['model_type']}` "
                   f"config is read as `{new}`, as transformers reads it")
    return dict(config, **{name: dict(section, **{key: new})})


def rope_kind(config: dict) -> str:
    _, section = _section(config)
    return section.get("rope_type", section.get("type")) or "default"


def rope_problems(config: dict, mapped: set[str], path: Path) -> list[Diagnostic]:
    """E010 for a RoPE section the program cannot compute (module docstring)."""
    name, section = _section(config)
    kind = rope_kind(config)
    if kind not in ROPE_TYPES:
        return [error("E010", f"{path}: `{name}.rope_type` is `{kind}`, which the rope "
                      "primitive does not compute", None,
                      help=[f"rope types: {', '.join(ROPE_TYPES)} (docs/decisions.md, "
                            "\"RoPE scaling\")"])]
    problems = []
    if section.get("mrope_section") is not None:
        problems.append(_refused(path, name, "mrope_section", section["mrope_section"],
                                 "multimodal RoPE sections"))
    partial = section.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0) and "partial_rotary_factor" not in mapped:
        problems.append(_refused(path, name, "partial_rotary_factor", partial,
                                 "rotary embedding on part of each head"))
    if kind != "default" and "rope_type" not in mapped:
        problems.append(error(
            "E010", f"{path}: `{name}.rope_type` is `{kind}`, but the program computes "
            "plain RoPE (it maps no `rope_type`)", None,
            help=["map `rope_type` and the scaling fields in `hf_config.param_mapping` "
                  "(std/models/llama.module does), or use a program that does"]))
        return problems
    for key in READS[kind]:
        value = section.get(key)
        if key in mapped or value is None or (key in NEUTRAL and value == NEUTRAL[key]):
            continue
        problems.append(_refused(path, name, key, value, f"`{kind}` RoPE's `{key}`"))
    return problems + _factor_length_problems(config, section, name, kind, path)


def _factor_length_problems(config: dict, section: dict, name: str, kind: str,
                            path: Path) -> list[Diagnostic]:
    """longrope's lists: one number per rotary frequency, ceil(int(head_dim *
    partial_rotary_factor) / 2), head_dim as transformers takes it from the config."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int)
                                          and isinstance(heads, int) and heads > 0 else None)
    if kind != "longrope" or not isinstance(head_dim, int):
        return []
    partial = config_field(config, "partial_rotary_factor")
    partial = 1.0 if not isinstance(partial, (int, float)) else float(partial)
    n = (int(head_dim * partial) + 1) // 2
    problems = []
    for key in ("short_factor", "long_factor"):
        got = section.get(key)
        if got is None:
            continue
        if not isinstance(got, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in got):
            problems.append(error("E010", f"{path}: `{name}.{key}` is not a list of numbers",
                                  None))
        elif len(got) != n:
            problems.append(error(
                "E010", f"{path}: `{name}.{key}` has {len(got)} numbers; longrope needs one "
                f"per rotary frequency, {n}", None,
                help=[f"int(head_dim * partial_rotary_factor) / 2, rounded up: head_dim "
                      f"{head_dim}, partial_rotary_factor {partial:g}"]))
    return problems


def unread_by_kind(config: dict, mapping: list[tuple[str, str]], values: dict,
                   notices: list, path: Path) -> None:
    """Drop the values of mapped scaling keys the config's rope type does not read."""
    kind = rope_kind(config)
    if kind not in ROPE_TYPES:
        return
    for param, field in mapping:
        if field in UNSET and field not in READS[kind] and param in values:
            del values[param]
            notices.append(f"{path}: `{field}` is not read under rope_type `{kind}` "
                           f"(transformers ignores it too); `{param}` keeps its default")


def _refused(path: Path, section: str, key: str, value, meaning: str) -> Diagnostic:
    import json

    return error("E010", f"{path}: `{section}.{key}` is `{json.dumps(value)}` ({meaning}), "
                 "which this program does not map", None,
                 help=[f"map `{key}` to a parameter in `hf_config.param_mapping` of a program "
                       "that models it (the rope primitive computes it), or use a checkpoint "
                       "of this architecture"])
