"""Parameter values given from outside the program's text: `--set`, `--config`, and the
`shapes:` lines of a `verify_backward:` section (which `--verify-backward` passes to the
build as settings). One rule for all of them (docs/decisions.md, "Sizes"): the value has
the parameter's declared kind (E003), an `int` is a size (1 .. 2^40; an `int?` may be
below 1) and a float is finite (E027).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modulec.check.instance import MAX_DIM, fits_type
from modulec.semantic.consteval import Ident
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show
from modulec.types.dims import MESSAGE_DIGITS, Dim, int_text

MAX_SIZE = MAX_DIM  # the largest size a parameter or a dim may be given
SEQUENCE_DIM, SEQUENCE_BOUND = "T", "max_seq"  # a `T` past `max_seq` is refused
# the most parameters (and the largest value) --verify-backward checks by finite differences
VERIFY_MAX_ELEMENTS = 20_000_000
KINDS_HELP = ("an int is a whole number (`32`), a float a number (`0.5`, `1e-6`), a bool "
              "`true` or `false`, a string in quotes")


@dataclass(frozen=True)
class Problem:
    code: str
    message: str  # without the place it was given (`--set d`, a `shapes:` line)
    help: str


def as_given(value):
    """`--set act=silu` reads a bare word: it may stand for a string."""
    return value.name if isinstance(value, Ident) else value


def value_problem(param: A.DeclParam, value) -> Problem | None:
    declared = param.type.value if isinstance(param.type, A.OptionalType) else param.type
    if not fits_type(param.type, as_given(value)):
        return Problem("E003", f"`{param.name}` is declared {show(param.type)}, given "
                       f"{shown(value)[:60]}", KINDS_HELP)
    numbers = value if isinstance(value, tuple) else (value,)
    bad = next((v for v in numbers if isinstance(v, float) and not math.isfinite(v)), None)
    if bad is not None:
        return Problem("E027", f"`{param.name}` is {bad}: a float parameter must be a finite "
                       "number", "floats are 64-bit: `1e999` is inf")
    is_float = isinstance(declared, A.Name) and declared.id == "float"
    if isinstance(value, Dim) and value.is_const and not is_float and \
            not usable(value.value, param):
        return Problem("E027", f"`{param.name} = {shown(value)}` is not a usable size",
                       "sizes are positive integers" + ("" if value.value <= 0 else
                                                        f", at most {MAX_SIZE:,}"))
    return None


def usable(value: int, param: A.DeclParam | None) -> bool:
    """An int argument is at most MAX_SIZE; one for a plain `int` parameter is a size, at
    least 1. An optional int (`int?`) need not be a size (Gemma's `padding_idx: int? = 0`
    takes HF's pad_token_id 0): its declaration's constraints bound it, and a value below 1
    that becomes a dimension is E027 where it does."""
    optional = param is not None and isinstance(param.type, A.OptionalType)
    return value <= MAX_SIZE and (value > 0 or optional)


def shown(value) -> str:
    """A given value for a message, an integer as `dims.int_text` writes it in one."""
    if isinstance(value, Ident):
        return value.name
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Dim) and value.is_const:
        return int_text(value.value, MESSAGE_DIGITS, grouped=True)
    return str(value)
