"""Memory orders (modulec/plan/layouts.py): a `contiguous` is a view only where its input
is already laid out contiguously: the attention output's transpose back to [B, T, H, D],
not a split's strided part or a plain transpose."""

from __future__ import annotations

from modulec.ir.graph import Function, Node, ValueInfo
from modulec.plan.layouts import free_contiguous


def function(*nodes, values=()) -> Function:
    infos = tuple(ValueInfo(v, shape, "bf16") for v, shape in values)
    return Function("F#1", "F", "", (), (), (), (), infos, tuple(nodes))


def op(id, target, inputs, outputs, **attrs):
    return Node(id, "op", target, tuple(inputs), tuple(outputs), tuple(attrs.items()))


BHTD = ("2", "4", "8", "16")
BTHD = ("2", "8", "4", "16")


def test_attention_output_transposed_back_is_already_contiguous():
    f = function(op("a", "flash_attention", ["q", "k", "v", ""], ["o", "lse"]),
                 op("t", "transpose", ["o"], ["ot"], dim0=1, dim1=2),
                 op("c", "contiguous", ["ot"], ["oc"]),
                 values=[("o", BHTD), ("lse", ("2", "4", "8")), ("ot", BTHD), ("oc", BTHD)])
    assert free_contiguous(f) == {"c"}


def test_a_transposed_matmul_output_or_a_split_part_is_copied():
    f = function(op("m", "matmul", ["x", "w"], ["y"]),
                 op("t", "transpose", ["y"], ["yt"], dim0=1, dim1=2),
                 op("c1", "contiguous", ["yt"], ["yc"]),
                 op("s", "split", ["y"], ["p0", "p1"]),
                 op("c2", "contiguous", ["p0"], ["pc"]),
                 values=[("y", BHTD), ("yt", BTHD), ("yc", BTHD), ("p0", BHTD),
                         ("p1", BHTD), ("pc", BHTD)])
    assert free_contiguous(f) == frozenset()
