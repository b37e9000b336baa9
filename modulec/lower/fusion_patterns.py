"""The fusion patterns (spec §7.5.1's table), as data: the `fuse` pass (modulec.lower.fusion)
matches them on Graph IR and `@fuse(pattern)` names them.

A pattern is a chain of primitive ops, each linked to the one before by the values it
reads from it (`links`: (output of the previous op, input of this op); input -1 = any
one input). A pattern with a `fused` primitive becomes that one op node, its inputs and
outputs taken from the chain's (`inputs`/`outputs`: (chain position, index); an optional
input the chain's op does not have, LayerNorm's absent bias, is left off); the fused
primitive's definition is the chain's computation, so the node computes exactly what the
chain did. A pattern without one (no single primitive, no runtime kernel) becomes a
fusion group: its member nodes stay as they are, each tagged `fusion_group` (see
docs/decisions.md "Fusion (issue 4)"). `automatic` patterns (the runtime has a kernel
for the fused primitive) are applied wherever they match and are exact (`exact_dtypes`);
the others only on request.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "silu", "relu", "relu2", "sigmoid")
GATED = ("swiglu", "geglu")

# Attributes the pass adds; not parameters of any primitive (the backward drops them).
FUSION_ATTRS = ("fusion", "fused_from", "fused_spans", "fused_intermediates", "fusion_group")


@dataclass(frozen=True)
class Link:
    ops: tuple[str, ...]  # primitives accepted at this position of the chain
    reads: tuple[tuple[int, int], ...] = ()  # (previous op's output, this op's input)


@dataclass(frozen=True)
class FusionPattern:
    name: str
    summary: str
    chain: tuple[Link, ...]
    condition: str = ""  # a named check of modulec.lower.fusion (shapes, arities)
    fused: str = ""  # the primitive the chain becomes; "" = a fusion group
    inputs: tuple[tuple[int, int], ...] = ()  # the fused op's inputs: (position, input)
    outputs: tuple[tuple[int, int], ...] = ()  # its outputs: (position, output)
    attrs: tuple[tuple[str, int, str], ...] = ()  # (its attr, position, that op's attr)
    automatic: bool = False
    # Automatic only when the chain's intermediates have one of these dtypes: the fused
    # kernel computes in fp32 and skips rounding them to a narrower storage dtype (the
    # reference fused_residual_rmsnorm normalizes the unrounded sum). () = always exact.
    exact_dtypes: tuple[str, ...] = ()


PATTERNS: tuple[FusionPattern, ...] = (
    FusionPattern(
        "residual_norm", "residual add + RMSNorm -> fused_residual_rmsnorm",
        (Link(("add",)), Link(("rmsnorm",), ((0, 0),))),
        condition="same_shapes", fused="fused_residual_rmsnorm",
        inputs=((0, 0), (0, 1), (1, 1)), outputs=((0, 0), (1, 0), (1, 1)),
        attrs=(("eps", 1, "eps"), ("offset", 1, "offset")), automatic=True, exact_dtypes=("fp32", "fp64")),
    FusionPattern(
        "residual_layernorm", "residual add + LayerNorm -> fused_residual_layernorm",
        (Link(("add",)), Link(("layernorm",), ((0, 0),))),
        condition="same_shapes", fused="fused_residual_layernorm",
        inputs=((0, 0), (0, 1), (1, 1), (1, 2)), outputs=((0, 0), (1, 0), (1, 1), (1, 2)),
        attrs=(("eps", 1, "eps"),), automatic=True, exact_dtypes=("fp32", "fp64")),
    FusionPattern(
        "gated_mlp", "split into (gate, up) + swiglu/geglu of the two halves",
        (Link(("split",)), Link(GATED, ((0, 0), (1, 1)))), condition="two_halves"),
    FusionPattern(
        "bias_activation", "add(bias) + activation",
        (Link(("add",)), Link(ACTIVATIONS, ((0, 0),))), condition="bias_add"),
    FusionPattern(
        "linear_bias_act", "matmul + add(bias) + activation",
        (Link(("matmul",)), Link(("add",), ((0, -1),)), Link(ACTIVATIONS, ((0, 0),))),
        condition="bias_add"),
    FusionPattern(
        "norm_linear", "RMSNorm + matmul of its output",
        (Link(("rmsnorm",)), Link(("matmul",), ((0, 0),)))),
    FusionPattern(
        "attention_softmax", "scale + softmax (the table's dropout has no primitive)",
        (Link(("scale",)), Link(("softmax",), ((0, 0),)))),
)

BY_NAME = {p.name: p for p in PATTERNS}
