"""Shape rules of the sequence-parallel collectives (`--tp M --sp`, spec §7.6.1): the
gathers multiply the sequence dim by the group size, the scatters divide it (exactly:
a size the group does not divide is E027, naming the dim)."""

from __future__ import annotations

from modulec.check.unify import ShapeError
from modulec.ops.registry import OpCall, shape_rule
from modulec.types.dims import Dim, Opaque
from modulec.types.tensor import TensorType


def _size(call: OpCall) -> int:
    size = call.param("size")
    if isinstance(size, Dim) and size.is_const:
        size = size.value
    if not isinstance(size, int) or size < 1:
        raise ShapeError(f"`size` of `{call.rule.name}` must be a known integer of at least 1",
                         code="E003")
    return size


def _axis(call: OpCall, x: TensorType) -> int:
    value, rank = call.param("dim"), len(x.dims)
    axis = value.value if isinstance(value, Dim) and value.is_const else value
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise ShapeError(f"`dim={value}` is out of range for a tensor of rank {rank}",
                         argument=0, label=f"rank {rank}")
    return axis % rank


def gathered(dim: Dim, size: int) -> Dim:
    """`dim` times `size`, where `T // size` gives back `T`."""
    if len(dim.terms) == 1:
        (monomial, coefficient), = dim.terms
        if coefficient == 1 and len(monomial) == 1 and isinstance(monomial[0], Opaque):
            term = monomial[0]
            if term.op == "//" and term.args[1] == Dim.const(size):
                return term.args[0]
    return dim * size


def local(dim: Dim, size: int) -> Dim | None:
    """`dim` divided by `size` (None where a known size does not divide)."""
    if dim.is_const:
        return Dim.const(dim.value // size) if dim.value % size == 0 else None
    return dim // size


def _resized(call: OpCall, resize) -> list[TensorType]:
    """The input with dim `dim` replaced by `resize(x, axis, size)`."""
    x, size = call.inputs[0], _size(call)
    if x is None or x.variadic:
        return [x] if x is not None else []
    axis = _axis(call, x)
    dims = x.dims[:axis] + (resize(x, axis, size),) + x.dims[axis + 1:]
    return [TensorType(dims, x.dtype)]


@shape_rule("sp_all_gather", "sp_gather")
def gather_shape(call: OpCall) -> list[TensorType]:
    return _resized(call, lambda x, axis, size: gathered(x.dims[axis], size))


@shape_rule("sp_reduce_scatter", "sp_scatter")
def scatter_shape(call: OpCall) -> list[TensorType]:
    def split(x: TensorType, axis: int, size: int) -> Dim:
        part = local(x.dims[axis], size)
        if part is None:
            raise ShapeError(f"dim {axis} of {x} ({x.dims[axis]}) is not divisible by the "
                             f"tensor-parallel size {size}: `{call.rule.name}` splits it "
                             f"into {size} equal blocks", argument=0, label=f"shape {x}",
                             code="E027", help=("choose a sequence length the `--tp` size "
                                                "divides, or build without `--sp`",))
        return part

    return _resized(call, split)
