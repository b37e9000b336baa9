"""Symbolic dimensions and deciding their equality."""

import pytest
from hypothesis import given, settings, strategies as st

from modulec.types.dims import Dim, intrinsic
from modulec.types.sampling import Assumptions

d, h, kv, f = (Dim.sym(n) for n in ("d_model", "num_heads", "num_kv_heads", "d_ff"))


def test_normal_forms_make_equal_expressions_equal():
    assert d + d + d == 3 * d
    assert (d + h) * 2 == 2 * h + 2 * d
    assert (2 * d) // 2 == d
    assert (4 * d) % 2 == Dim.const(0)
    assert str((h + 2 * kv) * (d // h)) == "2*num_kv_heads*(d_model // num_heads) + num_heads*(d_model // num_heads)"


def test_constants_fold():
    assert (Dim.const(7) // 2).value == 3 and (Dim.const(7) % 2).value == 1
    assert intrinsic("ceil_div", [Dim.const(7), Dim.const(2)]).value == 4
    assert intrinsic("min", [Dim.const(3), Dim.const(9)]).value == 3


def test_undecidable_equalities_are_settled_on_samples():
    a = Assumptions()
    assert a.same(h * (d // h), d) is True          # exact division intended
    assert a.same(d, f) is False                     # different sizes
    assert a.same((h + 2 * kv) * (d // h), 3 * d) is False  # GQA rows are not 3 * d_model


def test_constraints_restrict_the_samples():
    a = Assumptions()
    a.add_fact({"num_heads", "num_kv_heads"}, lambda e: e["num_heads"] == e["num_kv_heads"])
    assert a.same((h + 2 * kv) * (d // h), 3 * d) is True


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 5), st.sampled_from(["a", "b", "c", ""])), max_size=6),
       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 50), min_size=3))
def test_evaluation_matches_arithmetic(terms, env):
    dim = Dim.const(0)
    expected = 0
    for coefficient, name in terms:
        atom = Dim.sym(name) if name else Dim.const(1)
        dim = dim + coefficient * atom * atom
        expected += coefficient * (env[name] if name else 1) ** 2
    assert dim.evaluate(env) == expected


# ====================================================================== dims read back
@pytest.mark.parametrize("text", ["4096", "B", "2*d_ff", "B*T + 1", "(d_model // num_heads)",
                                  "min(T, 4096)", "-x", "ceil_div(T, 64)", "(a - b) % c"])
def test_a_dim_reads_back_as_itself(text):
    from modulec.types.dim_text import parse_dim

    dim = parse_dim(text)
    assert parse_dim(str(dim)) == dim  # an IR stores str(dim): it must mean the same dim


def test_compound_operands_of_floor_division_keep_their_parentheses():
    # `(T + 63 // 64)` would read back as T
    assert str(intrinsic("ceil_div", [Dim.sym("T"), Dim.const(64)])) == "((T + 63) // 64)"


@pytest.mark.parametrize("text", ["", "__import__('os')", "4 +", "(3", "a b", "1e3", "3/2",
                                  "x" * 500])
def test_what_is_not_a_dim_is_refused(text):
    from modulec.types.dim_text import parse_dim

    with pytest.raises(ValueError, match="not a dimension"):
        parse_dim(text)


def test_a_constant_past_python_s_printing_limit_prints_its_length():
    """Found by the fuzz run (seed 8: a `view` to 20,000 dims of 16): the element count
    16^20000 has 24,083 digits and str() of it raised ValueError in the E004 message."""
    from modulec.types.dims import int_text

    assert str(Dim.const(12)) == "12" and int_text(10**3000) == "1" + "0" * 3000
    big = Dim.const(16 ** 20000)
    assert str(big) == "<an integer of about 24,083 digits>"
    assert str(big * Dim.sym("B")) == "<an integer of about 24,083 digits>*B"


def test_messages_write_integers_as_dims_do():
    """One rendering of an integer that may be huge (instance, given and the op registry had
    their own: "a number of more than 300 digits", "an integer of 56 digits" for a list):
    digits, grouped in a message, and the length past MESSAGE_DIGITS digits."""
    from modulec.types.dims import MESSAGE_DIGITS, int_text

    assert int_text(-2**63, MESSAGE_DIGITS, grouped=True) == "-9,223,372,036,854,775,808"
    assert int_text(10**MESSAGE_DIGITS - 1, MESSAGE_DIGITS) == "9" * MESSAGE_DIGITS
    assert int_text(-10**600, MESSAGE_DIGITS, grouped=True) == "<an integer of 601 digits>"
    assert int_text(2**80000, MESSAGE_DIGITS) == int_text(2**80000) == \
        "<an integer of about 24,083 digits>"
