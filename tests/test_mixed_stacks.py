"""Mixed layer stacks (issue 18 item 2): index arithmetic in checkpoint names, a second
stack continuing the layer numbering, and the weight schema the runtime fills."""

from __future__ import annotations

import pytest

from modulec.check.weight_index import IndexError_, canonical_string, parse_index
from runtime.hf_weights.schema import fill


def test_index_expressions_parse_and_canonicalize():
    assert parse_index("i").bare == "i"
    assert parse_index("i * step + j").names == ("i", "step", "j")
    text = canonical_string("model.layers.{layer * step + step - 1}.mlp",
                            {"layer": "i"}, {"step": 3})
    assert text == "model.layers.{i * 3 + 3 - 1}.mlp"
    assert canonical_string("a.{i}.{e}", {"i": "i", "e": "e"}, {}) == "a.{i}.{e}"
    for bad in ("i +", "i / 2", "f(i)", "i.x", "1.5"):
        with pytest.raises(IndexError_):
            parse_index(bad)


def test_runtime_fills_index_expressions():
    assert fill("model.layers.{i + 3}.w", {"i": 2}) == "model.layers.5.w"
    assert fill("l.{i * 2 + j}.{(i + 1) // 2 % 5}", {"i": 4, "j": 1}) == "l.9.2"
    assert fill("l.{i}.experts.{e}", {"i": 1}) == "l.1.experts.{e}"  # e filled later
    assert fill("l.{-i + 7}", {"i": 2}) == "l.5"
