"""LoRA's delta inside the base GEMM for the wide projections: one GEMM over K = in + k r.

The step writes an adapted projection's y = x W^T + s h B^T (h = x A^T, k r wide) into y's
planned bytes as two GEMMs: the delta s h B^T first (a K = k r GEMM that only writes y),
then base's GEMM adding into it (beta = 1). For a projection whose output is much wider
than its input (Llama's gate/up: 28,672 against 4,096) writing the delta and reading it
back costs more than the input does: on one H100 at T=2048 the gate/up delta GEMM takes
47 us a layer in the step (117 MB written; the `bz ... NNT` GEMMs of
benchmarks/gpu/results-h100-profile-lora8b-s12.txt), and base's epilogue reads the
117 MB again. Here y = [x | h] [W | s B]^T is one GEMM, K = in + k r, beta = 0:

- W (frozen) is laid with k r spare columns beside each row (`side_columns`, the weights
  region: runtime/cuda/state.py `region_of`), into which s B is written each step (B
  changes with every update: [out, k r], 1.8 MB for gate/up);
- x and h side by side: where the memory plan laid x's rows with k r spare columns
  (modulec/plan/pads.py: every adapted projection's input made by an op in row order,
  Llama's norm outputs and SwiGLU's output), h is written into those columns and x's own
  bytes are the wide matrix, for any projection (`pad`); elsewhere x and h are copied
  into a scratch [T, in + k r] (x: 17 MB read and written, against the delta's 117 MB
  written and read back), for the WIDE projections only;
- the GEMM is the timed `mm_into` (runtime/cuda/gemm.py) over those two views.

The sums are taken in one fp32 accumulation and rounded once (the two-GEMM path rounds
the delta to bf16 first). `MODULEC_LORA_KCAT=0` keeps the two-GEMM path and
`MODULEC_LORA_KCAT_MIN` sets WIDE (A/B runs), both read when a step lays its weights;
`MODULEC_LORA_KCAT_PADDED=0` leaves the planned spare columns unused (A/B runs).
Only the single-process bf16 step lays side slots (`one_gemm_sides`: no data, tensor or
pipeline parallel, no FP8 recipe, whose casts read W's rows contiguous); the step's
fixed bytes count the side columns (59 MB at LoRA 8B); the scratch is one buffer per
(device, shape), outside the memory plan (17 MB at LoRA 8B, B=1, T=2048). Measured: one
H100, LoRA 8B, 1.0 ms a step in both orders of an in-process A/B
(benchmarks/gpu/results-h100-lora-s12-ab.txt).

The backward's counterpart: d_x = [d_y | d_t] [W ; A] as one GEMM, W laid with A's rows
after it (`tail_rows`, `stage_dt`, `dx_into`; the step interpreter's `_stage_one_gemm_dx`),
for a projection whose input is the wide side (down_proj: d_y copied beside d_t), for
a fused one (q/k/v, gate/up), whose d_y is a concat planned in place: the interpreter
moves that concat into the scratch before its producers run (`_widen_dx`,
runtime/arena.py `widen`), so swiglu's and attention's backward write d_y beside d_t and
nothing is copied; and for one writing the residual stream (o_proj, down_proj), whose
d_y the fused residual norms' backward writes into the scratch
(runtime/cuda/residual_rows.py: `residual_rows`, `dy_in_scratch`), no copy either;
MODULEC_LORA_KCAT_DX=0 keeps the two GEMMs. Measured: one H100, LoRA
8B, down_proj 126.31 -> 125.43 and 126.94 -> 126.31 ms in both orders of an in-process A/B
(benchmarks/gpu/results-h100-lora-s14-ab.txt)."""

from __future__ import annotations

import math
import os
import weakref

import torch

from runtime.arena import copy_in_16_bytes
from runtime.cuda import slot_refresh
from runtime.cuda.slot_refresh import view_key

WIDE = 2.0  # copying x pays where out >= WIDE * in (gate/up: 7x; qkv: 1.5x)
# a weight view's key -> a weak reference to its side slot [out, k r]: the step that laid
# the weights holds the slots (TrainStep.sides), so they go with its weights
_sides: dict[tuple, weakref.ref] = {}
_scratch: dict[tuple, torch.Tensor] = {}
# a weight view's key -> a weak reference to its tail slot [r, in] (`lay_tails`)
_tails: dict[tuple, weakref.ref] = {}


def enabled() -> bool:
    return os.environ.get("MODULEC_LORA_KCAT", "1") != "0"


def side_columns(shapes: dict, frozen) -> dict[str, int]:
    """{frozen 2-D weight path: k r} for each LoRA-adapted weight: k r the sum of its
    adapters' ranks (the block-diagonal B's width), a multiple of 8 (16-byte rows). All
    of them: whether a call copies x (WIDE) or finds it planned wide is the call's."""
    if not enabled():
        return {}
    sides = {}
    for path in frozen:
        shape = shapes.get(path)
        if shape is None or len(shape) != 2:
            continue
        ranks = [shapes[p][1] for p in shapes
                 if p.startswith(path + ".") and p.endswith(".lora_B")]
        if ranks and sum(ranks) % 8 == 0 and shape[1] % 8 == 0:
            sides[path] = sum(ranks)
    return sides


def _threshold() -> float:
    """WIDE, or MODULEC_LORA_KCAT_MIN's value (A/B runs of the threshold)."""
    return float(os.environ.get("MODULEC_LORA_KCAT_MIN", WIDE))


def tail_rows(shapes: dict, frozen, residual_widths=frozenset()) -> dict[str, int]:
    """{frozen 2-D weight path: k r} for the weights whose backward's d_x = [d_y | d_t]
    [W ; A] runs as one GEMM (`dx_into`), laid with k r spare rows after their own (A's
    rows copied there: `tail_slot`), out + k r and in multiples of 8: one adapter at least
    WIDE times as wide in as out (Llama's down_proj: 14,336 against 4,096; d_y copied
    beside d_t pays), or several (a fused projection, q/k/v and gate/up: its d_y is a
    concat the backward writes straight into the rows beside d_t, `widened_dx`), or one
    writing the residual stream (out in `residual_widths`, the fused residual norms'
    widths: Llama's o_proj; its d_y, the residual gradient, is laid in the scratch by the
    norms' backward, runtime/cuda/residual_rows.py).
    MODULEC_LORA_KCAT_DX=0: none; MODULEC_LORA_KCAT_DX_FUSED=0: not the fused ones (A/B)."""
    if not enabled() or os.environ.get("MODULEC_LORA_KCAT_DX", "1") == "0":
        return {}
    wide, tails = _threshold(), {}
    for path in frozen:
        shape = shapes.get(path)
        adapters = [shapes[p] for p in shapes if p.endswith(".lora_A") and (
            p == path + ".lora_A" or p.startswith(path + "."))]
        if shape is None or len(shape) != 2 or not adapters \
                or any(a[1] != shape[1] for a in adapters):
            continue
        rank = sum(a[0] for a in adapters)
        if (shape[0] + rank) % 8 or shape[1] % 8:
            continue
        fused = len(adapters) > 1 and os.environ.get("MODULEC_LORA_KCAT_DX_FUSED", "1") != "0"
        if fused or shape[1] >= wide * shape[0] or shape[0] in residual_widths:
            tails[path] = rank
    return tails


def copy_pays(w: torch.Tensor) -> bool:
    """Copying d_y beside d_t for the one-GEMM d_x pays (a WIDE projection)."""
    return w.shape[1] >= _threshold() * w.shape[0]


def widened_dx(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, int] | None:
    """(the [d_y | d_t] scratch's bytes (uint8), k r) for a weight laid with a tail slot of
    k r rows, where the backward can write d_y (rows x w's out) straight into the scratch's
    left columns (runtime/arena.py `widen`), else None."""
    found = _dx_scratch(w, rows)
    return None if found is None else (found[0].view(-1).view(torch.uint8), found[1])


def one_gemm_sides(program, shapes: dict, frozen) -> dict[str, int]:
    """`side_columns` of the weights a bf16 step of the program stores in bf16, where it
    runs on one process: none where its schedule runs data, tensor or pipeline parallel
    (their sections) or its metadata an FP8 recipe (whose casts read W's rows
    contiguous). The step lays these (TrainStep) and its fixed bytes count them
    (step_memory.runtime_fixed_bytes): one rule for both."""
    return _single_process_bf16(program, side_columns(shapes, frozen))


def one_gemm_tails(program, shapes: dict, frozen) -> dict[str, int]:
    """`tail_rows` under `one_gemm_sides`'s rule, the residual widths the program's."""
    from runtime.cuda.residual_rows import residual_widths

    return _single_process_bf16(program, tail_rows(shapes, frozen,
                                                   residual_widths(program.graph)))


def single_process_bf16(program) -> bool:
    """A step in one process (no data, tensor or pipeline parallel) without an FP8 recipe:
    where the one-GEMM paths lay their slots, each parameter a compute copy that stays in
    place from step to step (so a slot filled from it at the step's start holds it)."""
    schedule = program.document.get("schedule", {})
    recipe = program.metadata.get("precision") or {}
    return not any(k in schedule for k in ("distributed", "tensor_parallel", "pipeline")) \
        and not recipe.get("matmuls")


def _single_process_bf16(program, laid: dict[str, int]) -> dict[str, int]:
    from runtime.cuda.param_dtypes import stored_dtypes

    if not laid or not single_process_bf16(program):
        return {}
    stored = stored_dtypes(program, torch.bfloat16)  # `@dtype(fp32)` ones: none
    return {p: n for p, n in laid.items() if stored[p] == torch.bfloat16}


def side_bytes(shapes: dict, sides: dict, itemsize: int = 2, tails: dict | None = None
               ) -> int:
    """What the side columns (rows x k r each) and tail rows (r x in each) add to the
    weights region."""
    return sum(shapes[p][0] * n * itemsize for p, n in sides.items()) + \
        sum(shapes[p][1] * n * itemsize for p, n in (tails or {}).items())


def dx_scratch_bytes(program, shapes: dict, tails: dict, itemsize: int = 2) -> int:
    """The one-GEMM d_x's scratches the step makes outside the memory plan: one
    [rows, out + k r] for each such shape among the weights laid with tail rows (`_wide`),
    rows the tokens of a micro-batch (the program's first 2-D input, its token ids)."""
    entry = program.graph.function(program.graph.entry)
    dims = next((v.shape for v in entry.inputs if len(v.shape) == 2), None)
    if not tails or dims is None or not all(str(d).isdigit() for d in dims):
        return 0
    rows = math.prod(int(d) for d in dims)
    return sum(rows * width * itemsize for width in {shapes[p][0] + n for p, n in tails.items()})


def lay_sides(views: dict, sides: dict) -> dict[str, torch.Tensor]:
    """{path: side slot} for the weights `views` laid with `sides[path]` spare columns a
    row (state.region_of), each registered for the one-GEMM path; the caller holds them."""
    slots = {}
    for path, width in sides.items():
        weight = views[path]
        slots[path] = weight.as_strided((weight.shape[0], width), weight.stride(),
                                        weight.storage_offset() + weight.shape[1])
        _sides[view_key(weight)] = weakref.ref(slots[path])
    return slots


def lay_tails(views: dict, tails: dict) -> dict[str, torch.Tensor]:
    """{path: tail slot [r, in]} for the weights `views` laid with `tails[path]` spare rows
    after their own (state.region_of), each registered for `dx_into` and
    `residual_rows`."""
    slots = {}
    for path, rows in tails.items():
        weight = views[path]
        slots[path] = weight.as_strided((rows, weight.shape[1]), weight.stride(),
                                        weight.storage_offset() + _rows_end(weight))
        _tails[view_key(weight)] = weakref.ref(slots[path])
    return slots


def residual_rows(rows: int, width: int, dtype, device) -> torch.Tensor | None:
    """The left columns ([rows, width], rows apart) of the one-GEMM d_x scratch of the
    weights laid with tail rows whose output is `width` wide (the widest tail among
    them), where a residual stream's gradient may lie so that those weights' backward
    finds d_y beside its d_t (runtime/cuda/residual_rows.py); None where no such weight is
    laid."""
    # _tails' keys are the weights' view keys: (device, first element, shape, strides)
    slots = [ref() for key, ref in _tails.items() if key[0] == device and key[2][0] == width]
    depth = max((s.shape[0] for s in slots if s is not None and s.dtype == dtype), default=0)
    return _wide(rows, width + depth, dtype, device, "dx")[:, :width] if depth else None


def dy_in_scratch(d_y: torch.Tensor, w: torch.Tensor) -> bool:
    """d_y lies in the left columns of w's one-GEMM d_x scratch already (written there by
    its producer: `residual_rows`), so `dx_into` reads it where it is."""
    if not isinstance(d_y, torch.Tensor) or d_y.dim() < 2 or d_y.shape[-1] != w.shape[0]:
        return False
    found = _dx_scratch(w, d_y.numel() // d_y.shape[-1])
    if found is None:
        return False
    try:
        view = d_y.view(-1, d_y.shape[-1])
    except RuntimeError:
        return False
    return view.data_ptr() == found[0].data_ptr() and view.stride() == found[0].stride()


def _rows_end(weight: torch.Tensor) -> int:
    """Elements from a 2-D weight's first to just past its last row, as laid (with side
    columns: rows of its stride)."""
    return weight.shape[0] * weight.stride(0)



def side_of(weight: torch.Tensor, width: int) -> torch.Tensor | None:
    """The side slot laid beside `weight` (the switch acted when the step laid it)."""
    side = _laid(_sides, weight)
    return side if side is not None and side.shape[1] == width else None


def kcat_into(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, B: torch.Tensor,
              alpha: float, C: torch.Tensor, pad: int = 0, pieces=None
              ) -> torch.Tensor | None:
    """C = x w^T + alpha t B^T (2-D: x [T, in], w [out, in] with a side slot, t [T, k r],
    B [out, k r]) as one GEMM over [x | t] and [w | alpha B] (`kcat_operands`); None where
    those are not laid (the caller takes the two-GEMM path)."""
    from runtime.cuda.gemm import mm_into

    operands = kcat_operands(x, w, t, B, alpha, pad, pieces)
    return None if operands is None else mm_into(operands[0], operands[1].t(), C)


def kcat_operands(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, B: torch.Tensor,
                  alpha: float, pad: int = 0, pieces=None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([x | t], [w | alpha B]) for `kcat_into` (or the gated GEMM, runtime/cuda/gated_mlp.py),
    alpha B written into w's side slot and t beside x; None where w has no side slot of
    B's width or x is neither laid wide (`pad`: the plan's spare columns after its rows)
    nor of a WIDE projection. `pieces`: the parameters B is made of, (tensor, row,
    column) each (B itself, or a block-diagonal B's blocks), where the caller knows them:
    the slot is then filled at the step's start (runtime/cuda/slot_refresh.py) instead
    of here."""
    side = side_of(w, B.shape[1])
    if side is None or x.shape[1] != w.shape[1] or t.shape[1] != B.shape[1]:
        return None
    inner = w.shape[1]
    wide = laid_wide(x, B.shape[1]) if pad == B.shape[1] else None
    if wide is None:
        if w.shape[0] < _threshold() * inner:
            return None  # copying x costs what the one GEMM saves
        wide = _wide(x.shape[0], inner + B.shape[1], x.dtype, x.device)
        _copy_rows(wide[:, :inner], x)
    _fill(side, pieces, alpha, lambda: torch.mul(B, alpha, out=side))
    _copy_rows(wide[:, inner:], t)
    joined = w.as_strided((w.shape[0], inner + B.shape[1]), w.stride(), w.storage_offset())
    return wide, joined


def _fill(slot: torch.Tensor, pieces, alpha: float, fill) -> None:
    """`fill()` the slot, unless this step's start already did (slot_refresh.take); where
    its pieces are known, note them for the next steps' starts."""
    if pieces is not None and slot_refresh.take(slot, pieces, alpha):
        return
    fill()
    if pieces is not None:
        slot_refresh.note(slot, pieces, alpha)


def laid_wide(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """[x | its spare columns] where the plan laid x's rows `width` elements wider (the
    caller knows they are x's: the arena's `pad_of`) and x is that view, else None (a
    dense copy of x). MODULEC_LORA_KCAT_PADDED=0: None (A/B runs)."""
    if os.environ.get("MODULEC_LORA_KCAT_PADDED", "1") == "0" or x.dim() != 2 \
            or x.stride() != (x.shape[1] + width, 1):
        return None
    return x.as_strided((x.shape[0], x.shape[1] + width), x.stride(), x.storage_offset())


def t_beside_x(x: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor | None:
    """x's spare columns ([rows, width], rows apart), where `kcat_into` reads t beside x,
    for t's maker to write t there (the step interpreter's `_t_beside_x`): where the plan
    laid x `width` wider and w has a side slot that wide, else None. Saves t's copy into
    the columns (a launch a projection, ~2.5 us with its gap at LoRA 8B).
    MODULEC_LORA_T_BESIDE_X=0: None (A/B runs)."""
    if os.environ.get("MODULEC_LORA_T_BESIDE_X", "1") == "0" or not isinstance(x, torch.Tensor) \
            or not isinstance(w, torch.Tensor) or w.dim() != 2 or x.dim() < 2 \
            or x.shape[-1] != w.shape[1] or side_of(w, width) is None:
        return None
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:
        return None
    wide = laid_wide(rows, width)
    return None if wide is None else wide[:, rows.shape[1]:]


def _copy_rows(into: torch.Tensor, rows: torch.Tensor) -> None:
    """into.copy_(rows) for a strided `into` (the scratch's columns), in 16-byte elements
    where both lay their rows so (runtime.arena.copy_in_16_bytes): torch's copy into a
    strided view moves one element a thread, 2 bytes for bf16 (x of gate/up: ~1.1 TB/s
    on an H100, in a step's profile). LoRA 8B on one H100, in-process A/B: 125.80 ->
    124.16 and 125.17 -> 124.72 ms (benchmarks/gpu/results-h100-lora-s13-ab.txt). Nothing
    moves where the rows were written there already (`widened_dx`, `dt_beside`)."""
    copy_in_16_bytes(into, rows)


def laid_tails() -> bool:
    """Whether any weight was laid with tail rows (the default step: none)."""
    return any(ref() is not None for ref in _tails.values())


def stage_dt(d_t: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> bool:
    """The backward's first half of `dx_into`, while d_t [.., r] is alive (the adapter
    path's matmul_backward): d_t copied into the right columns of the [d_y | d_t] scratch
    (unless its maker wrote it there: `dt_beside`). False (nothing done) where w has no
    tail slot of a's shape or the shapes do not fit."""
    tail = _tail_of(w, a)
    if tail is None or d_t.shape[-1] != a.shape[0] or d_t.dtype != w.dtype:
        return False
    rows = d_t.numel() // d_t.shape[-1]
    _copy_rows(_dx_scratch(w, rows)[0][:, w.shape[0]:], d_t.reshape(rows, -1))
    return True


def dt_beside(w: torch.Tensor, rows: int, width: int) -> torch.Tensor | None:
    """The [d_y | d_t] scratch's d_t columns (rows x width, rows apart) for a weight laid
    with a tail slot `width` rows deep, where d_t's maker may write it (the one-pass
    gradients' finishing launch), else None."""
    found = _dx_scratch(w, rows)
    return None if found is None or found[1] != width else found[0][:, w.shape[0]:]


def dx_into(d_y: torch.Tensor, w: torch.Tensor, a: torch.Tensor, out: torch.Tensor,
            pieces=None) -> torch.Tensor:
    """d_x = d_y w + d_t a (d_t staged by `stage_dt`) as one GEMM over [d_y | d_t] and
    [w ; a] (`dx_operands`)."""
    from runtime.cuda.gemm import mm_into

    wide, stacked = dx_operands(d_y, w, a, pieces)
    return mm_into(wide, stacked, out.view(wide.shape[0], w.shape[1]))


def dx_operands(d_y: torch.Tensor, w: torch.Tensor, a: torch.Tensor, pieces=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """([d_y | d_t], [w ; a]) for `dx_into` (or the gated GEMM, runtime/cuda/gated_mlp.py):
    a copied into w's tail slot (at the step's start where its parameters are known,
    `pieces`: slot_refresh.py), d_y into the scratch's left columns (where it was not
    written there: `widened_dx`)."""
    tail, (out_rows, inner) = _tail_of(w, a), w.shape
    _fill(tail, pieces, 1.0, lambda: tail.copy_(a))
    rows = d_y.numel() // d_y.shape[-1]
    wide = _dx_scratch(w, rows)[0]
    _copy_rows(wide[:, :out_rows], d_y.reshape(rows, -1))
    stacked = w.as_strided((out_rows + a.shape[0], inner), w.stride(), w.storage_offset())
    return wide, stacked


def _tail_of(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
    tail = _laid(_tails, w)
    if tail is None or tuple(tail.shape) != tuple(a.shape) or w.stride(1) != 1 \
            or tail.stride() != w.stride():
        return None
    return tail


def _laid(registry: dict, w: torch.Tensor) -> torch.Tensor | None:
    """The slot `registry` (_sides, _tails) holds for weight view `w`, or None."""
    ref = registry.get(view_key(w))
    return ref() if ref is not None else None


def _dx_scratch(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, int] | None:
    """The [d_y | d_t] scratch [rows, out + k r] of a weight laid with a tail slot k r rows
    deep, and k r; None where it has none."""
    tail = _laid(_tails, w)
    if tail is None or w.stride(1) != 1:
        return None
    return _wide(rows, w.shape[0] + tail.shape[0], w.dtype, w.device, "dx"), tail.shape[0]


def _wide(rows: int, cols: int, dtype, device, use: str = "x") -> torch.Tensor:
    """The step's scratch for [x | t] (or [d_y | d_t]: `use`): one per shape, kept (a
    captured graph reads it)."""
    key = (device, rows, cols, dtype, use)
    if key not in _scratch:
        _scratch[key] = torch.empty(rows, cols, dtype=dtype, device=device)
    return _scratch[key]
