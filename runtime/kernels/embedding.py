"""embedding (spec §6.8.1): a gather of rows; the backward is a scatter-add.

The backward's d_weight is [V, D]: V is read from attrs["input_shapes"]["weight"] (the
forward input's shape, recorded at forward; no data saved). With `padding_idx` p, row p of
d_weight is 0 (torch.nn.Embedding's padding_idx): `zero_padding_row`, shared with the
GPU kernel.
"""

from __future__ import annotations

import torch

from runtime.kernels.base import input_shape, register


def padding_row(padding_idx, V: int) -> int | None:
    """The row that gets no gradient (None: none); a padding_idx outside [0, V) is refused."""
    if padding_idx is None:
        return None
    if not 0 <= int(padding_idx) < V:
        raise ValueError(f"embedding: padding_idx={padding_idx} is not a row of a "
                         f"{V}-row table")
    return int(padding_idx)


def zero_padding_row(d_weight, padding_idx):
    """d_weight with row padding_idx set to 0 (in place; no-op without one)."""
    row = padding_row(padding_idx, d_weight.shape[0])
    if row is not None:
        d_weight[row].zero_()
    return d_weight


def _embedding_backward(d_y, indices, *, padding_idx=None, **attrs):
    V, D = input_shape(attrs, "embedding", "weight")
    d_weight = torch.zeros(V, D, dtype=d_y.dtype, device=d_y.device)
    # d_weight[v] = sum of the d_y rows whose index is v
    d_weight = d_weight.index_add(0, indices.reshape(-1).long(), d_y.reshape(-1, D))
    return [zero_padding_row(d_weight, padding_idx)]


@register("embedding", ("indices", "weight"), ("y",), ("d_y", "indices"), ("d_weight",),
          backward=_embedding_backward)
def _embedding_forward(indices, weight, *, padding_idx=None, **_):
    padding_row(padding_idx, weight.shape[0])
    rows = weight.index_select(0, indices.reshape(-1).long())
    return [rows.reshape(*indices.shape, weight.shape[1])]
