"""What the rope primitive's scaling params must hold (std/primitives/rope.module): the
rope types the runtime computes (runtime/kernels/rope_freq.py), the params each one
reads, and the values that make a param do nothing. A param given a value its rope type
does not read is an error, not ignored; so is a rope type that lacks a param it needs.
"""

from __future__ import annotations

from modulec.semantic.consteval import Unknown
from modulec.types.dims import Dim

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# rope type -> the scaling params it reads (theta, partial_rotary_factor and the layout:
# every type; max_position_embeddings: a default for several, never required alone)
READS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "mscale", "mscale_all_dim", "attention_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
}
REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# the value of each scaling param that means "not given"
UNSET = {"factor": None, "original_max_position_embeddings": None, "low_freq_factor": None,
         "high_freq_factor": None, "beta_fast": None, "beta_slow": None, "truncate": True,
         "mscale": None, "mscale_all_dim": None, "attention_factor": None,
         "short_factor": None, "long_factor": None}


def rope_param_problem(params: dict, D: Dim | None) -> tuple[str, tuple[str, ...]] | None:
    """(message, help) for the first problem of a rope call's params, or None. D: the head
    dim when known (the length of longrope's factor lists and the rotated channels)."""
    kind = params.get("rope_type", "default")
    if isinstance(kind, Unknown) or kind is None:
        return None
    if kind not in ROPE_TYPES:
        return (f"`rope_type` is `{kind}`, which the rope primitive does not compute",
                (f"rope types: {', '.join(ROPE_TYPES)}",))
    for name, unset in UNSET.items():
        value = params.get(name, unset)
        if name not in READS[kind] and value != unset and not isinstance(value, Unknown):
            return (f"`{name}` does nothing under rope_type `{kind}`",
                    (f"`{kind}` reads {_listed(READS[kind])}",))
    missing = [n for n in REQUIRED.get(kind, ()) if params.get(n) is None]
    if kind in ("yarn", "llama3", "longrope") and params.get("max_position_embeddings") is None \
            and params.get("original_max_position_embeddings") is None:
        missing.append("original_max_position_embeddings")
    if kind in ("yarn", "longrope") and params.get("factor") is None \
            and params.get("max_position_embeddings") is None:
        missing.append("max_position_embeddings")
    if missing:
        return (f"rope_type `{kind}` needs `{missing[0]}`", ())
    return _numbers_problem(params, kind, D)


def _numbers_problem(params: dict, kind: str, D: Dim | None):
    partial = params.get("partial_rotary_factor", 1.0)
    if isinstance(partial, Dim) and partial.is_const:
        partial = float(partial.value)
    if isinstance(partial, float):
        if not 0.0 < partial <= 1.0:
            return (f"`partial_rotary_factor` is {partial}; it must be in (0, 1]", ())
        if D is not None and D.is_const:
            problem = _rotary_dim_problem(params, kind, int(D.value * partial), D.value)
            if problem is not None:
                return problem
    for name in ("factor", "low_freq_factor", "high_freq_factor", "theta"):
        value = _number(params.get(name))  # `theta = -1` is an int: it passed as one
        if value is not None and not value > 0:
            return (f"`{name}` is {value}; it must be positive", ())
    if kind == "llama3" and isinstance(params.get("low_freq_factor"), float) \
            and params.get("low_freq_factor") == params.get("high_freq_factor"):
        return ("`low_freq_factor` equals `high_freq_factor`: llama3's smoothing divides by "
                "their difference", ())
    return None


def _number(value) -> float | None:
    """A float, int or constant Dim as a float; None for anything else (unknown, unset)."""
    if isinstance(value, Dim):
        return float(value.value) if value.is_const else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _rotary_dim_problem(params: dict, kind: str, dim: int, D: int):
    """The rotary dim int(D * partial_rotary_factor) against what the rope type needs."""
    n = (dim + 1) // 2
    if n < 1:
        return (f"`partial_rotary_factor` rotates no channel of a head dim of {D}", ())
    if kind == "yarn" and dim % 2:
        return (f"yarn needs an even rotary dim; int(D * partial_rotary_factor) is {dim}",
                ("transformers' yarn ramp has dim // 2 entries for ceil(dim / 2) frequencies",))
    if kind == "dynamic" and dim <= 2:
        return (f"dynamic needs a rotary dim above 2 (its base has the exponent dim / (dim - 2)); "
                f"int(D * partial_rotary_factor) is {dim}", ())
    for name in ("short_factor", "long_factor"):
        got = params.get(name)
        if isinstance(got, (tuple, list)) and len(got) != n:
            return (f"`{name}` has {len(got)} numbers; longrope needs one per frequency, {n} "
                    "(int(D * partial_rotary_factor) / 2, rounded up)", ())
    return None


def _listed(names) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "none of the scaling params"
