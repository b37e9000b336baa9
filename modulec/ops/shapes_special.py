"""Shape rules for primitives whose signature gives the shapes but not every constraint:
the generic signature match, then what only the docstrings of std/primitives say: GQA
head counts (Hkv divides Hq), groups dividing channels, rope's (and qk_norm_rope's) scaling
params and rotated channels, `top_k` at most the experts.

These rules also take the outputs' default dtype from the activations only: an input whose
signature fixes its dtype (`alibi_slopes: [Hq, fp32]`) says nothing of the activations'.
"""

from __future__ import annotations

from modulec.check.unify import Matcher, ShapeError, pattern_of
from modulec.ops.registry import OpCall, shape_rule
from modulec.ops.rope_params import rope_param_problem
from modulec.semantic.consteval import ConstEnv
from modulec.types.dims import Dim, intrinsic
from modulec.types.tensor import FLOAT, TensorType


def by_signature(call: OpCall, phase=None) -> tuple[Matcher, list[TensorType]]:
    """A signature (the forward's, or `phase`) matched against the call: (bound dims,
    output types; dims the inputs do not bind are fresh `op.N` symbols)."""
    phase = phase or call.rule.definition.forward
    matcher = Matcher(ConstEnv(call.params, "error"), call.assumptions)
    dtype = None
    for index, (sig, actual) in enumerate(zip(phase.inputs, call.inputs)):
        if actual is None:
            continue
        pattern = pattern_of(sig.type)
        matcher.match(pattern, actual, f"`{sig.name}`", index)
        if dtype is None and pattern.dtype is None and actual.is_float:
            dtype = actual.dtype  # the first floating input's, as the checker's rule
    dtype = FLOAT if dtype is None else dtype
    matcher.finish()
    return matcher, [matcher.build(pattern_of(sig.type), dtype, call.rule.name)
                     for sig in phase.outputs]


def _divides(call: OpCall, part: Dim | None, whole: Dim | None) -> bool:
    """False only when `part` surely does not divide `whole` (unknown sizes pass)."""
    if part is None or whole is None:
        return True
    if part.is_const and part.value <= 0:
        return False
    return call.assumptions.same(whole % part, Dim.const(0)) is not False


def _int_param(call: OpCall, name: str) -> Dim | None:
    value = call.param(name)
    return value if isinstance(value, Dim) else None


@shape_rule("flash_attention")
def flash_attention_shape(call: OpCall) -> list[TensorType]:
    """GQA: Hq query heads share Hkv key/value heads, so Hkv must divide Hq."""
    matcher, outputs = by_signature(call)
    hq, hkv = matcher.bound.get("Hq"), matcher.bound.get("Hkv")
    if not _divides(call, hkv, hq):
        raise ShapeError(f"{hq} query heads are not a multiple of {hkv} key/value heads",
                         argument=1, label=f"{hkv} heads",
                         help=("grouped-query attention shares each key/value head among "
                               "Hq / Hkv query heads: Hkv must divide Hq",))
    return outputs


@shape_rule("rope", "qk_norm_rope")
def rope_shape(call: OpCall) -> list[TensorType]:
    """The scaling params fit their rope_type (modulec.ops.rope_params), and the rotated
    channels, 2 ceil(int(D * partial_rotary_factor) / 2), fit in the head dim D (all of an
    even D by default: rotate-half pairs channel i with i + D/2)."""
    matcher, outputs = by_signature(call)
    d = matcher.bound.get("D")
    problem = rope_param_problem(call.params, d)
    if problem is not None:
        raise ShapeError(f"`{call.rule.name}`: {problem[0]}", help=problem[1], code="E003")
    partial = call.param("partial_rotary_factor")
    if partial in (None, 1.0, Dim.const(1)) and not _divides(call, Dim.const(2), d):
        raise ShapeError(f"`{call.rule.name}` rotates pairs of the head dim (i, i + D/2); "
                         f"D = {d} is odd", argument=0, label=f"head dim {d}")
    if isinstance(partial, float) and d is not None and d.is_const \
            and 2 * ((int(d.value * partial) + 1) // 2) > d.value:
        raise ShapeError(f"`{call.rule.name}`: partial_rotary_factor {partial} rotates more "
                         f"channels than the head dim {d.value} has", argument=0,
                         label=f"head dim {d}")
    return outputs


@shape_rule("group_rmsnorm")
def group_rmsnorm_shape(call: OpCall) -> list[TensorType]:
    """The last dim C splits into `groups` groups of C / groups channels."""
    matcher, outputs = by_signature(call)
    c, groups = matcher.bound.get("C"), _int_param(call, "groups")
    if not _divides(call, groups, c):
        raise ShapeError(f"{c} channels do not split into {groups} groups", argument=0,
                         label=f"{c} channels", help=("`groups` must divide the last dim",))
    return outputs


@shape_rule("mamba_selective_scan")
def mamba_selective_scan_shape(call: OpCall) -> list[TensorType]:
    """Channel d reads B and C of group d // (channels / G): G must divide channels."""
    matcher, outputs = by_signature(call)
    channels, groups = matcher.bound.get("channels"), matcher.bound.get("G")
    if not _divides(call, groups, channels):
        raise ShapeError(f"{channels} channels do not split into {groups} groups (the "
                         f"second dim of B and C)", argument=3, label=f"{groups} groups")
    return outputs


@shape_rule("moe_router")
def moe_router_shape(call: OpCall) -> list[TensorType]:
    """Each token picks top_k distinct experts of E: 1 <= top_k <= E."""
    matcher, outputs = by_signature(call)
    experts, top_k = matcher.bound.get("E"), _int_param(call, "top_k")
    if top_k is not None and (
            (top_k.is_const and top_k.value < 1) or
            (experts is not None and call.assumptions.same(
                intrinsic("min", [top_k, experts]), top_k) is False)):
        raise ShapeError(f"`moe_router` cannot pick top_k={top_k} of {experts} experts",
                         argument=1, label=f"{experts} experts")
    return outputs

