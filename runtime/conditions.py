"""Conditions of `@assert(condition)` and `@probe(..., condition="...")` (spec §7.7.1,
§7.3.3), evaluated on tensors by the reference runtime.

The compiler prints a condition canonically (`!has_nan(out)` as `not has_nan(out)`, `&&` as
`and`), so it is a Python expression; it is evaluated by walking its syntax tree with a
fixed set of names and functions, never with `eval`. Names: the annotated value (by its
source name), the module's parameters (`d_model`), `finite` (the value has no NaN/Inf).
A tensor where a truth value is wanted (`out >= 0` in `and`, or as the whole condition)
counts as true when all its elements are.
"""

from __future__ import annotations

import ast
import operator

import torch
from torch import Tensor

from runtime.errors import RuntimeUserError


def _truth(value) -> bool:
    if isinstance(value, Tensor):
        return bool(value.all())
    return bool(value)


def _float(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_floating_point() else tensor.double()


FUNCTIONS = {
    "has_nan": lambda t: bool(torch.isnan(t).any()),
    "has_inf": lambda t: bool(torch.isinf(t).any()),
    "has_nan_or_inf": lambda t: not bool(torch.isfinite(t).all()),
    "is_finite": lambda t: bool(torch.isfinite(t).all()),
    "all": lambda t: _truth(t),
    "any": lambda t: bool(t.any()) if isinstance(t, Tensor) else bool(t),
    "abs": lambda t: t.abs() if isinstance(t, Tensor) else abs(t),
    "min": lambda t: float(t.min()) if isinstance(t, Tensor) else min(t),
    "max": lambda t: float(t.max()) if isinstance(t, Tensor) else max(t),
    "absmax": lambda t: float(t.abs().max()),
    "mean": lambda t: float(_float(t).mean()),
    "std": lambda t: float(_float(t).std()) if t.numel() > 1 else 0.0,
    "norm": lambda t: float(_float(t).norm()),
    "sum": lambda t: float(t.sum()) if isinstance(t, Tensor) else sum(t),
    "numel": lambda t: t.numel(),
    "len": len,
}
ATTRIBUTES = {
    "shape": lambda t: tuple(t.shape),
    "ndim": lambda t: t.dim(),
    "dtype": lambda t: str(t.dtype).replace("torch.", ""),
}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
          ast.Pow: operator.pow}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
           ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


class ConditionError(RuntimeUserError):
    """A condition the runtime cannot evaluate (unknown name, unsupported syntax)."""


def evaluate(condition: str, names: dict) -> bool:
    """The truth of `condition` with `names` bound (tensors, numbers, strings)."""
    try:
        tree = ast.parse(condition.strip(), mode="eval")
    except SyntaxError:
        raise ConditionError(f"cannot read the condition `{condition}`") from None
    return _truth(_Evaluator(names, condition).visit(tree.body))


class _Evaluator:
    def __init__(self, names: dict, text: str):
        self.names = names
        self.text = text

    def fail(self, what: str):
        raise ConditionError(f"{what} in the condition `{self.text}`",
                             help=[f"names: {', '.join(sorted(self.names))}; functions: "
                                   f"{', '.join(sorted(FUNCTIONS))}"])

    def visit(self, node):
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:
            self.fail(f"`{type(node).__name__}` is not supported")
        return method(node)

    def visit_Constant(self, node):
        return node.value

    def visit_Name(self, node):
        if node.id in self.names:
            return self.names[node.id]
        self.fail(f"unknown name `{node.id}`")

    def visit_BoolOp(self, node):
        if isinstance(node.op, ast.And):
            return all(_truth(self.visit(v)) for v in node.values)
        return any(_truth(self.visit(v)) for v in node.values)

    def visit_UnaryOp(self, node):
        value = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return not _truth(value)
        return -value if isinstance(node.op, ast.USub) else value

    def visit_BinOp(self, node):
        op = BINARY.get(type(node.op))
        if op is None:
            self.fail(f"operator `{type(node.op).__name__}` is not supported")
        return op(self.visit(node.left), self.visit(node.right))

    def visit_Compare(self, node):
        left, outcomes = self.visit(node.left), []
        for op, right_node in zip(node.ops, node.comparators):
            right = self.visit(right_node)
            if type(op) not in COMPARE:
                self.fail(f"comparison `{type(op).__name__}` is not supported")
            outcomes.append(COMPARE[type(op)](_plain(left), _plain(right)))
            left = right
        return outcomes[0] if len(outcomes) == 1 else all(map(_truth, outcomes))

    def visit_Call(self, node):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            name = getattr(node.func, "id", "this call")
            self.fail(f"unknown function `{name}`")
        return FUNCTIONS[node.func.id](*[self.visit(a) for a in node.args])

    def visit_Attribute(self, node):
        value = self.visit(node.value)
        if node.attr not in ATTRIBUTES or not isinstance(value, Tensor):
            self.fail(f"unknown attribute `.{node.attr}`")
        return ATTRIBUTES[node.attr](value)

    def visit_Subscript(self, node):
        return self.visit(node.value)[self.visit(node.slice)]

    def visit_Slice(self, node):
        parts = (node.lower, node.upper, node.step)
        return slice(*[self.visit(p) if p is not None else None for p in parts])

    def visit_Tuple(self, node):
        return tuple(self.visit(e) for e in node.elts)

    visit_List = visit_Tuple


def _plain(value):
    """Shapes compare as tuples: `out.shape == [2, 4]` holds for a tuple (2, 4)."""
    return tuple(value) if isinstance(value, list) else value


def parameter_values(args: tuple) -> dict:
    """A function's parameter values (`(("d_model", "32"), ...)`) as Python values."""
    values = {}
    for name, text in args:
        try:
            values[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[name] = {"true": True, "false": False}.get(text, text)
    return values
