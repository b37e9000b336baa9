"""The global gradient norm under tensor parallel: one rule for every trainer (the CPU
trainer, the ZeRO run of the CPU and GPU steps, the GPU step on one TP group, the
pipeline's stages). A rank holds a slice of each sharded parameter (the IR's
`tensor_parallel` section lists them: runtime.tensor_parallel.sharded_paths) and the whole
of each replicated one (norms, the embedding and head unless sharded, anything `tp_copy`
makes whole), whose gradient is the same on every rank of the TP group. The whole model's
squared norm is then the sharded slices' squares summed over the TP group, plus the
replicated parameters' squares counted once. Everything stays on the device: the sum is
one all_reduce of a one-element tensor on the TP group, no host sync (the GPU step
captures it in its CUDA graph)."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.dist.collectives import all_reduce_


def squares(grads, dtype: torch.dtype, device) -> Tensor:
    """The sum of the squares of `grads` (a [1] tensor of `dtype` on `device`)."""
    total = torch.zeros(1, dtype=dtype, device=device)
    for grad in grads:
        total.add_(torch.linalg.vector_norm(grad, dtype=dtype).square())
    return total


def whole_squares(replicated: Tensor, sliced: Tensor, group=None) -> Tensor:
    """The whole model's squared norm from one TP rank's two sums: `sliced` (its slices'
    squares) summed over the TP `group` in place, plus `replicated` once."""
    all_reduce_(sliced, group)
    return replicated + sliced


def tp_squares(grads: dict, sharded, group=None, dtype: torch.dtype = torch.float64,
               device=None) -> Tensor:
    """The whole model's squared gradient norm (a [1] tensor) from one TP rank's `grads`
    by path (summed in path order); `sharded`: the paths this rank holds a slice of;
    `group`: the TP group."""
    if device is None:
        device = next(iter(grads.values())).device if grads else "cpu"
    paths = sorted(grads)  # one summation order, whatever order the gradients came in
    sliced = squares([grads[p] for p in paths if p in sharded], dtype, device)
    replicated = squares([grads[p] for p in paths if p not in sharded], dtype, device)
    return whole_squares(replicated, sliced, group)


def tp_global_norm(grads: dict, program, group, dtype: torch.dtype, device=None) -> Tensor:
    """The whole model's gradient norm (a [1] tensor) on one TP rank of `program`: its
    `grads` by path, the TP `group`."""
    from runtime.tensor_parallel import sharded_paths

    return tp_squares(grads, sharded_paths(program), group, dtype, device).sqrt()


def tp_norm_options(program, parallel) -> dict:
    """runtime.dist.zero.ZeroRun's tensor-parallel options for a DataParallelRun
    `parallel`: the paths this rank holds a slice of and its TP group (none without
    --tp)."""
    if parallel.tp == 1:
        return {}
    from runtime.tensor_parallel import sharded_paths

    return {"sharded": set(sharded_paths(program)), "tp_group": parallel.tp_group}
