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
# the sizes --verify-backward gives the dims of the inputs nobody sized (B, T, other)
FREE_DIM_SIZES, OTHER_DIM_SIZE = {"B": 2, "T": 4}, 3
KIND_HELP = {"int": "an int is a whole number (`32`, `4 * 1024`)",
             "float": "a float is a finite number (`0.5`, `1e-6`)",
             "bool": "a bool is `true` or `false`",
             "string": "a string is in quotes (`\"silu\"`) or a bare word (`silu`)"}
KINDS_HELP = ("an int is a whole number (`32`), a float a number (`0.5`, `1e-6`), a bool "
              "`true` or `false`, a string in quotes")
VALUE_HELP = ("a value is one expression, written as in a module: `32`, `4 * 1024`, `1e-6`, "
              "`true`, `\"silu\"` (a bare word is a string)")
NOT_FINITE = {"inf", "infinity", "nan"}  # words, not numbers, in the language


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
    kind = declared.id if isinstance(declared, A.Name) else None
    if kind == "float" and isinstance(value, Ident) and \
            value.name.lower().lstrip("+-") in NOT_FINITE:  # `--set eps=-inf`, `nan`
        return Problem("E027", f"`{param.name}` is {value.name}: a float parameter must be a "
                       "finite number", KIND_HELP["float"])
    if not fits_type(param.type, as_given(value)):
        return Problem("E003", f"`{param.name}` is declared {show(param.type)}, given "
                       f"{shown(value)[:60]}", _kind_help(kind, value))
    numbers = value if isinstance(value, tuple) else (value,)
    bad = next((v for v in numbers if isinstance(v, float) and not math.isfinite(v)), None)
    if bad is not None:
        return Problem("E027", f"`{param.name}` is {bad}: a float parameter must be a finite "
                       "number", "floats are 64-bit: `1e999` is inf")
    if isinstance(value, Dim) and value.is_const and kind != "float" and \
            not usable(value.value, param):
        return Problem("E027", f"`{param.name} = {shown(value)}` is not a usable "
                       f"{'integer' if _optional(param) else 'size'}", _bound_help(value, param))
    return None


def _kind_help(kind: str | None, value) -> str:
    if kind == "int" and isinstance(value, float) and math.isfinite(value) and \
            value.is_integer() and abs(value) <= MAX_SIZE:  # `1e3`, `5.0`: a float
        return f"{KIND_HELP['int']}: write `{int(value)}`; `1e3` and `5.0` are floats"
    if kind == "bool" and isinstance(value, Ident) and value.name.lower() in ("true", "false"):
        return f"{KIND_HELP['bool']} (lowercase): write `{value.name.lower()}`"
    return KIND_HELP.get(kind, KINDS_HELP)


def _bound_help(value: Dim, param: A.DeclParam) -> str:
    if _optional(param):
        return "an `int?` fits 64 bits: from -2^63 to 1,099,511,627,776 (2^40)"
    return "sizes are positive integers" + ("" if value.value <= 0 else f", at most {MAX_SIZE:,}")


def _optional(param: A.DeclParam | None) -> bool:
    return param is not None and isinstance(param.type, A.OptionalType)


def usable(value: int, param: A.DeclParam | None) -> bool:
    """An int argument is at most MAX_SIZE; one for a plain `int` parameter is a size, at
    least 1. An optional int (`int?`) need not be a size (Gemma's `padding_idx: int? = 0`
    takes HF's pad_token_id 0): its declaration's constraints bound it, and a value below 1
    that becomes a dimension is E027 where it does."""
    return value <= MAX_SIZE and (value > 0 or (_optional(param) and value >= -2**63))


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
    if isinstance(value, tuple):  # `--set n=[1, 2]`: it showed `(Dim(1), Dim(2))`
        return f"[{', '.join(shown(v) for v in value)}]"
    if isinstance(value, dict):  # a config.json field that is an object
        return "a JSON object"
    return "None" if value is None else str(value)


def _as_text(value) -> str:
    """A setting given from Python (`Model.from_module(settings={"n_layers": 2})`) as the
    text a `--set` would hold: a bool as `true` / `false`, a number as written."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def setting_value(text: str):
    """The value of `--set NAME=TEXT`: one compile-time expression, written as a default is
    in a module (`32`, `4 * 1024`, `1e-6`, `true`, `"silu"`, a bare word for a string).
    Returns (value, None), or (None, Problem) for text that is no such value: nothing,
    several lines, a comment, text that does not parse or does not evaluate (`n=`, `0x10`,
    `10**10**10` printed "given None" after the E003 that said so)."""
    from modulec.semantic.consteval import ConstEnv, NotConst, Undefined, evaluate
    from modulec.syntax.comments import comments_of
    from modulec.syntax.parser import parse_text

    stripped = _as_text(text).strip()
    if stripped.lower().lstrip("+-") in NOT_FINITE:  # `-inf` did not evaluate (a word)
        return Ident(stripped), None
    why = "no value" if not stripped else "a value is one line" if "\n" in stripped or \
        "\r" in stripped else "a comment (`#`) is not part of a value" if \
        comments_of(stripped) else _radix_problem(stripped)
    result = None if why else parse_text(f"module M():\n  let:\n    v = {stripped}\n", "--set")
    if result is not None and (result.diagnostics or result.program is None):
        first = result.diagnostics[0].message if result.diagnostics else "no expression"
        why = f"not an expression ({first})"
    if why is None:
        try:
            return evaluate(result.program.decls[0].body[0].body[0].value,
                            ConstEnv({}, "ident")), None
        except (NotConst, Undefined) as exc:
            why = f"not a compile-time value ({getattr(exc, 'reason', exc)})"
        except (AttributeError, IndexError, ValueError, OverflowError):
            why = "not a compile-time value"
    return None, Problem("E003", why, VALUE_HELP)


def _radix_problem(text: str) -> str | None:
    """`0x10` parsed as an array type (`[0] x 10`) and said so; numbers are decimal."""
    try:
        value = int(text, 0)
    except ValueError:
        return None
    return None if text.lstrip("+-")[:2].lower() not in ("0x", "0o", "0b") else \
        f"numbers are decimal: write `{value}`"
