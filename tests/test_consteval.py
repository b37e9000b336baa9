"""ConstExpr evaluation (spec §3.7)."""

import pytest

from modulec.semantic.consteval import ConstEnv, Ident, NotConst, Undefined, Unknown, evaluate
from modulec.syntax.parser import parse_text
from modulec.types.dims import Dim


def value(source: str, values=None, free="error"):
    program = parse_text(f"module M():\n  let:\n    v = {source}\n").program
    return evaluate(program.decls[0].body[0].body[0].value, ConstEnv(values or {}, free))


def test_integer_and_float_semantics_follow_python():
    assert value("7 // 2") == Dim.const(3)
    assert value("7 / 2") == 3.5
    assert value("2 ** 10") == Dim.const(1024)
    assert value("1.0 / sqrt(64)") == 0.125
    assert value("ceil_div(10, 4)") == Dim.const(3)


def test_symbols_stay_symbolic():
    d = Dim.sym("d")
    assert value("d // 4 * 4 + d", {"d": d}) == 4 * (d // 4) + d
    assert isinstance(value("d % 8 == 0", {"d": d}), Unknown)
    assert value("d % 8 == 0", {"d": Dim.const(16)}) is True


def test_booleans_and_conditionals():
    assert value("not (1 < 2 < 3)") is False
    assert value("x if c else y", {"c": True, "x": Dim.const(1), "y": Dim.const(2)}) == Dim.const(1)
    assert value("true and false or true") is True


def test_free_names():
    assert value("[B, T, 4]", free="symbol") == (Dim.sym("B"), Dim.sym("T"), Dim.const(4))
    assert value("NT", free="ident") == Ident("NT")
    with pytest.raises(Undefined):
        value("missing + 1")


def test_runtime_values_are_not_const():
    with pytest.raises(NotConst):
        value("x.shape[0] > 32")
    with pytest.raises(NotConst, match="division by zero"):
        value("1 // 0")


def test_int_and_floor_make_sizes_of_floats():
    """`int(d * factor)` (partial rotary) truncates like Python's int(), `floor` rounds
    down; an integer passes through; both are sizes (Dims)."""
    assert value("int(64 * 0.25)") == Dim.const(16)
    assert value("int(-2.5)") == Dim.const(-2)
    assert value("floor(-2.5)") == Dim.const(-3)
    assert value("floor(d)", {"d": Dim.sym("d")}) == Dim.sym("d")
    assert isinstance(value("int(d * 0.5)", {"d": Dim.sym("d")}), Unknown)
    for bad in ("int(true)", "int(1.0, 2.0)", 'floor("a")'):
        with pytest.raises(NotConst):
            value(bad)


@pytest.mark.parametrize("source,message", [
    ("sqrt(-1)", "square root of -1.0"),  # found by the fuzz run: math domain error, exit 101
    ("sqrt(0.0 - 2.5)", "square root of -2.5"),
    ("ceil_div(3, 0)", "divides by zero"),  # ZeroDivisionError in the Dim path
    ("ceil_div(3.5, 0.0)", "divides by zero"),
])
def test_intrinsics_outside_their_domain_are_not_const(source, message):
    with pytest.raises(NotConst, match=message):
        value(source)
    assert value("sqrt(0)") == 0.0 and value("ceil_div(7, 2)") == Dim.const(4)


BIG = "1" + "0" * 400  # an integer no float holds (found by the fuzz run, seeds 9 and 10)


def test_an_integer_past_the_floats_compares_exactly():
    """`partial_rotary_factor > 0.0` with the factor a 10^400 converted it to a float
    (OverflowError, exit 101); Python compares int with float exactly, and so does this."""
    assert value(f"{BIG} > 1.5") is True
    assert value(f"0.5 > -{BIG}") is True
    assert value(f"{BIG} == 1e308") is False


@pytest.mark.parametrize("source,message", [
    (f"{BIG} * 1.5", "past the largest float"),
    (f"{BIG} / 3", "past the largest float"),
    ("1.5 ** 100000", "past the largest float"),
    (f"max({BIG}, 1.5)", "past the largest float"),
    (f"sqrt({BIG})", "past the largest float"),
    ("3 ** 99999999", "more than 3,000 digits"),  # computed, it took minutes and gigabytes
    ("(0.0 - 8.0) ** 0.5", "has no real value"),  # Python's complex result
])
def test_numbers_past_the_floats_and_huge_powers_are_not_const(source, message):
    with pytest.raises(NotConst, match=message):
        value(source)
    assert value("(0 - 2) ** 9999") == Dim.const((-2) ** 9999) and value("1e308 * 10") == \
        float("inf")  # a float that overflows by arithmetic is inf (E003 where it must be finite)


def test_intrinsics_take_numbers_and_a_zero_divisor_is_caught_before_the_dividend():
    """Found by the fuzz run (seeds 18, 19): `sqrt(d_model)` with d_model undefined in an
    op's parameters (an Ident there) compared an Ident with 0 (TypeError, exit 101);
    `d % 0.0` with d unsized was unknown, then raised at sample sizes."""
    with pytest.raises(NotConst, match="not a number"):
        value("sqrt(NT)", free="ident")
    with pytest.raises(NotConst, match="not a number"):
        value('max(1, "a")')
    d = {"d": Dim.sym("d")}
    for source in ("d % 0.0", "d / 0", "d // 0", "(d * 0.5) / 0.0"):
        with pytest.raises(NotConst, match="division by zero"):
            value(source, d)
    assert isinstance(value("d / 2", d), Unknown) and isinstance(value("d % 2.0", d), Unknown)
