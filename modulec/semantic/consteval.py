"""ConstExpr evaluation (spec §3.7): literals, parameters, let-bound constants, arithmetic,
comparisons, boolean logic and the pure intrinsics.

Integers are `Dim`s, so a module checked without concrete sizes keeps them symbolic
(`d_model // num_heads`); floats and booleans that depend on unknown sizes are `Unknown`.
`/` is true division (a float), `//` floor division, as in Python. Evaluation raises
`NotConst` when it meets a runtime value (a tensor, `x.shape`) and `Undefined` for a name
that is nothing at all; the caller turns those into E016/E026/E002.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from modulec.syntax import ast as A
from modulec.types.dims import Dim, intrinsic
from modulec.types.tensor import DTYPES

INTRINSICS = ("sqrt", "ceil_div", "min", "max", "abs", "int", "floor")
# float -> integer: `int` truncates toward zero (Python's int()), `floor` rounds down
TO_INTEGER = {"int": int, "floor": math.floor}
# `a ** b` of integers: past this many bits (some 3,000 digits, far beyond any size:
# dims are at most 2^40) it is refused instead of computed
MAX_POWER_BITS = 10_000


@dataclass(frozen=True)
class Ident:
    """A bare identifier used as a value: an enum member (`NT`, `silu`) or a dtype."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Unknown:
    """A float/bool/int whose value depends on sizes not known yet."""

    kind: str  # "float" | "bool"

    def __str__(self) -> str:
        return f"<{self.kind}>"


class NotConst(Exception):
    def __init__(self, node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


class Undefined(Exception):
    def __init__(self, node: A.Name):
        super().__init__(node.id)
        self.node = node


Value = object  # Dim | float | bool | str | None | Ident | Unknown | tuple


@dataclass
class ConstEnv:
    """Names visible to a ConstExpr, and how to treat the others.

    `free`: "error" (raise Undefined), "symbol" (a fresh dimension, e.g. `B`, `T` in a type),
    or "ident" (an enum member). `runtime` names (tensors) raise NotConst.
    """

    values: Mapping[str, Value]
    free: str = "error"
    runtime: Callable[[str], bool] = lambda name: False

    def with_free(self, free: str) -> "ConstEnv":
        return ConstEnv(self.values, free, self.runtime)


def evaluate(node, env: ConstEnv) -> Value:
    handler = _HANDLERS.get(type(node))
    if handler is None:
        raise NotConst(node, f"{_describe(node)} is not a compile-time value")
    try:
        return handler(node, env)
    except OverflowError:  # `10 ** 400 * 1.5`, `1.5 ** 100000`: no float holds it
        raise NotConst(node, "a number past the largest float (about 1.8e308)") from None


def truth(value: Value) -> bool | Unknown:
    if isinstance(value, Unknown):
        return Unknown("bool")
    if isinstance(value, Dim):
        return value.value != 0 if value.is_const else Unknown("bool")
    return bool(value)


# ====================================================================== leaves
def _name(node: A.Name, env: ConstEnv) -> Value:
    if node.id in env.values:
        return env.values[node.id]
    if env.runtime(node.id):
        raise NotConst(node, f"`{node.id}` is a tensor, known only at run time")
    if node.id in DTYPES or env.free == "ident":
        return Ident(node.id)
    if env.free == "symbol":
        return Dim.sym(node.id)
    raise Undefined(node)


def _number(node: A.Number, env: ConstEnv) -> Value:
    value = node.value
    return Dim.const(value) if isinstance(value, int) else value


def _constant(node, env: ConstEnv) -> Value:
    if isinstance(node, A.String):
        return node.value
    if isinstance(node, A.Bool):
        return node.value
    return None


def _sequence(node, env: ConstEnv) -> Value:
    if isinstance(node, A.ListExpr):
        return tuple(evaluate(item, env) for item in node.items)
    return tuple(evaluate(item.value, env) for item in node.items)


def _attribute(node: A.Attribute, env: ConstEnv) -> Value:
    base = node.value
    if isinstance(base, A.Name) and env.runtime(base.id):
        raise NotConst(node, f"`{base.id}.{node.attr}` depends on a tensor, known only at run time")
    raise NotConst(node, f"`{_describe(node)}` is not a compile-time value")


# ====================================================================== operators
def _unary(node: A.Unary, env: ConstEnv) -> Value:
    value = evaluate(node.operand, env)
    if node.op == "not":
        result = truth(value)
        return result if isinstance(result, Unknown) else not result
    if isinstance(value, Unknown):
        return value
    _require_number(value, node.operand)
    return -value if node.op == "-" else value


def _binary(node: A.Binary, env: ConstEnv) -> Value:
    if node.op in ("and", "or"):
        return _logic(node, env)
    left, right = evaluate(node.left, env), evaluate(node.right, env)
    for value, side in ((left, node.left), (right, node.right)):
        if not isinstance(value, Unknown):
            _require_number(value, side)
    if node.op in ("/", "//", "%") and _is_zero(right):  # whatever `left` is (`d % 0.0`)
        raise NotConst(node, "division by zero")
    if isinstance(left, Unknown) or isinstance(right, Unknown):
        return Unknown("float")
    return _arithmetic(node, left, right)


def _is_zero(value) -> bool:
    if isinstance(value, Dim):
        return value.is_const and value.value == 0
    return isinstance(value, float) and value == 0


def _arithmetic(node: A.Binary, left, right) -> Value:
    if isinstance(left, Dim) and isinstance(right, Dim):
        return _integer_arithmetic(node, left, right)
    left, right = _as_float(left), _as_float(right)
    if isinstance(left, Unknown) or isinstance(right, Unknown):
        return Unknown("float")
    try:
        result = _FLOAT_OPS[node.op](left, right)
    except ZeroDivisionError:
        raise NotConst(node, "division by zero") from None
    if isinstance(result, complex):  # Python's `(-8.0) ** 0.5`
        raise NotConst(node, f"`{_describe(node)}` has no real value")
    return result


def _integer_arithmetic(node: A.Binary, left: Dim, right: Dim) -> Value:
    op = node.op
    if op in ("+", "-", "*"):
        return {"+": left + right, "-": left - right, "*": left * right}[op]
    if op in ("//", "%"):
        if right.is_const and right.value == 0:
            raise NotConst(node, "division by zero")
        return left // right if op == "//" else left % right
    if op == "**":
        if left.is_const and right.is_const and right.value >= 0:
            if abs(left.value) > 1 and right.value * (abs(left.value).bit_length() - 1) \
                    > MAX_POWER_BITS:  # `3 ** 99999999` took minutes and gigabytes
                raise NotConst(node, f"`{_describe(node)}` is an integer of more than "
                                     f"{MAX_POWER_BITS * 3 // 10:,} digits")
            return Dim.const(left.value ** right.value)
        return Unknown("float")
    # "/" is true division: a float
    if left.is_const and right.is_const:
        if right.value == 0:
            raise NotConst(node, "division by zero")
        return left.value / right.value
    return Unknown("float")


def _logic(node: A.Binary, env: ConstEnv) -> Value:
    left = truth(evaluate(node.left, env))
    if node.op == "and" and left is False or node.op == "or" and left is True:
        return left
    right = truth(evaluate(node.right, env))
    if isinstance(left, Unknown) or isinstance(right, Unknown):
        return right if right is (node.op == "or") else Unknown("bool")
    return right


def _compare(node: A.Compare, env: ConstEnv) -> Value:
    result: bool | Unknown = True
    left = evaluate(node.first, env)
    for op, operand in node.rest:
        right = evaluate(operand, env)
        if op not in ("==", "!=") and not (_orderable(left) and _orderable(right)):
            raise NotConst(node, f"`{op}` compares numbers; this compares {_kind(left)} "
                                 f"with {_kind(right)}")
        verdict = _compare_pair(op, left, right)
        if verdict is False:
            return False
        if isinstance(verdict, Unknown):
            result = verdict
        left = right
    return result


def _orderable(value) -> bool:
    return isinstance(value, (Dim, float, Unknown)) and not isinstance(value, bool)


def _compare_pair(op: str, left, right) -> bool | Unknown:
    if isinstance(left, Dim) and isinstance(right, Dim):
        if left.is_const and right.is_const:
            left, right = left.value, right.value
        elif op in ("==", "!=") and (left - right).is_const:
            equal = left == right
            return equal if op == "==" else not equal
        else:
            return Unknown("bool")
    left, right = _as_real(left), _as_real(right)  # exact: `10 ** 400 > 1.5` is true
    if isinstance(left, Unknown) or isinstance(right, Unknown):
        return Unknown("bool")
    return _COMPARISONS[op](left, right)


def _if(node: A.IfExp, env: ConstEnv) -> Value:
    test = truth(evaluate(node.test, env))
    if node.orelse is None:
        raise NotConst(node, "a conditional value needs `else`")
    if isinstance(test, Unknown):
        body, orelse = evaluate(node.body, env), evaluate(node.orelse, env)
        return body if body == orelse else Unknown("float" if isinstance(body, float) else "bool")
    return evaluate(node.body if test else node.orelse, env)


def _call(node: A.Call, env: ConstEnv) -> Value:
    name = node.func.id if isinstance(node.func, A.Name) else None
    if name not in INTRINSICS or any(arg.key is not None for arg in node.args):
        raise NotConst(node, f"`{_describe(node.func)}(...)` is not a compile-time function "
                             f"(those are {', '.join(INTRINSICS)})")
    args = [evaluate(arg.value, env) for arg in node.args]
    return _apply_intrinsic(node, name, args)


def _apply_intrinsic(node, name: str, args: list) -> Value:
    arity = {"sqrt": 1, "abs": 1, "ceil_div": 2, "int": 1, "floor": 1}.get(name)
    if arity is not None and len(args) != arity or not args:
        raise NotConst(node, f"`{name}` takes {arity or 'at least one'} argument(s)")
    if name in TO_INTEGER:
        return _to_integer(node, name, args[0])
    for value, arg in zip(args, node.args):  # `sqrt(NT)`: a name, not a number
        if not isinstance(value, Unknown):
            _require_number(value, arg.value)
    if any(isinstance(a, Unknown) for a in args):
        return Unknown("float")
    if name == "sqrt":
        value = _as_float(args[0])
        if isinstance(value, Unknown):
            return Unknown("float")
        if not value >= 0:  # a negative number, or nan
            raise NotConst(node, f"`sqrt({_describe(node.args[0].value)})` is the square root "
                                 f"of {value}, which has none")
        return math.sqrt(value)
    if name == "ceil_div" and _as_float(args[1]) == 0:
        raise NotConst(node, f"`ceil_div({_describe(node.args[0].value)}, "
                             f"{_describe(node.args[1].value)})` divides by zero")
    if all(isinstance(a, Dim) for a in args):
        return intrinsic(name, list(args))
    floats = [_as_float(a) for a in args]
    if any(isinstance(f, Unknown) for f in floats):
        return Unknown("float")
    return {"min": min, "max": max, "abs": abs,
            "ceil_div": lambda a, b: math.ceil(a / b)}[name](*floats)


def _to_integer(node: A.Call, name: str, value) -> Value:
    """`int(x)` / `floor(x)`: an integer (a Dim, usable as a size) from a number; an integer
    stays itself. A float that depends on sizes not known yet is Unknown."""
    _require_number(value, node.args[0].value) if not isinstance(value, Unknown) else None
    if isinstance(value, (Dim, Unknown)):
        return value
    if not math.isfinite(value):
        raise NotConst(node, f"`{name}({_describe(node.args[0].value)})` is `{name}` of "
                             f"{value}, which is no integer")
    return Dim.const(TO_INTEGER[name](value))


# ====================================================================== helpers
def _require_number(value, node) -> None:
    if isinstance(value, bool) or not isinstance(value, (Dim, float)):
        raise NotConst(node, f"`{_describe(node)}` is {_kind(value)}, not a number")


def _as_real(value) -> int | float | Unknown:
    """A number as Python compares it: an integer stays exact (no float conversion that a
    10^400 overflows)."""
    if isinstance(value, Dim):
        return value.value if value.is_const else Unknown("float")
    return value


def _as_float(value) -> float | Unknown:
    if isinstance(value, Dim):
        return float(value.value) if value.is_const else Unknown("float")
    return value


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "None"
    if isinstance(value, Ident):
        return f"the name `{value.name}`"
    if isinstance(value, (Dim, float)):
        return "a number"
    return "a list" if isinstance(value, tuple) else type(value).__name__


def _describe(node) -> str:
    from modulec.syntax.printer import expr

    try:
        return expr(node)
    except TypeError:
        return type(node).__name__


_FLOAT_OPS = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a / b, "//": lambda a, b: a // b, "%": lambda a, b: a % b,
    "**": lambda a, b: a ** b,
}
_COMPARISONS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b,
}
_HANDLERS = {
    A.Name: _name, A.Number: _number, A.String: _constant, A.Bool: _constant,
    A.NoneLit: _constant, A.ListExpr: _sequence, A.TupleExpr: _sequence,
    A.Attribute: _attribute, A.Unary: _unary, A.Binary: _binary, A.Compare: _compare,
    A.IfExp: _if, A.Call: _call,
}
