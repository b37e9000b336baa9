"""Shape rules of the matrix products: matmul, batched_matmul, grouped_gemm.

Transpose modes follow §6.1.1's table (docs/decisions.md): NN C = A·B, NT C = A·Bᵀ,
TN C = Aᵀ·B, TT C = Aᵀ·Bᵀ, with operands stored as `A: [M, K]` or `[K, M]`. An operand of
more than two dims is a matrix whose rows are all its leading dims (a free view).
"""

from __future__ import annotations

from modulec.check.unify import ShapeError
from modulec.ops.registry import OpCall, shape_rule
from modulec.semantic.consteval import Ident
from modulec.types.dims import Dim
from modulec.types.tensor import TensorType

MODES = ("NN", "NT", "TN", "TT")


def mode_of(call: OpCall) -> str:
    value = call.param("transpose")
    return value.name if isinstance(value, Ident) else "NN"


def _product(dims) -> Dim:
    total = Dim.const(1)
    for dim in dims:
        total = total * dim
    return total


def _as_matrix(t: TensorType) -> tuple[tuple[Dim, ...], Dim]:
    """(leading dims folded into rows, columns)."""
    return tuple(t.dims[:-1]), t.dims[-1]


def _matmul_result(a: TensorType, b: TensorType, mode: str, call: OpCall):
    """(result dims, contracted dims of A and B) for one mode, or None if K disagrees."""
    a_rows, a_cols = _as_matrix(a)
    b_rows, b_cols = _as_matrix(b)
    a_transposed, b_transposed = mode[0] == "T", mode[1] == "T"
    k_a = _product(a_rows) if a_transposed else a_cols
    k_b = b_cols if b_transposed else _product(b_rows)
    if call.assumptions.same(k_a, k_b) is False:
        return None, (k_a, k_b)
    m_dims = (a_cols,) if a_transposed else a_rows
    n_dim = _product(b_rows) if b_transposed else b_cols
    return tuple(m_dims) + (n_dim,), (k_a, k_b)


def _require_matrices(call: OpCall, a: TensorType, b: TensorType) -> None:
    for index, t in enumerate((a, b)):
        if t.is_int:
            raise ShapeError(f"`{call.rule.name}` multiplies floating tensors; "
                             f"{call.names[index]} is {t.dtype}", argument=index, code="E015",
                             label=f"{t.dtype} tensor")
        if t.variadic:
            raise ShapeError("rank unknown", argument=index)
        if len(t.dims) < 2:
            raise ShapeError(f"`{call.rule.name}` needs matrices; {call.names[index]} has shape {t}",
                             argument=index, label="needs at least 2 dims")


@shape_rule("matmul")
def matmul_shape(call: OpCall) -> list[TensorType]:
    a, b = call.inputs[0], call.inputs[1]
    if a.variadic or b.variadic:
        return [TensorType((), a.dtype, variadic=True)]
    _require_matrices(call, a, b)
    mode = mode_of(call)
    dims, (k_a, k_b) = _matmul_result(a, b, mode, call)
    if dims is None:
        raise ShapeError(
            f"`matmul(transpose={mode})` contracts {k_a} (from A: {a}) with {k_b} "
            f"(from B: {b})", argument=1, label=f"inner dimension {k_b}, expected {k_a}",
            help=_other_modes(a, b, mode, call),
            notes=("modes (spec §6.1.1): NN A·B, NT A·Bᵀ, TN Aᵀ·B, TT Aᵀ·Bᵀ; "
                   "y = x·Wᵀ with W stored [out, in] is NT",))
    return [TensorType(dims, a.dtype)]


def _other_modes(a, b, mode, call) -> tuple[str, ...]:
    fitting = [m for m in MODES if m != mode and _matmul_result(a, b, m, call)[0] is not None]
    if not fitting:
        return ()
    shapes = ", ".join(f"`transpose={m}` gives {TensorType(_matmul_result(a, b, m, call)[0])}"
                       for m in fitting)
    return (f"another transpose mode would fit: {shapes}",)


@shape_rule("batched_matmul")
def batched_matmul_shape(call: OpCall) -> list[TensorType]:
    a, b = call.inputs[0], call.inputs[1]
    if a.variadic or b.variadic:
        return [TensorType((), a.dtype, variadic=True)]
    _require_matrices(call, a, b)
    mode = mode_of(call)
    m, k_a = (a.dims[-1], a.dims[-2]) if mode[0] == "T" else (a.dims[-2], a.dims[-1])
    n, k_b = (b.dims[-2], b.dims[-1]) if mode[1] == "T" else (b.dims[-1], b.dims[-2])
    if call.assumptions.same(k_a, k_b) is False:
        raise ShapeError(f"`batched_matmul(transpose={mode})` contracts {k_a} with {k_b}",
                         argument=1, label=f"inner dimension {k_b}, expected {k_a}")
    batch = _broadcast_batch(call, a.dims[:-2], b.dims[:-2])
    return [TensorType(batch + (m, n), a.dtype)]


def _broadcast_batch(call: OpCall, left, right) -> tuple:
    if not right:
        return tuple(left)
    if len(left) != len(right) or any(call.assumptions.same(x, y) is False
                                       for x, y in zip(left, right)):
        raise ShapeError(f"batch dims [{', '.join(map(str, left))}] and "
                         f"[{', '.join(map(str, right))}] differ", argument=1)
    return tuple(left)


@shape_rule("grouped_gemm")
def grouped_gemm_shape(call: OpCall) -> list[TensorType]:
    tokens, weights, offsets = call.inputs[:3]
    for index, t in enumerate((tokens, weights)):
        if t.is_int:
            raise ShapeError(f"`grouped_gemm` multiplies floating tensors; "
                             f"{call.names[index]} is {t.dtype}", argument=index, code="E015",
                             label=f"{t.dtype} tensor")
    if not offsets.is_int:
        raise ShapeError(f"`offsets` must be int32, found {offsets.dtype}", argument=2,
                         code="E015", label="expected int32")
    if tokens.variadic or weights.variadic:
        return [TensorType((), tokens.dtype, variadic=True)]
    if len(weights.dims) != 3 or len(tokens.dims) != 2:
        raise ShapeError("grouped_gemm takes input [tokens, K] and weights [groups, N, K] "
                         f"(NT) or [groups, K, N] (NN); found {tokens} and {weights}", argument=1)
    groups, first, second = weights.dims
    n, k = (first, second) if mode_of(call) == "NT" else (second, first)
    if call.assumptions.same(tokens.dims[1], k) is False:
        raise ShapeError(f"grouped_gemm contracts {tokens.dims[1]} (input) with {k} (weights)",
                         argument=1, label=f"expected {tokens.dims[1]}",
                         help=("weights stored [groups, N, K] use transpose=NT, "
                               "[groups, K, N] use NN",))
    if not offsets.variadic and (len(offsets.dims) != 1 or call.assumptions.same(
            offsets.dims[0], groups + 1) is False):
        raise ShapeError(f"offsets must have groups + 1 = {groups + 1} entries, found {offsets}",
                         argument=2, label=f"expected [{groups + 1}, int32]")
    return [TensorType((tokens.dims[0], n), tokens.dtype)]
