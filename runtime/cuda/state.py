"""The GPU step's fixed state as regions of the memory plan: one device allocation each,
every tensor a view at its offset (issue 6 item 1, for the fixed regions).

- `weights`: the compute copies (bf16) of every parameter, frozen ones included: the
  plan's weights region.
- `optimizer_state`: the fp32 masters, then the two AdamW moments, of every trained
  parameter: the plan's optimizer-state region (12 bytes a parameter).
- `gradient_sums` (with gradient accumulation): an fp32 sum per trained parameter.

Parameters are placed in path order, each at a 256-byte boundary, as the reference
runtime's arena places them (runtime/arena.py ParameterRegions). The per-layer gradients
of the step have no region: each lives from its layer's backward to that layer's update.
"""

from __future__ import annotations

import torch

ALIGNMENT = 256


def region(shapes: dict, paths: list, dtype: torch.dtype, blocks: int = 1,
           device: str = "cuda") -> tuple[torch.Tensor, list[dict]]:
    """One zeroed allocation holding `blocks` copies of the parameters `paths` in `dtype`;
    returns it and, per block, {path: view}."""
    size = torch.empty((), dtype=dtype).element_size()
    offsets, end = {}, 0
    for path in paths:
        offsets[path] = end
        end += -(-_numel(shapes[path]) * size // ALIGNMENT) * ALIGNMENT
    buffer = torch.zeros(end * blocks, dtype=torch.uint8, device=device)
    views = [{p: _view(buffer, b * end + offsets[p], shapes[p], dtype) for p in paths}
             for b in range(blocks)]
    return buffer, views


def _view(buffer: torch.Tensor, start: int, shape, dtype: torch.dtype) -> torch.Tensor:
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    return buffer[start:start + nbytes].view(dtype).view(tuple(shape))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
