"""moe_permute and moe_unpermute on the GPU: the routing's row movement as gathers
(csrc/kernels/moe.cu), deterministic (no atomics: each output row sums its sources in a
fixed order). The reference's index_add scatter-adds become reads through the inverse
permutation `pos` (the permuted row of each assignment), which an index_put with unique
indices builds on the device.

The GPU forward of moe_permute does not re-check `expert_offsets` against the indices,
as the reference does: that comparison would sync with the host inside the captured step
(moe_compute_offsets makes them from the same indices).

Calls the kernels do not cover (tensors not on CUDA or not contiguous, dtypes other than
bf16/fp32, indices not int32) go to the reference kernels.
"""

from __future__ import annotations

import torch

from runtime.kernels import KERNELS

IO_DTYPES = (torch.bfloat16, torch.float32)


def _ok(rows, *indices) -> bool:
    tensors = (rows, *indices)
    return (all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() for t in tensors)
            and rows.dtype in IO_DTYPES and rows.dim() == 2
            and all(i.dtype == torch.int32 for i in indices))


def inverse(scatter: torch.Tensor) -> torch.Tensor:
    """pos[scatter[j]] = j."""
    pos = torch.empty_like(scatter)
    pos[scatter.long()] = torch.arange(scatter.numel(), dtype=scatter.dtype,
                                       device=scatter.device)
    return pos


class _Reference:
    def __init__(self, name: str):
        self.reference = KERNELS[name]

    def __getattr__(self, attr):
        return getattr(self.reference, attr)


class MoePermute(_Reference):
    def __init__(self):
        super().__init__("moe_permute")

    def forward(self, inputs: list, attrs: dict) -> list:
        x, indices, offsets = inputs
        if not _ok(x, indices):
            return self.reference.forward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        top_k = indices.shape[1]
        scatter = torch.argsort(indices.reshape(-1), stable=True).to(torch.int32)
        return [_extension().moe_gather_rows(x, scatter, top_k), scatter]

    def backward(self, inputs: list, attrs: dict) -> list:
        d_permuted, scatter = inputs
        if not _ok(d_permuted, scatter):
            return self.reference.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension
        from runtime.kernels.base import input_shape

        top_k = scatter.numel() // input_shape(attrs, "moe_permute", "x")[0]
        return [_extension().moe_combine(d_permuted, None, inverse(scatter), top_k)]


class MoeUnpermute(_Reference):
    def __init__(self):
        super().__init__("moe_unpermute")

    def forward(self, inputs: list, attrs: dict) -> list:
        rows, weights, scatter = inputs
        if not _ok(rows, scatter) or not _weights_ok(weights, rows):
            return self.reference.forward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        w = weights.reshape(-1).float().contiguous()
        return [_extension().moe_combine(rows, w, inverse(scatter), weights.shape[1])]

    def backward(self, inputs: list, attrs: dict) -> list:
        d_combined, rows, weights, scatter = inputs
        if not _ok(rows, scatter) or not _weights_ok(weights, rows) \
                or not _ok(d_combined) or d_combined.dtype != rows.dtype:
            return self.reference.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        w = weights.reshape(-1).float().contiguous()
        d_rows, d_w = _extension().moe_combine_backward(d_combined, rows, w, scatter,
                                                        weights.shape[1])
        return [d_rows, d_w.reshape(weights.shape).to(weights.dtype)]


def _weights_ok(weights, rows) -> bool:
    return (isinstance(weights, torch.Tensor) and weights.is_cuda and weights.dim() == 2
            and weights.dtype in IO_DTYPES and weights.device == rows.device)


MOE_KERNELS = {"moe_permute": MoePermute(), "moe_unpermute": MoeUnpermute()}
