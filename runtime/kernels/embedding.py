"""embedding (spec §6.8.1): a gather of rows; the backward is a scatter-add.

The backward's d_weight is [V, D]: V is read from attrs["input_shapes"]["weight"] (the
forward input's shape, recorded at forward; no data saved).
"""

from __future__ import annotations

import torch

from runtime.kernels.base import input_shape, register


def _embedding_backward(d_y, indices, **attrs):
    V, D = input_shape(attrs, "embedding", "weight")
    d_weight = torch.zeros(V, D, dtype=d_y.dtype, device=d_y.device)
    # d_weight[v] = sum of the d_y rows whose index is v
    return [d_weight.index_add(0, indices.reshape(-1).long(), d_y.reshape(-1, D))]


@register("embedding", ("indices", "weight"), ("y",), ("d_y", "indices"), ("d_weight",),
          backward=_embedding_backward)
def _embedding_forward(indices, weight, **_):
    rows = weight.index_select(0, indices.reshape(-1).long())
    return [rows.reshape(*indices.shape, weight.shape[1])]
