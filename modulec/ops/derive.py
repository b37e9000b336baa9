"""What one application of a primitive returns, from the op table alone.

The checker computes a call's output types with the call's source at hand
(modulec.check.calls); the IR verifier has only the op's input types and parameter values.
Both ask the same rules: a primitive's shape rule (modulec.ops.shapes_*), else its
signature; a backward's `d_x` has the type of the `x` it reads (its signature is written
for the default `transpose` mode, so the operand's own type is the reliable answer).
"""

from __future__ import annotations

from modulec.ops.registry import OpCall
from modulec.ops.shapes_special import by_signature
from modulec.syntax import ast as A
from modulec.types.tensor import TensorType


def output_types(call: OpCall, backward: bool) -> list[TensorType] | None:
    """The outputs of `call` (forward or backward), or None where the op table cannot say
    (a list input without a shape rule). Raises ShapeError when the inputs do not fit."""
    definition = call.rule.definition
    phase = definition.backward if backward else definition.forward
    if not backward and call.rule.shape is not None:
        return call.rule.shape(call)
    if any(isinstance(sig.type, A.ArrayType) for sig in phase.inputs + phase.outputs):
        return None
    if not backward:
        return signature_types(call, phase)
    given = {sig.name: t for sig, t in zip(phase.inputs, call.inputs) if t is not None}
    known = [given.get(sig.name[2:]) if sig.name.startswith("d_") else None
             for sig in phase.outputs]
    if all(k is not None for k in known) and _mode_changed(call):
        return known
    matched = signature_types(call, phase)
    return [k if k is not None else m for k, m in zip(known, matched)]


def signature_types(call: OpCall, phase) -> list[TensorType]:
    """The phase's signature matched against the call's inputs: its output types."""
    return by_signature(call, phase)[1]


def _mode_changed(call: OpCall) -> bool:
    """Whether a `transpose` parameter differs from the mode the signatures are written in."""
    spec = next((p for p in call.rule.params if p.name == "transpose"), None)
    return spec is not None and call.params.get("transpose") != spec.default
