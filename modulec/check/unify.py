"""Matching actual tensor types against a signature's patterns (`[*, M, K]`, `[C]`, ...).

A signature names some dimensions by parameters or let constants (fixed values) and
leaves the others free (`B`, `T`, `M`): free names bind on first sight and must agree
afterwards; `*` binds a run of leading dimensions. The same matcher serves primitives and
calls to modules. A mismatch raises `ShapeError`, which the graph checker reports as E004
(or E015 for a dtype) at the argument that did not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.semantic.consteval import ConstEnv, Ident, NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.types.dims import Dim
from modulec.types.sampling import Assumptions
from modulec.types.tensor import DTYPES, TensorType


class ShapeError(Exception):
    """A shape (E004) or dtype (E015) mismatch; `argument` indexes the offending input."""

    def __init__(self, message: str, *, argument: int | None = None, label: str = "",
                 help: tuple[str, ...] = (), notes: tuple[str, ...] = (), code: str = "E004"):
        super().__init__(message)
        self.message, self.argument, self.label = message, argument, label
        self.help, self.notes, self.code = tuple(help), tuple(notes), code


@dataclass(frozen=True)
class Pattern:
    """A signature type: leading `*` or not, then dimension expressions, maybe a dtype."""

    variadic: bool
    dims: tuple[A.Expr, ...]
    dtype: str | None
    known: bool = True  # False when the signature's type is not a tensor shape we can read


def pattern_of(type_expr: A.Expr | None) -> Pattern:
    if isinstance(type_expr, A.OptionalType):
        type_expr = type_expr.value
    if not isinstance(type_expr, A.ListExpr):
        return Pattern(True, (), None, known=False)
    items = list(type_expr.items)
    dtype = None
    if items and isinstance(items[-1], A.Name) and items[-1].id in DTYPES:
        dtype = items.pop().id
    variadic = bool(items) and isinstance(items[0], A.Star) and items[0].suffix is None
    dims = tuple(items[1:] if variadic else items)
    if any(isinstance(d, A.Star) for d in dims):  # `*` in the middle: rank unknown
        return Pattern(True, (), dtype, known=False)
    return Pattern(variadic, dims, dtype)


@dataclass
class Matcher:
    """Binds a signature's free dimensions against actual types, one input at a time."""

    env: ConstEnv
    assumptions: Assumptions
    bound: dict[str, Dim] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    star: tuple[Dim, ...] | None = None
    star_origin: str = ""
    deferred: list = field(default_factory=list)
    unknown_input: bool = False  # an input of unknown shape (an earlier error's result)

    def match(self, pattern: Pattern, actual: TensorType, what: str, index: int) -> None:
        self._match_dtype(pattern, actual, what, index)
        if actual.variadic:
            self.unknown_input = True
        if not pattern.known or actual.variadic:
            return
        dims = self._match_rank(pattern, actual, what, index)
        for expr, dim in zip(pattern.dims, dims):
            self._match_dim(expr, dim, what, index, pattern, actual)

    def finish(self) -> None:
        """Check the dimensions given as expressions of free names, now all bound."""
        for expr, dim, what, index, pattern, actual in self.deferred:
            expected = self.value(expr)
            if expected is not None and self.assumptions.same(expected, dim) is False:
                raise ShapeError(
                    f"{what} has shape {actual}, expected {_show(pattern, self)}",
                    argument=index, label=f"dimension {dim} should be {expected}")

    def build(self, pattern: Pattern, default_dtype: str, fresh: str) -> TensorType:
        """An output type from its pattern; unbound names become fresh dimensions."""
        dtype = pattern.dtype or default_dtype
        if not pattern.known:
            return TensorType((), dtype, variadic=True)
        values = [self.value(e) for e in pattern.dims]
        if self.unknown_input and None in values:
            # a dim the unknown input would have bound: unknown too, not a fresh name that
            # every later step would report as a mismatch (`flash_attention.Hq` vs 4)
            return TensorType((), dtype, variadic=True)
        dims = [v or Dim.sym(f"{fresh}.{_name(e)}") for v, e in zip(values, pattern.dims)]
        prefix = self.star if pattern.variadic else ()
        if pattern.variadic and prefix is None:
            return TensorType(tuple(dims), dtype, variadic=True)
        return TensorType(tuple(prefix) + tuple(dims), dtype)

    def value(self, expr: A.Expr) -> Dim | None:
        values = dict(self.env.values)
        values.update(self.bound)
        try:
            result = evaluate(expr, ConstEnv(values, "error"))
        except (NotConst, Undefined):
            return None
        return result if isinstance(result, Dim) else None

    # ------------------------------------------------------------ pieces
    def _match_dtype(self, pattern: Pattern, actual: TensorType, what: str, index: int) -> None:
        if pattern.dtype is None:  # an undeclared dtype is a floating tensor
            if actual.is_int:
                raise ShapeError(f"{what} must be a floating tensor, found {actual.dtype}",
                                 argument=index, code="E015", label=f"{actual.dtype} tensor",
                                 help=("integer tensors (token ids, indices) go only where a "
                                       "signature says int32",))
            return
        if pattern.dtype.startswith("int") != actual.is_int:
            raise ShapeError(f"{what} must be {pattern.dtype}, found {actual.dtype}",
                             argument=index, code="E015",
                             label=f"expected {pattern.dtype}")

    def _match_rank(self, pattern: Pattern, actual: TensorType, what: str, index: int):
        fixed = len(pattern.dims)
        if not pattern.variadic:
            if len(actual.dims) != fixed:
                raise ShapeError(f"{what} has rank {len(actual.dims)}, expected {fixed} "
                                 f"({_show(pattern, self)})", argument=index,
                                 label=f"shape {actual}")
            return actual.dims
        if len(actual.dims) < fixed:
            raise ShapeError(f"{what} has rank {len(actual.dims)}, expected at least {fixed} "
                             f"({_show(pattern, self)})", argument=index, label=f"shape {actual}")
        lead = tuple(actual.dims[:len(actual.dims) - fixed])
        self._match_star(lead, what, index, actual)
        return actual.dims[len(actual.dims) - fixed:]

    def _match_star(self, lead, what, index, actual) -> None:
        if self.star is None:
            self.star, self.star_origin = lead, what
            return
        same = len(lead) == len(self.star) and all(
            self.assumptions.same(a, b) is not False for a, b in zip(lead, self.star))
        if not same:
            shown = ", ".join(map(str, self.star))
            raise ShapeError(f"{what} has shape {actual}, whose leading dims do not match "
                             f"[{shown}] (from {self.star_origin})", argument=index,
                             label=f"shape {actual}")

    def _match_dim(self, expr, dim, what, index, pattern, actual) -> None:
        if isinstance(expr, A.Name) and expr.id not in self.env.values and expr.id not in DTYPES:
            self._bind(expr.id, dim, what, index, pattern, actual)
            return
        expected = self.value(expr)
        if expected is None:
            self.deferred.append((expr, dim, what, index, pattern, actual))
        elif self.assumptions.same(expected, dim) is False:
            raise ShapeError(f"{what} has shape {actual}, expected {_show(pattern, self)}",
                             argument=index, label=f"dimension {dim} should be {expected}")

    def _bind(self, name, dim, what, index, pattern, actual) -> None:
        if name not in self.bound:
            self.bound[name], self.origin[name] = dim, what
            return
        if self.assumptions.same(self.bound[name], dim) is False:
            raise ShapeError(
                f"{what} has shape {actual}, expected {_show(pattern, self)}",
                argument=index,
                label=f"{dim} here, but {name} = {self.bound[name]} (from {self.origin[name]})")


def _show(pattern: Pattern, matcher: Matcher) -> str:
    parts = ["*"] if pattern.variadic else []
    for expr in pattern.dims:
        value = matcher.value(expr)
        parts.append(str(value) if value is not None else _name(expr))
    if pattern.dtype:
        parts.append(pattern.dtype)
    return "[" + ", ".join(parts) + "]"


def _name(expr) -> str:
    from modulec.syntax.printer import expr as show

    return show(expr)


def ident_value(value) -> str | None:
    return value.name if isinstance(value, Ident) else None
