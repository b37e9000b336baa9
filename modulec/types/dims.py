"""Symbolic dimensions: integer polynomials over named sizes, with opaque terms for the rest.

`3 * d_model` and `d_model + 2 * d_model` have one normal form, so most shape checks are
exact. What the algebra cannot decide (`num_heads * (d_model // num_heads)` against
`d_model`) is settled by evaluating both sides on sample sizes that satisfy the module's
constraints (see `modulec.types.sampling`): agreeing everywhere counts as equal,
disagreeing everywhere as different, and a mixed verdict reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isqrt
from typing import Callable, Mapping

Monomial = tuple  # sorted tuple of atoms (str symbols or Opaque terms), with repetition


@dataclass(frozen=True)
class Opaque:
    """A term the algebra keeps as is: `a // b`, `a % b`, `min(a, b)`, ..."""

    op: str
    args: tuple["Dim", ...]

    def __str__(self) -> str:
        if self.op in ("//", "%"):
            return f"({_operand(self.args[0])} {self.op} {_operand(self.args[1])})"
        return f"{self.op}({', '.join(map(str, self.args))})"

    def sort_key(self) -> str:
        return "~" + str(self)


def _operand(dim: "Dim") -> str:
    """An operand of `//` or `%` as text that reads back as itself: `(T + 63) // 64`."""
    text = str(dim)
    return f"({text})" if len(dim.terms) > 1 or text.startswith("-") else text


def _atom_key(atom) -> str:
    return atom if isinstance(atom, str) else atom.sort_key()


class Dim:
    """An immutable polynomial: {monomial: coefficient}, zero coefficients dropped."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]):
        clean = {m: c for m, c in terms.items() if c}
        object.__setattr__(self, "terms", tuple(sorted(clean.items(), key=_term_key)))
        object.__setattr__(self, "_hash", hash(self.terms))

    def __setattr__(self, name, value):
        raise AttributeError("Dim is immutable")

    # ------------------------------------------------------------ construction
    @staticmethod
    def const(value: int) -> "Dim":
        # what Dim({(): value}) makes, without its sort: the checker builds ~10^5 a second
        return _normal((((), value),) if value else ())

    @staticmethod
    def sym(name: str) -> "Dim":
        return Dim({(name,): 1})

    @staticmethod
    def opaque(op: str, *args: "Dim") -> "Dim":
        return Dim({(Opaque(op, args),): 1})

    # ------------------------------------------------------------ queries
    @property
    def is_const(self) -> bool:
        # the monomials are distinct, so a constant has at most one term, the empty one
        terms = self.terms
        return not terms or (len(terms) == 1 and not terms[0][0])

    @property
    def value(self) -> int:
        """The integer value of a constant Dim (0 for the empty polynomial)."""
        assert self.is_const, f"{self} is symbolic"
        return self.terms[0][1] if self.terms else 0

    def symbols(self) -> set[str]:
        found: set[str] = set()
        for monomial, _ in self.terms:
            for atom in monomial:
                found |= {atom} if isinstance(atom, str) else _opaque_symbols(atom)
        return found

    def evaluate(self, env: Mapping[str, int]) -> int:
        """The value with every symbol replaced by `env[symbol]` (KeyError if missing)."""
        total = 0
        for monomial, coefficient in self.terms:
            product = coefficient
            for atom in monomial:
                product *= env[atom] if isinstance(atom, str) else _eval_opaque(atom, env)
            total += product
        return total

    # ------------------------------------------------------------ arithmetic
    def __add__(self, other: "Dim | int") -> "Dim":
        other = as_dim(other)
        terms = dict(self.terms)
        for monomial, coefficient in other.terms:
            terms[monomial] = terms.get(monomial, 0) + coefficient
        return Dim(terms)

    __radd__ = __add__

    def __neg__(self) -> "Dim":
        return _normal(tuple((m, -c) for m, c in self.terms))  # same order, none zero

    def __sub__(self, other: "Dim | int") -> "Dim":
        return self + (-as_dim(other))

    def __rsub__(self, other: "Dim | int") -> "Dim":
        return as_dim(other) - self

    def __mul__(self, other: "Dim | int") -> "Dim":
        other = as_dim(other)
        terms: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                monomial = tuple(sorted(m1 + m2, key=_atom_key))
                terms[monomial] = terms.get(monomial, 0) + c1 * c2
        return Dim(terms)

    __rmul__ = __mul__

    def __floordiv__(self, other: "Dim | int") -> "Dim":
        other = as_dim(other)
        if self.is_const and other.is_const:
            return Dim.const(self.value // other.value) if other.value else Dim.opaque("//", self, other)
        exact = self.divide_exactly(other)
        return exact if exact is not None else Dim.opaque("//", self, other)

    def __mod__(self, other: "Dim | int") -> "Dim":
        other = as_dim(other)
        if self.is_const and other.is_const:
            return Dim.const(self.value % other.value) if other.value else Dim.opaque("%", self, other)
        if self.divide_exactly(other) is not None:
            return Dim.const(0)
        return Dim.opaque("%", self, other)

    def divide_exactly(self, divisor: "Dim") -> "Dim | None":
        """self / divisor when divisor is one term dividing every term of self, else None."""
        if len(divisor.terms) != 1:
            return None
        (d_monomial, d_coefficient), = divisor.terms
        result: dict[Monomial, int] = {}
        for monomial, coefficient in self.terms:
            rest = _remove_factors(monomial, d_monomial)
            if rest is None or coefficient % d_coefficient:
                return None
            result[rest] = result.get(rest, 0) + coefficient // d_coefficient
        return Dim(result)

    # ------------------------------------------------------------ identity and display
    def __eq__(self, other) -> bool:
        if isinstance(other, int):
            other = Dim.const(other)
        return isinstance(other, Dim) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        text = ""
        for index, (monomial, coefficient) in enumerate(reversed(self.terms)):
            term = _term_text(monomial, abs(coefficient))
            sign = "-" if coefficient < 0 else "+"
            text += (("-" if sign == "-" else "") + term) if index == 0 else f" {sign} {term}"
        return text

    def __repr__(self) -> str:
        return f"Dim({self})"


def _normal(terms: tuple) -> Dim:
    """A Dim of `terms` already in normal form (sorted, no zero coefficient)."""
    dim = object.__new__(Dim)
    object.__setattr__(dim, "terms", terms)
    object.__setattr__(dim, "_hash", hash(terms))
    return dim


def as_dim(value: "Dim | int") -> Dim:
    if isinstance(value, Dim):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a dimension must be an integer, not {value!r}")
    return Dim.const(value)


def intrinsic(name: str, args: list[Dim]) -> Dim:
    """min/max/abs/ceil_div/sqrt on dimensions: folded when constant, else opaque."""
    if all(a.is_const for a in args):
        return Dim.const(_INTRINSICS[name](*[a.value for a in args]))
    if name == "ceil_div":
        return (args[0] + args[1] - 1) // args[1]
    return Dim.opaque(name, *args)


_INTRINSICS: dict[str, Callable[..., int]] = {
    "min": min, "max": max, "abs": abs,
    "ceil_div": lambda a, b: -(-a // b),
    "sqrt": isqrt,
}


# ====================================================================== helpers
def _term_key(item) -> tuple:
    monomial, _ = item
    return (len(monomial), [_atom_key(a) for a in monomial])


def _remove_factors(monomial: Monomial, factors: Monomial) -> Monomial | None:
    rest = list(monomial)
    for factor in factors:
        if factor not in rest:
            return None
        rest.remove(factor)
    return tuple(rest)


def _term_text(monomial: Monomial, coefficient: int) -> str:
    atoms = [a if isinstance(a, str) else str(a) for a in monomial]
    if not atoms:
        return int_text(coefficient)
    return "*".join(([int_text(coefficient)] if coefficient != 1 else []) + atoms)


# a message shows an integer of up to 30 digits (an int64 has at most 19), its length past
MESSAGE_DIGITS = 30


def int_text(number: int, most_digits: int | None = None, grouped: bool = False) -> str:
    """An integer's digits (`grouped`: with commas, `1,099,511,627,776`), or its length:
    `<an integer of 351 digits>` past `most_digits` digits (a message's `MESSAGE_DIGITS`),
    `<an integer of about N digits>` past 10,000 bits whatever `most_digits`: Python
    refuses to print one of more than 4,300 digits (a `view` to 20,000 dims of 16 made a
    product whose message raised ValueError, exit 101). The one way modulec writes an
    integer that may be huge: dims, messages, settings."""
    if number.bit_length() > 10_000:
        # 2^(b-1) <= |n| < 2^b: at least floor((b-1) log10 2) + 1 digits, exact for a power of 2
        digits = int((number.bit_length() - 1) * 0.30102999566398120) + 1
        return f"<an integer of about {digits:,} digits>"
    text = str(number)
    length = len(text.lstrip("-"))
    if most_digits is not None and length > most_digits:
        return f"<an integer of {length:,} digits>"
    return f"{number:,}" if grouped else text


def _opaque_symbols(term: Opaque) -> set[str]:
    found: set[str] = set()
    for arg in term.args:
        found |= arg.symbols()
    return found


def _eval_opaque(term: Opaque, env: Mapping[str, int]) -> int:
    values = [arg.evaluate(env) for arg in term.args]
    if term.op == "//":
        return values[0] // values[1] if values[1] else 0
    if term.op == "%":
        return values[0] % values[1] if values[1] else 0
    return _INTRINSICS[term.op](*values)
