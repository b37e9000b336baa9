"""`@dtype` and `@gradient` on a value, lowered to the ops that do what they say.

Written on a flow's destination (`-> a @dtype(fp32)`, `-> aux @gradient(skip)`), on an
input or on a parameter, they act on that value where it is written and on nothing else:
the op that produced it keeps its output; a `cast` (§7.4.1: "insert conversion kernel")
and then a `stop_gradient` or `scale_gradient` (§7.8.3) make a new value, which every
consumer of the name reads. A parameter's `@dtype` is its storage dtype (its type already
says it, modulec.check.instance); its `@gradient` acts on the sum of its uses' gradients
within the function that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.semantic.consteval import ConstEnv, NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.types.tensor import TensorType

SKIP, COMPUTE = "skip", "compute"


def gradient_spec(annotations, env=None) -> tuple[str, float, float | None] | None:
    """(mode, scale, clip) of the first `@gradient` among `annotations` (None: none);
    `accumulate` and `checkpoint` compute the gradient as usual."""
    from modulec.check.annotation_table import argument_values

    note = next((a for a in annotations if a.name == "gradient"), None)
    if note is None:
        return None
    values = argument_values(note)
    mode = values.get("mode")
    return (mode.id if isinstance(mode, A.Name) else COMPUTE,
            number(values.get("scale"), 1.0, env), number(values.get("clip"), None, env))


def cast_of(annotations) -> str | None:
    note = next((a for a in annotations if a.name == "dtype"), None)
    value = note.args[0].value if note is not None and note.args else None
    return value.id if isinstance(value, A.Name) else None


def mark(recorder, env, value: str, type_: TensorType, annotations, span,
         cast: bool = True) -> tuple[str, TensorType]:
    """Record the cast and gradient ops the annotations ask for after `value` (written at
    `span`; `env` evaluates their arguments); the value (and type) the name stands for
    from here on."""
    if recorder is None or recorder.phase != "forward":
        return value, type_
    at = At(span)
    target = cast_of(annotations) if cast else None
    if target is not None and target != type_.dtype:
        type_ = type_.with_dtype(target)
        value = _op(recorder, "cast", value, type_, at, (("dtype", target),))
    spec = gradient_spec(annotations, env)
    if spec is None:
        return value, type_
    mode, scale, clip = spec
    if mode == SKIP:
        return _op(recorder, "stop_gradient", value, type_, at, ()), type_
    if scale != 1.0 or clip is not None:
        attrs = (("clip", clip), ("scale", scale))
        value = _op(recorder, "scale_gradient", value, type_, at, attrs)
    return value, type_


@dataclass(frozen=True)
class At:
    """Where an inserted op is written (it carries no annotations of its own)."""

    span: object


def _op(recorder, target: str, value: str, type_: TensorType, step, attrs) -> str:
    result = recorder.fresh(type_)
    recorder.node("op", target, [value], [result], step, attrs)
    return result


def number(node, default, env):
    """A numeric annotation argument, evaluated in `env` (absent or `None`: `default`)."""
    if node is None or isinstance(node, A.NoneLit):
        return default
    try:
        return float(evaluate(node, env or ConstEnv({})))
    except (NotConst, Undefined, TypeError, ValueError):
        return default
