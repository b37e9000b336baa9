"""Shape rules whose output depends on parameters or on broadcasting: views, transposes,
splits and concatenations, elementwise ops, reductions, and the tensor constructors."""

from __future__ import annotations

from modulec.check.unify import ShapeError
from modulec.ops.registry import OpCall, shape_rule
from modulec.semantic.consteval import Ident
from modulec.types.dims import Dim
from modulec.types.tensor import DTYPES, FLOAT, MAX_RANK, TensorType


def _axis(call: OpCall, value, rank: int, what: str = "dim") -> int:
    if not isinstance(value, Dim) or not value.is_const:
        raise ShapeError(f"`{what}` of `{call.rule.name}` must be a known integer")
    axis = value.value
    if not -rank <= axis < rank:
        raise ShapeError(f"`{what}={axis}` is out of range for a tensor of rank {rank}",
                         argument=0, label=f"rank {rank}")
    return axis % rank


def _rank_in_range(call: OpCall, shape: tuple) -> None:
    """A `shape=[...]` of more dims than a tensor may have (MAX_RANK), before any product
    of its dims is formed."""
    if len(shape) > MAX_RANK:
        raise ShapeError(f"`{call.rule.name}` to {len(shape):,} dims: the most a tensor may "
                         f"have is {MAX_RANK}", code="E027")


def _known(t: TensorType | None) -> bool:
    return t is not None and not t.variadic


def _unknown_like(t: TensorType | None) -> list[TensorType]:
    return [TensorType((), t.dtype if t else FLOAT, variadic=True)]


@shape_rule("view")
def view_shape(call: OpCall) -> list[TensorType]:
    x, shape = call.inputs[0], call.param("shape")
    if not isinstance(shape, tuple):
        raise ShapeError("`view` needs `shape`, a list of dims")
    _rank_in_range(call, shape)
    dims = list(shape)
    inferred = [i for i, d in enumerate(dims) if d.is_const and d.value == -1]
    if len(inferred) > 1:
        raise ShapeError("`view` can infer at most one dim (-1)")
    negative = [d for d in dims if d.is_const and d.value < -1]
    if negative:
        raise ShapeError(f"`view` dims are sizes, or -1 for the one inferred; found {negative[0]}",
                         argument=0)
    if not _known(x):
        return _unknown_like(x)
    if inferred:
        known = Dim.const(1)
        for i, d in enumerate(dims):
            if i != inferred[0]:
                known = known * d
        if known == Dim.const(0):
            raise ShapeError("`view` cannot infer the -1 dim next to a 0 dim", argument=0)
        dims[inferred[0]] = x.numel() // known
    target = TensorType(tuple(dims), x.dtype)
    if call.assumptions.same(target.numel(), x.numel()) is False:
        raise ShapeError(f"`view` to {target} changes the element count: {x} has "
                         f"{x.numel()}, {target} has {target.numel()}", argument=0,
                         label=f"shape {x}")
    return [target]


@shape_rule("transpose")
def transpose_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if not _known(x):
        return _unknown_like(x)
    a = _axis(call, call.param("dim0"), len(x.dims), "dim0")
    b = _axis(call, call.param("dim1"), len(x.dims), "dim1")
    dims = list(x.dims)
    dims[a], dims[b] = dims[b], dims[a]
    return [x.with_dims(dims)]


@shape_rule("permute")
def permute_shape(call: OpCall) -> list[TensorType]:
    x, order = call.inputs[0], call.param("dims")
    if not _known(x):
        return _unknown_like(x)
    axes = [_axis(call, d, len(x.dims), "dims") for d in order or ()]
    if sorted(axes) != list(range(len(x.dims))):
        raise ShapeError(f"`permute(dims=[{', '.join(map(str, axes))}])` is not a permutation "
                         f"of the {len(x.dims)} dims of {x}", argument=0)
    return [x.with_dims([x.dims[a] for a in axes])]


@shape_rule("split")
def split_shape(call: OpCall) -> list[TensorType]:
    x, sizes = call.inputs[0], call.param("sizes")
    if not isinstance(sizes, tuple) or not sizes:
        raise ShapeError("`split` needs `sizes`, a list of dims")
    if not _known(x):
        return [TensorType((), x.dtype, variadic=True) for _ in sizes]
    axis = _axis(call, call.param("dim"), len(x.dims))
    total = sum(sizes, Dim.const(0))
    if call.assumptions.same(total, x.dims[axis]) is False:
        raise ShapeError(f"`split` sizes add up to {total}, but dim {axis} of {x} is "
                         f"{x.dims[axis]}", argument=0, label=f"shape {x}")
    return [x.with_dims(x.dims[:axis] + (s,) + x.dims[axis + 1:]) for s in sizes]


@shape_rule("concat")
def concat_shape(call: OpCall) -> list[TensorType]:
    parts = [t for t in call.inputs if t is not None]
    if not parts or not all(_known(t) for t in parts):
        return _unknown_like(parts[0] if parts else None)
    first = parts[0]
    axis = _axis(call, call.param("dim"), len(first.dims))
    for index, t in enumerate(parts[1:], start=1):
        _same_except(call, first, t, axis, index)
    total = sum((t.dims[axis] for t in parts), Dim.const(0))
    return [first.with_dims(first.dims[:axis] + (total,) + first.dims[axis + 1:])]


@shape_rule("block_diag")
def block_diag_shape(call: OpCall) -> list[TensorType]:
    """Matrices laid along the diagonal, with `zero_rows` bands between them: y is
    [sum(rows) + sum(zero_rows), sum(cols)] in the matrices' one dtype."""
    parts = [t for t in call.inputs if t is not None]
    if not parts or not all(_known(t) for t in parts):
        return _unknown_like(parts[0] if parts else None)
    for index, t in enumerate(parts):
        if len(t.dims) != 2:
            raise ShapeError(f"`block_diag` lays matrices along a diagonal; input {index} is "
                             f"{t}", argument=index, label=f"rank {len(t.dims)}")
        if t.dtype != parts[0].dtype:
            raise ShapeError(f"`block_diag` takes matrices of one dtype: input {index} is "
                             f"{t.dtype}, input 0 {parts[0].dtype}", argument=index,
                             help=("cast them to one dtype first",))
    gaps = _zero_rows(call, len(parts))
    rows = sum((t.dims[0] for t in parts), Dim.const(sum(gaps)))
    cols = sum((t.dims[1] for t in parts), Dim.const(0))
    return [parts[0].with_dims((rows, cols))]


def _zero_rows(call: OpCall, n: int) -> list[int]:
    """`zero_rows` as integers: n + 1 of them, or none (all zero)."""
    value = call.param("zero_rows")
    gaps = list(value) if isinstance(value, (list, tuple)) else []
    if not all(isinstance(g, Dim) and g.is_const and g.value >= 0 for g in gaps):
        raise ShapeError("`zero_rows` of `block_diag` must be known integers, none negative")
    if gaps and len(gaps) != n + 1:
        raise ShapeError(f"`zero_rows` of `block_diag` has {len(gaps)} entries: one before, "
                         f"between and after the {n} matrices makes {n + 1}",
                         help=("or leave it out: no zero rows",))
    return [g.value for g in gaps] or [0] * (n + 1)


def _same_except(call: OpCall, first: TensorType, other: TensorType, axis: int, index: int):
    if len(other.dims) != len(first.dims) or any(
            i != axis and call.assumptions.same(a, b) is False
            for i, (a, b) in enumerate(zip(first.dims, other.dims))):
        raise ShapeError(f"`concat` along dim {axis}: {other} does not match {first} "
                         f"in the other dims", argument=index)


def _require_float(call: OpCall, tensors) -> None:
    for index, t in enumerate(tensors):
        if t is not None and t.is_int:
            raise ShapeError(f"`{call.rule.name}` needs floating tensors; "
                             f"{_input_name(call, index)} is {t.dtype}", argument=index,
                             code="E015", label=f"{t.dtype} tensor")


def _input_name(call: OpCall, index: int) -> str:
    return f"`{call.names[index]}`" if index < len(call.names) else f"input {index}"


@shape_rule("add", "mul")
def broadcast_shape(call: OpCall) -> list[TensorType]:
    operands = [t for t in call.inputs if t is not None]
    _require_float(call, operands)
    if not all(_known(t) for t in operands):
        return _unknown_like(operands[0])
    result = operands[0].dims
    for index, t in enumerate(operands[1:], start=1):
        result = _broadcast(call, result, t.dims, index)
    return [TensorType(tuple(result), operands[0].dtype)]


def _broadcast(call: OpCall, left, right, index: int):
    width = max(len(left), len(right))
    left = (Dim.const(1),) * (width - len(left)) + tuple(left)
    right = (Dim.const(1),) * (width - len(right)) + tuple(right)
    result = []
    for a, b in zip(left, right):
        if a == Dim.const(1):
            result.append(b)
        elif b == Dim.const(1) or call.assumptions.same(a, b) is not False:
            result.append(a)
        else:
            raise ShapeError(f"shapes [{', '.join(map(str, left))}] and "
                             f"[{', '.join(map(str, right))}] do not broadcast: {a} vs {b}",
                             argument=index, label=f"{b} cannot broadcast with {a}")
    return result


@shape_rule("reduce_sum", "reduce_mean")
def reduce_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if not _known(x):
        return _unknown_like(x)
    axes = [_axis(call, d, len(x.dims), "dims") for d in call.param("dims") or ()]
    if len(set(axes)) != len(axes):
        raise ShapeError(f"`{call.rule.name}(dims=[{', '.join(map(str, call.param('dims')))}])` "
                         f"names a dim of {x} twice", argument=0, label=f"rank {len(x.dims)}")
    return [x.with_dims(_reduced(x, set(axes), call.param("keepdim") is True))]


@shape_rule("reduce_max")
def reduce_max_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if not _known(x):
        return _unknown_like(x) * 2
    axis = _axis(call, call.param("dim"), len(x.dims))
    dims = _reduced(x, {axis}, call.param("keepdim") is True)
    return [x.with_dims(dims), TensorType(tuple(dims), "int32")]


def _reduced(x: TensorType, axes: set[int], keep: bool) -> list[Dim]:
    return [Dim.const(1) if i in axes else d for i, d in enumerate(x.dims)
            if keep or i not in axes]


@shape_rule("zeros", "ones", "fill")
def constructor_shape(call: OpCall) -> list[TensorType]:
    shape = call.param("shape")
    if not isinstance(shape, tuple):
        raise ShapeError(f"`{call.rule.name}` needs `shape`, a list of dims")
    _rank_in_range(call, shape)
    if any(d.is_const and d.value < 0 for d in shape):
        raise ShapeError(f"`{call.rule.name}(shape=[{', '.join(map(str, shape))}])` has a "
                         "negative dim", code="E003")
    dtype = call.param("dtype")
    if isinstance(dtype, Ident) and dtype.name not in DTYPES:
        raise ShapeError(f"`dtype={dtype.name}` of `{call.rule.name}` is not a dtype",
                         code="E003", help=(f"dtypes: {', '.join(DTYPES)}",))
    return [TensorType(tuple(shape), dtype.name if isinstance(dtype, Ident) else FLOAT)]


@shape_rule("add3")
def add3_shape(call: OpCall) -> list[TensorType]:
    """Three operands of one shape: add3 does not broadcast (its backward is d_y itself)."""
    operands = list(call.inputs)
    _require_float(call, operands)
    if not all(_known(t) for t in operands):
        return _unknown_like(operands[0])
    first = operands[0]
    for index, t in enumerate(operands[1:], start=1):
        if len(t.dims) != len(first.dims) or any(
                call.assumptions.same(a, b) is False for a, b in zip(first.dims, t.dims)):
            raise ShapeError(f"`add3` adds tensors of one shape (no broadcasting): "
                             f"{_input_name(call, index)} is {t}, `a` is {first}",
                             argument=index, label=f"shape {t}",
                             help=("broadcast with `add`, or add3 equal shapes",))
    return [first]


@shape_rule("select")
def select_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if not _known(x):
        return _unknown_like(x)
    axis = _axis(call, call.param("dim"), len(x.dims))
    size, index = x.dims[axis], _int(call, "index")
    if size.is_const and not -size.value <= index < size.value:
        raise ShapeError(f"index {index} is out of range for dim {axis} of size {size}",
                         argument=0, label=f"shape {x}")
    return [TensorType(x.dims[:axis] + x.dims[axis + 1:], x.dtype)]


@shape_rule("slice")
def slice_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if not _known(x):
        return _unknown_like(x)
    axis = _axis(call, call.param("dim"), len(x.dims))
    start, end = _int(call, "start"), call.param("end")
    end = None if end is None else _int(call, "end")
    length = _range_length(x.dims[axis], start, end)
    if length is None:
        raise ShapeError(f"the length of [{start}:{'' if end is None else end}] along dim "
                         f"{axis} of size {x.dims[axis]} is not known at compile time",
                         argument=0, label=f"shape {x}",
                         help=("slice with bounds of one sign (`1:`, `-4:`, `:-1`, `2:6`)",))
    return [TensorType(x.dims[:axis] + (length,) + x.dims[axis + 1:], x.dtype)]


def _int(call: OpCall, name: str) -> int:
    value = call.param(name)
    if isinstance(value, Dim) and value.is_const:
        return value.value
    if isinstance(value, int):
        return value
    raise ShapeError(f"`{name}` of `{call.rule.name}` must be a known integer", code="E003")


def _range_length(size: Dim, start: int, end: int | None) -> Dim | None:
    """len(range(size)[start:end]) as a Dim: exact for a known size, else for bounds whose
    result does not depend on clamping (both from the start, or both from the end)."""
    if size.is_const:
        return Dim.const(len(range(size.value)[start:end]))
    if end is None:
        return size - start if start >= 0 else Dim.const(-start)
    if start >= 0 and end >= 0:
        return Dim.const(max(end - start, 0))
    if start >= 0 > end:
        return size + end - start
    if start < 0 and end < 0:
        return Dim.const(max(end - start, 0))
    return None


@shape_rule("dropout")
def dropout_shape(call: OpCall) -> list[TensorType]:
    p, x = call.param("p"), call.inputs[0]
    if isinstance(p, (int, float)) and not 0 <= p < 1:
        raise ShapeError(f"`p` of `dropout` is a probability below 1, not {p}", code="E003")
    return [x, x]  # y, and the mask it was multiplied by


@shape_rule("cast")
def cast_shape(call: OpCall) -> list[TensorType]:
    dtype = call.param("dtype")
    if not isinstance(dtype, Ident) or dtype.name not in DTYPES:
        raise ShapeError(f"`dtype` of `cast` must be a dtype, found {dtype}", code="E003",
                         help=(f"dtypes: {', '.join(DTYPES)}",))
    return [call.inputs[0].with_dtype(dtype.name)]


@shape_rule("contiguous", "copy", "stop_gradient", "scale_gradient")
def same_shape(call: OpCall) -> list[TensorType]:
    return [call.inputs[0]]


@shape_rule("scale", "silu", "relu", "relu2", "gelu", "sigmoid", "exp", "neg", "exp_neg",
            "softmax")
def float_elementwise_shape(call: OpCall) -> list[TensorType]:
    x = call.inputs[0]
    if x.is_int:
        raise ShapeError(f"`{call.rule.name}` needs a floating tensor, found {x.dtype}",
                         argument=0, code="E015", label=f"{x.dtype} tensor")
    if call.rule.name == "softmax" and _known(x):
        _axis(call, call.param("dim"), len(x.dims))
    return [x]
