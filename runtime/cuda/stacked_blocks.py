"""LoRA's block-diagonal B without block_diag's launches, each way.

LoRA's fused projections (q/k/v, gate/up) take B = block_diag(B_q, B_k, B_v): one
parameter a block, each 16 columns wide. The forward's block_diag writes B [N, k*16] (the
backward's one-pass adapter gradients read it), and the backward's copies each diagonal
block of d_B out into that block's gradient: a launch a fused projection each way (128
a step at LoRA 8B, 2.2-3.3 us each in the replay, plus their gaps).

- Forward (`block_slot`): B is made of parameters alone, which change only in the
  optimizer's update, so it is kept in bytes the step holds (`TrainStep.sides["blocks"]`)
  and written with the side and tail slots at the step's start, in their one launch
  (runtime/cuda/slot_refresh.py: the blocks at their places, the zero blocks written
  once by the first fill); the forward takes it there instead of running block_diag.
  MODULEC_BLOCK_SLOTS=0 runs block_diag (A/B runs).
- Backward (`reader`, `stacked`, `parts`): the one-pass adapter gradients
  (runtime/cuda/skinny_grads.py, blocked) sum each block alone, so their finishing launch
  can write the blocks' gradients stacked, d_B as [N, 16] (each row its own block's
  columns): block i's gradient is then rows end[i-1]..end[i] of it, a contiguous view.
  Where the delta's d_B is read by one block_diag backward alone, all of whose outputs
  are parameter gradients (each lives in bytes of its own and goes to the optimizer as it
  is), the step's interpreter asks for that (`b_compact`), keeps the stacked tensor (d_B
  itself becomes a shape-only stand-in) and gives block_diag's backward the views
  instead of running it. MODULEC_STACKED_BLOCK_GRADS=0 runs block_diag's backward.
"""

from __future__ import annotations

import os

import torch

from runtime.cuda import slot_refresh
from runtime.decisions import APPLY_SAVED, RECOMPUTE, SWAP
from runtime.interpreter import static_shape


def enabled() -> bool:
    """MODULEC_STACKED_BLOCK_GRADS=0: block_diag's backward runs (A/B runs)."""
    return os.environ.get("MODULEC_STACKED_BLOCK_GRADS", "1") != "0"


def slots_enabled() -> bool:
    """MODULEC_BLOCK_SLOTS=0: the forward runs block_diag (A/B runs)."""
    return os.environ.get("MODULEC_BLOCK_SLOTS", "1") != "0"


def block_slot(run, node, frame, pieces) -> torch.Tensor | None:
    """block_diag `node`'s B in the step's slot for it, filled at the step's start (taken)
    or here (then noted for the next steps' starts); `pieces`: its blocks, (parameter, row,
    column) each (the interpreter's `_parameter_pieces`), or None. None where the forward
    runs it as written: off the step's arena, other than a single-process bf16 step (the
    slot refresh reads the parameters' compute copies at the step's start: a data-parallel
    rank's may be gathered later), its blocks not all bf16 CUDA parameters, B dropped,
    swapped or re-applied under the planner's decisions, or a slot to be made while a
    graph is being captured."""
    from runtime.cuda.lora_kcat import single_process_bf16

    if not slots_enabled() or run.step is None or run.arena is None or not node.outputs \
            or not node.outputs[0] or not single_process_bf16(run.step.program):
        return None
    value, function = node.outputs[0], frame.function
    if run.decisions is not None and run.decisions.of(
            function.name, value, frame.instance) in (RECOMPUTE, SWAP, APPLY_SAVED):
        return None
    shape = static_shape(function, value)
    if not pieces or shape is None or not all(
            t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous() for t, _, _ in pieces):
        return None
    slots = run.step.sides.setdefault("blocks", {})
    key = (tuple(shape), *(t.data_ptr() for t, _, _ in pieces))
    slot = slots.get(key)
    if slot is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        slot = slots[key] = torch.zeros(shape, dtype=torch.bfloat16, device=pieces[0][0].device)
    if not slot_refresh.take(slot, pieces, 1.0):
        from runtime.cuda.kernels import _extension

        zero_rows = [int(r) for r in node.attr("zero_rows") or ()]
        _extension().block_diag_forward([t for t, _, _ in pieces], zero_rows, out=slot)
        slot_refresh.note(slot, pieces, 1.0)
    return slot


def block_slot_bytes(program, shapes: dict, itemsize: int = 2) -> int:
    """What `block_slot`'s slots add outside the memory plan (B's planned bytes stay in it):
    each block_diag of bf16 parameters (a fused projection's B), once per layer that runs
    it, as large as the matrix it makes; none where the step lays none (the switch off, or
    not a single-process bf16 step)."""
    from runtime.cuda.lora_kcat import single_process_bf16
    from runtime.cuda.param_dtypes import stored_dtypes
    from runtime.cuda.state import parameter_groups
    from runtime.kernels.tensor import block_layout

    if not slots_enabled() or not single_process_bf16(program):
        return 0
    stored, total = stored_dtypes(program, torch.bfloat16), 0
    for node, members in parameter_groups(program.graph, shapes,
                                          lambda n: n.target == "block_diag"):
        if all(len(shapes[p]) == 2 and stored[p] == torch.bfloat16 for p in members):
            zero_rows = [int(r) for r in node.attr("zero_rows") or ()]
            rows, cols = block_layout([tuple(shapes[p]) for p in members], zero_rows)[1]
            total += rows * cols * itemsize
    return total


def reader(function, node):
    """The block_diag backward of backward `function` that alone reads matmul backward
    `node`'s d_B (its second output), where all of its outputs are parameter gradients;
    else None."""
    if not enabled() or len(node.outputs) < 2 or not node.outputs[1]:
        return None
    d_b = node.outputs[1]
    if d_b in function.outputs:
        return None
    readers = [n for n in function.nodes if d_b in n.inputs]
    grads = {g for _, g in function.param_grads}
    if len(readers) != 1 or readers[0].kind != "op" \
            or readers[0].target != "block_diag_backward" or readers[0].inputs[0] != d_b:
        return None
    found = readers[0]
    return found if all(not o or o in grads for o in found.outputs) else None


def stacked(tensor, shape) -> bool:
    """`tensor`, made for a d_B of static `shape` ([N, k*16]), came back stacked [N, 16]."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and shape is not None \
        and len(shape) == 2 and tensor.shape[0] == shape[0] and tensor.shape[1] == 16 \
        and shape[1] != 16


def parts(stacked_grads: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """Each block's gradient: its rows of the stacked d_B (contiguous views)."""
    views, start = [], 0
    for count in rows:
        views.append(stacked_grads[start:start + count])
        start += count
    return views
