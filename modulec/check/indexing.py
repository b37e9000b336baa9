"""Subscripts of a tensor (`x[:, -1]`, `h[:, 1:]`, `x[..., 0]`): views, typed and lowered.

Each integer subscript is a `select` (the dim goes), each slice with a bound a `slice`
(the dim keeps a range), `:` leaves its dim and `...` stands for the dims not named.
The ops' shape rules (modulec.ops.shapes_tensor) give the type, their backward rules the
gradient. Indices and bounds are compile-time integers: indexing with a tensor is an
`embedding` (gather), not a subscript.
"""

from __future__ import annotations

from modulec.check.calls import UNKNOWN
from modulec.check.scope import Tensor
from modulec.check.unify import ShapeError
from modulec.lower.value_marks import At
from modulec.ops.registry import OpCall, op_table
from modulec.semantic.consteval import NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.types.dims import Dim


class _NotAnIndex(Exception):
    def __init__(self, node) -> None:
        super().__init__()
        self.node = node


def index_tensor(checker, expr: A.Index, base: Tensor) -> Tensor:
    """The tensor `base[subscripts]`; while recording, its select / slice nodes (one set
    per subscript expression, however often it is looked up)."""
    world = checker.world
    if base.type.variadic:
        if base.type is not UNKNOWN:
            world.error("E004", f"cannot index `{base.name or 'this tensor'}`: its rank is not "
                        "known here", expr.span, f"shape {base.type}",
                        help=["give the tensor a shape of known rank (`[B, T, d]`)"])
        return Tensor("", UNKNOWN, expr.span)
    try:
        steps = _steps(checker.instance, expr, len(base.type.dims))
    except _NotAnIndex as exc:
        world.error("E003", "a subscript must be a compile-time integer or a slice of them",
                    exc.node.span, "not a constant",
                    help=["to pick rows by a tensor of indices, use `embedding()`"])
        return Tensor("", UNKNOWN, expr.span)
    except ShapeError as exc:
        world.error(exc.code, exc.message, expr.span, exc.label, help=list(exc.help))
        return Tensor("", UNKNOWN, expr.span)
    return _apply(checker, expr, base, steps)


def _steps(instance, expr: A.Index, rank: int) -> list[tuple[str, dict]]:
    named = [s for s in expr.subscripts if not isinstance(s, A.Ellipsis_)]
    if len(named) > rank:
        raise ShapeError(f"{len(named)} subscripts for a tensor of rank {rank}")
    if len(named) < len(expr.subscripts) - 1:
        raise ShapeError("a subscript may have one `...`")
    steps, axis = [], 0
    for subscript in expr.subscripts:
        if isinstance(subscript, A.Ellipsis_):
            axis += rank - len(named)
        elif isinstance(subscript, A.Slice):
            if subscript.lower is not None or subscript.upper is not None:
                start = _integer(instance, subscript.lower) if subscript.lower else 0
                end = _integer(instance, subscript.upper) if subscript.upper else None
                steps.append(("slice", {"dim": axis, "start": start, "end": end}))
            axis += 1
        else:
            steps.append(("select", {"dim": axis, "index": _integer(instance, subscript)}))
    return steps


def _integer(instance, node) -> int:
    try:
        value = evaluate(node, instance.env())
    except (NotConst, Undefined):
        raise _NotAnIndex(node) from None
    if isinstance(value, Dim) and value.is_const:
        return value.value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _NotAnIndex(node)


def _apply(checker, expr: A.Index, base: Tensor, steps) -> Tensor:
    recorder = checker.recorder
    key = ("index", expr.span.file, expr.span.start, expr.span.end)
    type_, value = base.type, base.value
    for op, params in steps:
        rule = op_table()[op]
        bound = {k: Dim.const(v) if isinstance(v, int) else v for k, v in params.items()}
        try:
            (type_,) = rule.shape(OpCall(rule, [type_], bound, checker.instance.assumptions))
        except ShapeError as exc:
            checker.world.error(exc.code, exc.message, expr.span, exc.label,
                                help=list(exc.help))
            return Tensor("", UNKNOWN, expr.span)
        if recorder is not None and value and key not in recorder.marked:
            from modulec.lower.recorder import attr_value

            result = recorder.fresh(type_)
            attrs = tuple(sorted((k, attr_value(v)) for k, v in params.items()))
            recorder.node("op", op, [value], [result], At(expr.span), attrs)
            value = result
    if recorder is not None and value:
        value = recorder.marked.setdefault(key, value)
    return Tensor("", type_, expr.span, value=value if recorder is not None else "")
