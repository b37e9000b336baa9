"""view, transpose, permute, split, concat, block_diag, contiguous, copy (spec §6.5,
§6.11.4);
stop_gradient and scale_gradient (`@gradient`, §7.8.3); select and slice (subscripts).

Views return torch views where torch can (the reference does not model buffers; layout
is not part of the value). view reshapes (a copy when x is strided: the "x must be
contiguous" constraint is the compiler's, not checked here). split's `parts` and
`d_parts` and concat's `xs` / `d_xs` are Python lists of tensors; a None in split's
`d_parts` (a part that got no gradient) counts as zeros.
"""

from __future__ import annotations

import torch

from runtime.kernels.base import input_shape, register


# ------------------------------------------------------------------------------- view
def _view_backward(d_y, **attrs):
    return [d_y.reshape(input_shape(attrs, "view", "x"))]


@register("view", ("x",), ("y",), ("d_y",), ("d_x",), backward=_view_backward)
def _view_forward(x, *, shape, **_):
    return [x.reshape(list(shape))]


# -------------------------------------------------------------------------- transpose
@register("transpose", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=lambda d_y, *, dim0, dim1, **_: [d_y.transpose(dim0, dim1)])
def _transpose_forward(x, *, dim0, dim1, **_):
    return [x.transpose(dim0, dim1)]


# ---------------------------------------------------------------------------- permute
def _inverse(dims) -> list[int]:
    n = len(dims)
    inv = [0] * n
    for i, d in enumerate(dims):
        inv[d % n] = i
    return inv


@register("permute", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=lambda d_y, *, dims, **_: [d_y.permute(_inverse(dims))])
def _permute_forward(x, *, dims, **_):
    return [x.permute(list(dims))]


# ------------------------------------------------------------------------------ split
def _split_backward(d_parts, *, sizes, dim=-1, **attrs):
    if any(d is None for d in d_parts):  # a part without gradient contributes zeros
        ref = next(d for d in d_parts if d is not None)
        shape = list(input_shape(attrs, "split", "x"))
        d_parts = [d if d is not None else
                   ref.new_zeros(shape[:dim % len(shape)] + [size] + shape[dim % len(shape) + 1:])
                   for d, size in zip(d_parts, sizes)]
    return [torch.cat(list(d_parts), dim=dim)]


@register("split", ("x",), ("parts",), ("d_parts",), ("d_x",), backward=_split_backward)
def _split_forward(x, *, sizes, dim=-1, **_):
    if sum(sizes) != x.shape[dim]:
        raise ValueError(f"split: sizes {list(sizes)} do not add up to {x.shape[dim]}")
    return [list(torch.split(x, list(sizes), dim=dim))]


# ----------------------------------------------------------------------------- concat
def _concat_backward(d_y, *, dim=-1, **attrs):
    sizes = [shape[dim] for shape in input_shape(attrs, "concat", "xs")]
    return [list(torch.split(d_y, sizes, dim=dim))]


@register("concat", ("xs",), ("y",), ("d_y",), ("d_xs",), backward=_concat_backward)
def _concat_forward(xs, *, dim=-1, **_):
    return [torch.cat(list(xs), dim=dim)]


# -------------------------------------------------------------------------- block_diag
def block_layout(shapes, zero_rows=()) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Where each matrix of `shapes` starts in block_diag's y, (row, column), and y's
    shape (zero_rows: n + 1 bands of zero rows, or none)."""
    gaps = list(zero_rows) or [0] * (len(shapes) + 1)
    places, row, col = [], gaps[0], 0
    for (rows, cols), gap in zip(shapes, gaps[1:]):
        places.append((row, col))
        row, col = row + rows + gap, col + cols
    return places, (row, col)


def _block_diag_backward(d_y, *, zero_rows=(), **attrs):
    shapes = [tuple(s) for s in input_shape(attrs, "block_diag", "xs")]
    return [[d_y[r:r + rows, c:c + cols].contiguous()
             for (r, c), (rows, cols) in zip(block_layout(shapes, zero_rows)[0], shapes)]]


@register("block_diag", ("xs",), ("y",), ("d_y",), ("d_xs",), backward=_block_diag_backward)
def _block_diag_forward(xs, *, zero_rows=(), **_):
    xs = list(xs)
    places, shape = block_layout([tuple(x.shape) for x in xs], zero_rows)
    y = xs[0].new_zeros(shape)
    for (r, c), x in zip(places, xs):
        y[r:r + x.shape[0], c:c + x.shape[1]] = x
    return [y]


# ------------------------------------------------------------------ contiguous, copy
@register("contiguous", ("x",), ("y",), ("d_y",), ("d_x",), backward=lambda d_y, **_: [d_y])
def _contiguous_forward(x, **_):
    return [x.contiguous()]


@register("copy", ("x",), ("y",), ("d_y",), ("d_x",), backward=lambda d_y, **_: [d_y])
def _copy_forward(x, **_):
    return [x.clone(memory_format=torch.contiguous_format)]


# ----------------------------------------------------- stop_gradient, scale_gradient
# `@gradient(...)` (spec §7.8.3): identities forward; stop_gradient has no backward (the
# derivation gives its input no gradient), scale_gradient scales then clips element-wise
@register("stop_gradient", ("x",), ("y",))
def _stop_gradient_forward(x, **_):
    return [x]


def _scale_gradient_backward(d_y, *, scale=1.0, clip=None, **_):
    d_x = d_y * scale
    return [d_x.clamp(-clip, clip) if clip is not None else d_x]


@register("scale_gradient", ("x",), ("y",), ("d_y",), ("d_x",),
          backward=_scale_gradient_backward)
def _scale_gradient_forward(x, **_):
    return [x]


# ------------------------------------------------------------------ select, slice
# subscripts (`x[:, -1]`, `x[:, 1:]`): views; a backward writes d_y into a zero d_x
def _select_backward(d_y, *, dim, index, **attrs):
    d_x = d_y.new_zeros(input_shape(attrs, "select", "x"))
    d_x.select(dim, index).copy_(d_y)
    return [d_x]


@register("select", ("x",), ("y",), ("d_y",), ("d_x",), backward=_select_backward)
def _select_forward(x, *, dim, index, **_):
    return [x.select(dim, index)]


def _range(x_dim: int, start: int, end) -> slice:
    return slice(*slice(start, end).indices(x_dim)[:2])


def _slice_backward(d_y, *, dim, start=0, end=None, **attrs):
    shape = input_shape(attrs, "slice", "x")
    d_x = d_y.new_zeros(shape)
    where = [slice(None)] * len(shape)
    where[dim] = _range(shape[dim], start, end)
    d_x[tuple(where)] = d_y
    return [d_x]


@register("slice", ("x",), ("y",), ("d_y",), ("d_x",), backward=_slice_backward)
def _slice_forward(x, *, dim, start=0, end=None, **_):
    where = [slice(None)] * x.dim()
    where[dim] = _range(x.shape[dim], start, end)
    return [x[tuple(where)]]
