"""The residual stream's gradient written where the one-GEMM d_x reads it.

A LoRA-adapted projection that writes the residual stream (Llama's o_proj and down_proj)
gets its d_y from a fused residual norm's backward: d_x = d_residual_out + the norm's own
term, one tensor for both of the norm's input gradients. The one-GEMM d_x (lora_kcat.py
`dx_into`: [d_y | d_t] [W ; A]) needs d_y in the left columns of a scratch [rows, out + k r]
with d_t beside it. Copying d_y there costs a pass over it (down_proj, ~7 us a layer at
LoRA 8B), and o_proj kept its two GEMMs (the adapter path's d_x written, then read back
by base's epilogue) because that copy would cost what the one GEMM saves.

Here the norm's backward writes its result straight into the scratch's left columns
(`residual_target`; csrc/kernels/norms.cu takes d_residual_out and d_x as rows one
stride apart, and as one buffer): the projections' backward finds d_y beside where d_t
goes (lora_kcat.py `dy_in_scratch`), and the next norm's backward reads it there as its
d_residual_out and writes its own result over it, so the residual gradient stays in the
scratch from the model's last norm down to the first layer. The o/down d_t columns of the
scratch are used one after the other, never together.

Only where every reader of the value takes rows with one stride (`takes_rows`: a
matmul_backward's d_y, a fused residual norm backward's d_residual_out, through calls and
a layer stack's runs), the norm's weight is frozen (its d_weight kernel is not the frozen
one) and the step laid tail rows for a weight whose output is the residual's width (a
single-process bf16 step: lora_kcat.py `one_gemm_tails`). MODULEC_LORA_RESIDUAL_ROWS=0
keeps the planned bytes (A/B runs)."""

from __future__ import annotations

import math
import os

RESIDUAL_NORM_BACKWARDS = ("fused_residual_rmsnorm_backward",)
RESIDUAL_NORMS = ("fused_residual_rmsnorm",)
# op -> the input positions at which it reads rows with one stride
ROW_READERS = {"matmul_backward": {0}, "fused_residual_rmsnorm_backward": {0}}


def enabled() -> bool:
    return os.environ.get("MODULEC_LORA_RESIDUAL_ROWS", "1") != "0"


def residual_widths(graph) -> frozenset[int]:
    """The widths of the program's residual streams (its fused residual norms' last dim),
    whose gradient may be laid in a one-GEMM d_x scratch; none when switched off."""
    if not enabled():
        return frozenset()
    widths = set()
    for function in graph.functions:
        for node in function.nodes:
            if node.kind == "op" and node.target in RESIDUAL_NORMS and node.outputs:
                info = function.value(node.outputs[0])
                last = str(info.shape[-1]) if info is not None and info.shape else ""
                if last.isdigit():
                    widths.add(int(last))
    return frozenset(widths)


def takes_rows(graph, function, value: str, seen: set | None = None) -> bool:
    """Every reader of `value` in `function` takes it as rows with one stride: an op in
    ROW_READERS at its positions there; a call's callee's readers of that input; where it
    is a result, each caller's readers of it, and (a layer stack hands result k to its next
    run as input k) the function's own readers of its input k. An op with no outputs (left
    out of the run, runtime/prune.py) reads nothing; the entry's result is not taken."""
    seen = set() if seen is None else seen
    if not value or (function.name, value) in seen:
        return True
    seen.add((function.name, value))
    for node in function.nodes:
        positions = {i for i, v in enumerate(node.inputs) if v == value}
        if not positions or (node.kind == "op" and not any(node.outputs)):
            continue
        if node.kind == "call":
            callee = graph.function(node.target)
            if not all(i < len(callee.inputs) and
                       takes_rows(graph, callee, callee.inputs[i].id, seen) for i in positions):
                return False
        elif node.kind != "op" or not positions <= ROW_READERS.get(node.target, set()):
            return False
    results = [k for k, v in enumerate(function.outputs) if v == value]
    return not results or all(_result_taken(graph, function, k, seen) for k in results)


def _result_taken(graph, function, k: int, seen: set) -> bool:
    callers = [(f, n) for f in graph.functions for n in f.nodes
               if n.kind == "call" and n.target == function.name]
    if not callers:
        return False
    if not all(k < len(n.outputs) and takes_rows(graph, f, n.outputs[k], seen)
               for f, n in callers):
        return False
    inputs = [v.id for v in function.inputs]
    return len(inputs) != len(function.outputs) or takes_rows(graph, function, inputs[k], seen)


def residual_target(graph, function, node, d_y, decided: dict):
    """Where `node` (one of RESIDUAL_NORM_BACKWARDS in `function`, its d_y input `d_y`)
    writes its result: the residual rows of the one-GEMM d_x scratch, shaped as the value (a strided
    view), or None (its planned bytes: a d_weight wanted, or a reader that takes dense
    tensors). `decided` caches the graph walk per (function, node)."""
    from runtime.cuda.lora_kcat import residual_rows

    if len(node.outputs) < 2 or (len(node.outputs) > 2 and node.outputs[2]) \
            or not enabled() or not hasattr(d_y, "dtype"):
        return None
    key = (function.name, node.id)
    if key not in decided:
        decided[key] = all(takes_rows(graph, function, v) for v in node.outputs[:2])
    info = function.value(node.outputs[0] or node.outputs[1])
    if not decided[key] or info is None or not info.shape \
            or not all(str(d).isdigit() for d in info.shape):
        return None
    shape = [int(d) for d in info.shape]
    rows = residual_rows(math.prod(shape[:-1]), shape[-1], d_y.dtype, d_y.device)
    return None if rows is None else rows.view(shape)


def settle(frame, node, target) -> None:
    """The norm's results (one tensor, bound to both) in `target`: where its kernel wrote
    elsewhere (a reference kernel, off the GPU), copied there."""
    from runtime.arena import copy_in_16_bytes

    made = frame.env[node.outputs[0] or node.outputs[1]]
    if made.data_ptr() != target.data_ptr():
        copy_in_16_bytes(target, made.view(target.shape))
    frame.env.update({value: target for value in node.outputs[:2] if value})
