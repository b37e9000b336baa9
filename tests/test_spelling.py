"""Edit distance for "did you mean": a swap of neighbouring letters is one typo."""

from hypothesis import given
from hypothesis import strategies as st

from modulec.diagnostics.spelling import edit_distance
from modulec.resolve.messages import closest


def levenshtein(a: str, b: str) -> int:
    """Plain Levenshtein: the reference that the swap rule may only improve on."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row, previous = [i], row
        for j, y in enumerate(b, 1):
            row.append(min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (x != y)))
    return row[-1]


def test_known_distances():
    assert edit_distance("frist", "first") == 1  # one swap
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert edit_distance("ca", "abc") == 3  # optimal string alignment, not full Damerau (2)


def test_a_swapped_name_is_suggested():
    assert closest("frist", ["first", "second"]) == ["first"]
    assert closest("Lienar", ["Linear", "LayerNorm"]) == ["Linear"]


words = st.text(alphabet="abcd", max_size=7)


@given(words, words)
def test_between_half_levenshtein_and_levenshtein(a, b):
    distance = edit_distance(a, b)
    assert distance == edit_distance(b, a)
    assert (distance == 0) == (a == b)
    assert levenshtein(a, b) / 2 <= distance <= levenshtein(a, b)
