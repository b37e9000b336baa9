"""FP8 GEMMs through `torch._scaled_mm`: what the GPU step runs for the matmuls an FP8
recipe covers (metadata.precision, runtime/fp8.py is the CPU emulation of the same
numerics; decisions.md, "FP8 on the GPU"). Device-agnostic: the same functions run on CPU
tensors (torch's CPU `_scaled_mm`), which is how tests/test_fp8_gemm.py checks them
against the emulation.

- `ScaleState`: per operand key (`layer path|function/op:operand`, runtime.fp8's keys) a
  row of two device tensors: the amax history ([rows, history_len] fp32, index 0 the
  newest, -1 an empty slot) and the step's pending amax ([rows], -1: nothing yet). Scales
  are computed on the device (no host sync: the step is one CUDA graph): current scaling
  from the tensor's amax now, delayed from the history window's maximum (the tensor's own
  while the history is empty), scale = fp8_max / amax / 2^margin, 1 for an amax of 0 or
  not finite; the scale is computed in float64 and rounded to fp32, as the emulation's
  Python float is when it multiplies an fp32 tensor. `end_step` pushes the step's amaxes.
  `state_dict` / `load_state_dict` use the emulation's checkpoint format (float64
  histories, oldest first).
- `quantize` / `cast`: x -> fp8 (x in fp32 * scale) clamped to +-fp8_max and cast (round
  to nearest even), the emulation's rounding exactly, in the layouts the GEMMs ask for:
  on CUDA one pass of csrc/kernels/fp8_cast.cu writes x and / or x^T in fp8, elsewhere
  (the CPU, or `CAST["cuda"] = "torch"`) torch ops do.
- `matmul` / `matmul_backward`: the IR's matmul (transpose modes, alpha, leading dims
  folded) with every operand quantized once and each product one `_scaled_mm` (fp32
  accumulation, output in the operands' dtype): the first operand row-major, the second
  column-major, fp8 transposed copies made where a mode needs them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# the layout rules, shared with the planners' count of the FP8 buffers
from modulec.plan.fp8_memory import (GRADIENTS, backward_layouts,  # noqa: F401 (callers)
                                     forward_layouts)
from runtime.errors import RuntimeUserError
from runtime.fp8 import FORMATS

EMPTY = -1.0  # a history slot or pending amax with nothing in it (amaxes are >= 0)
ALIGN = 16  # _scaled_mm: every dim a multiple of 16


class Quantized:
    """x (2-D) in fp8 at one scale, in the layouts the GEMMs ask for: `plain()` (x's own,
    row-major) and `transposed()` (x^T contiguous), each made once, both in one pass of
    the CUDA cast kernel where both are wanted (`prepare`)."""

    def __init__(self, x: Tensor, fmt: str, scale: Tensor, inv_scale: Tensor | None = None):
        self.x, self.fmt, self.scale = x, fmt, scale
        # the dequantization factor _scaled_mm takes
        self.inv_scale = torch.reciprocal(scale) if inv_scale is None else inv_scale
        self._plain: Tensor | None = None
        self._transposed: Tensor | None = None

    def prepare(self, plain: bool, transposed: bool) -> "Quantized":
        plain, transposed = plain and self._plain is None, \
            transposed and self._transposed is None
        if plain or transposed:
            made = cast(self.x, self.fmt, self.scale, plain, transposed)
            if plain:
                self._plain = made.pop(0)
            if transposed:
                self._transposed = made.pop(0)
        return self

    def plain(self) -> Tensor:
        return self.prepare(True, False)._plain

    def transposed(self) -> Tensor:
        return self.prepare(False, True)._transposed


def amax_of(x: Tensor) -> Tensor:
    """max |x| as a 0-d fp32 tensor (NaN if x holds one), one reduction, no sync."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def scale_from(amax: Tensor, fmt: str, margin: int = 0) -> Tensor:
    """fp8_max / amax / 2^margin (1 for an amax of 0 or not finite), fp32 0-d."""
    wide = amax.to(torch.float64)
    ok = torch.isfinite(wide) & (wide > 0)
    top = FORMATS[fmt][1] / 2.0 ** margin
    return torch.where(ok, top / wide, torch.ones_like(wide)).to(torch.float32)


def quantize(x: Tensor, fmt: str, scale: Tensor) -> Quantized:
    """x (2-D) to be cast to `fmt` at `scale` (the layouts are made when asked for)."""
    return Quantized(x, fmt, scale)


# "kernel": CUDA tensors through csrc/kernels/fp8_cast.cu (one pass); "torch": torch ops
# (four passes; the CPU always). The same numbers either way (tests/test_fp8_gemm.py).
# "delayed": "fused": with the kernels, delayed scaling's cast takes the amax in the same
# pass (fp8_amax.cu `fp8_cast_delayed`, ScaleState.cast_delayed); "separate": its own pass.
CAST = {"cuda": "kernel", "delayed": "fused"}


def cast(x: Tensor, fmt: str, scale: Tensor, plain: bool, transposed: bool) -> list:
    """[x in fp8 if plain, x^T in fp8 contiguous if transposed]: (x in fp32 * scale)
    clamped to +-fp8_max (first: the E5M2 cast does not saturate, and the clamp keeps
    NaN), cast with round to nearest even."""
    if x.is_cuda and CAST["cuda"] == "kernel" and x.dtype in (torch.bfloat16, torch.float32):
        from runtime.cuda.kernels import _extension

        return _extension().fp8_cast(x.contiguous(), scale, 0 if fmt == "fp8_e4m3" else 1,
                                     plain, transposed)
    dtype, top = FORMATS[fmt]
    q = (x.to(torch.float32) * scale).clamp_(-top, top).to(dtype)
    return [q.contiguous()] * plain + [q.t().contiguous()] * transposed


# ====================================================================== the scales
class ScaleState:
    """The amax histories of a recipe's operands, on `device` (see the module doc)."""

    def __init__(self, recipe: dict, device="cpu"):
        scaling = recipe["scaling"]
        self.kind, self.margin = scaling["kind"], int(scaling.get("margin", 0))
        self.history_len = int(scaling.get("history_len", 1))
        self.device = torch.device(device)
        self.rows: dict[str, int] = {}
        self.history = torch.full((8, self.history_len), EMPTY, device=self.device)
        self.pending = torch.full((8,), EMPTY, device=self.device)
        self.window = None  # the histories' maxima, fixed for the step (begin_step)
        self.recording = False
        # a checkpoint's histories (float64, oldest first) of keys with no row yet: a key
        # gets its row at its first use, where it may share another key's (`share`)
        self.loaded: dict[str, Tensor] = {}
        self.row_loaded: dict[int, Tensor | None] = {}  # what each row started from
        self.work = None  # fp8_amax.cu's two counters (CUDA), zero between calls

    def _work(self) -> Tensor:
        if self.work is None:  # the first (eager) step: not while capturing
            self.work = torch.zeros(2, dtype=torch.int32, device=self.device)
        return self.work

    def _row(self, key: str) -> int:
        row = self.rows.get(key)
        if row is not None:
            return row
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"FP8 operand {key} first seen while capturing a CUDA graph: "
                               "run an eager step first (capture(warmup >= 1))")
        row = self.rows[key] = len(self.row_loaded)
        if row == self.pending.shape[0]:  # grow (eager steps only, before any capture)
            self.history = torch.cat([self.history, torch.full_like(self.history, EMPTY)])
            self.pending = torch.cat([self.pending, torch.full_like(self.pending, EMPTY)])
        self.row_loaded[row] = self.loaded.pop(key, None)
        self._write(row, self.row_loaded[row])
        return row

    def share(self, key: str, row: int) -> bool:
        """Whether operand `key` scales by `row`, another key's whose operand is the same
        tensor this step (fp8_step.py's casts): yes where it does already, or where it has
        no row yet and starts from the same history (none, or the same one loaded): it then
        gets that row, and the two keys' histories are one (the emulation's two are equal:
        each records the same tensor's amax at every step). No where it has its own."""
        mine = self.rows.get(key)
        if mine is not None:
            return mine == row
        loaded, theirs = self.loaded.get(key), self.row_loaded.get(row)
        if not _same(loaded, theirs):
            return False
        self.loaded.pop(key, None)
        self.rows[key] = row
        return True

    def _write(self, row: int, values: Tensor | None) -> None:
        """Row `row`'s history from `values` (oldest first; None: empty)."""
        self.history[row].fill_(EMPTY)
        if values is not None and values.numel():
            self.history[row, :values.numel()] = values.flip(0).to(self.history)

    def begin_step(self) -> None:
        """The delayed scales of this step: each history's maximum (EMPTY when none)."""
        n = len(self.row_loaded)
        self.window = self.history[:n].amax(dim=1) if n else None

    def scale(self, x: Tensor, fmt: str, key: str) -> Tensor:
        """The scale of operand `key` (value `x`) now; its amax recorded when recording."""
        return self.scales(x, fmt, key)[0]

    def scales(self, x: Tensor, fmt: str, key: str) -> tuple[Tensor, Tensor]:
        """(scale, 1 / scale) of operand `key` (value `x`) now; its amax recorded into the
        step's pending slot when recording (fmax: a NaN amax is not recorded, as in the
        emulation). On CUDA one launch does what the torch ops below do: the amax, the
        record and the scale (csrc/kernels/fp8_amax.cu), or, for a strided x, the one
        launch after the amax (fp8_cast.cu `fp8_scale`)."""
        row = self._row(key)
        pending = self.pending[row] if self.recording else None
        past = self.window[row] if self.kind == "delayed" and self.window is not None \
            and row < len(self.window) else None
        if x.is_cuda and CAST["cuda"] == "kernel":
            from runtime.cuda.kernels import _extension

            top = FORMATS[fmt][1] / 2.0 ** self.margin
            if x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous():
                return tuple(_extension().fp8_amax_scale(x, self._work(), pending, past, top))
            return tuple(_extension().fp8_scale(amax_of(x), pending, past, top))
        amax = amax_of(x)
        if pending is not None:
            torch.fmax(pending, amax, out=pending)
        if past is not None:
            amax = torch.where(past >= 0, past, amax)
        scale = scale_from(amax, fmt, self.margin)
        return scale, torch.reciprocal(scale)

    def cast_delayed(self, x: Tensor, fmt: str, key: str, plain: bool,
                     transposed: bool) -> "Quantized | None":
        """Delayed scaling on CUDA: x (2-D) quantized in the layouts asked for at the
        scale of its history's window, its amax recorded (when recording) in the same
        pass (csrc/kernels/fp8_amax.cu `fp8_cast_delayed`; an empty history: x's own amax
        and a second pass, on the device). None where that kernel does not take x (not
        bf16 contiguous with both dims multiples of 8, a key new this step, another
        scaling): `scales` then `cast`, the same numbers."""
        if not (x.is_cuda and CAST["cuda"] == "kernel" and CAST["delayed"] == "fused"
                and self.kind == "delayed" and (plain or transposed) and x.dim() == 2
                and x.dtype == torch.bfloat16 and x.is_contiguous() and x.numel()
                and x.shape[0] % 8 == 0 and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0):
            return None
        row = self._row(key)
        if self.window is None or row >= len(self.window):
            return None
        from runtime.cuda.kernels import _extension

        pending = self.pending[row] if self.recording else None
        top = FORMATS[fmt][1] / 2.0 ** self.margin
        scale, inv_scale, *made = _extension().fp8_cast_delayed(
            x, self._work(), pending, self.window[row], top, 0 if fmt == "fp8_e4m3" else 1,
            plain, transposed)
        q = Quantized(x, fmt, scale, inv_scale)
        q._plain = made.pop(0) if plain else None
        q._transposed = made.pop(0) if transposed else None
        return q

    def end_step(self) -> None:
        """Each operand's amax of the step joins its history (the oldest drops out)."""
        n = len(self.row_loaded)
        if not n:
            return
        history, pending = self.history[:n], self.pending[:n]
        pushed = torch.cat([pending[:, None], history[:, :-1]], dim=1)
        history.copy_(torch.where((pending >= 0)[:, None], pushed, history))
        pending.fill_(EMPTY)

    def state_dict(self) -> dict[str, Tensor]:
        """{key: float64 history, oldest first} (runtime.fp8.Fp8State's format); a host
        sync: checkpoints only."""
        history = self.history[:len(self.row_loaded)].to("cpu", torch.float64)
        out = {key: values for key, values in self.loaded.items() if values.numel()}
        for key, row in self.rows.items():  # keys sharing a row: each its copy
            values = history[row][history[row] >= 0].flip(0)
            if values.numel():
                out[key] = values
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """The histories of a checkpoint (either device's): keys with rows (steps ran)
        written now, the others when first used."""
        self.pending.fill_(EMPTY)
        self.loaded = {key: values.reshape(-1)[-self.history_len:].to("cpu", torch.float64)
                       for key, values in state.items()}
        written: dict[int, Tensor | None] = {}
        for key, row in self.rows.items():
            values = self.loaded.pop(key, None)
            if row in written and not _same(written[row], values):
                raise RuntimeError(f"FP8 operand {key} shares its amax history with another "
                                   "operand of the same tensor, and the checkpoint holds two "
                                   "different ones: load it before the first step")
            written[row] = self.row_loaded[row] = values
            self._write(row, values)
        for row in set(self.row_loaded) - set(written):
            self._write(row, None)


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None) == (b is None) and (a is None or torch.equal(a, b))


# ====================================================================== the GEMMs
def _fold(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x


# cuBLAS's fast FP8 accumulation (the partial sums not promoted to fp32 every few K
# blocks: faster, less exact than the recipe's fp32 accumulation) for the products of a
# forward function's covered matmuls (fp8_step.StepFp8). Off: every product accumulates
# as the recipe says. A measurement knob (benchmarks/train_step.py's `fastaccum`), no
# recipe setting; TransformerEngine's and torchao's FP8 training do this by default.
FAST_ACCUM = {"forward": False}


def scaled_product(x: Quantized, y: Quantized, mode: str, alpha: float, out_dtype,
                   where: str = "", out: Tensor | None = None, fast: bool = False) -> Tensor:
    """alpha * op(x) @ op(y) of two quantized 2-D operands: one _scaled_mm, written into
    `out` (the arena's planned bytes, uint8) where they fit, as the bf16 Matmul does;
    `fast`: cuBLAS's fast accumulation (FAST_ACCUM)."""
    a = x.plain() if mode[0] == "N" else x.transposed()
    b = y.plain().t() if mode[1] == "T" else y.transposed().t()
    check_dims(a.shape[0], a.shape[1], b.shape[1], where)
    into = _into(out, (a.shape[0], b.shape[1]), out_dtype, a.device)
    c = torch._scaled_mm(a, b, scale_a=x.inv_scale, scale_b=y.inv_scale, out_dtype=out_dtype,
                         use_fast_accum=bool(fast),
                         **({"out": into} if into is not None else {}))
    return c if alpha == 1.0 else c.mul_(alpha)


def _into(raw: Tensor | None, shape, dtype, device) -> Tensor | None:
    """The planned bytes `raw` as a contiguous `shape` tensor of `dtype`, or None where there
    are none or they do not fit (the product is then allocated and place() copies it)."""
    if raw is None or raw.device != device:
        return None
    from runtime.cuda.kernels import typed

    c = typed([raw], 0, shape, dtype)
    return c if c is not None and c.is_contiguous() else None


def check_dims(m: int, k: int, n: int, where: str) -> None:
    if m % ALIGN or k % ALIGN or n % ALIGN:
        raise RuntimeUserError(
            f"FP8 GEMM {where}: M x K x N = {m} x {k} x {n}, but torch._scaled_mm needs "
            f"every dim a multiple of {ALIGN}",
            help=["pad the model's sizes (d_model, d_ff, heads x head_dim, batch x seq) to "
                  "multiples of 16, or leave this module out of the recipe"])


class Operand(NamedTuple):
    value: Tensor
    fmt: str  # fp8_e4m3 / fp8_e5m2
    key: str  # the scale state's key
    q: "Quantized | None" = None  # quantized already (the step's casts, fp8_step.py)


def quantized(state: ScaleState, operand: Operand) -> Quantized:
    if operand.q is not None:
        return operand.q
    x = _fold(operand.value)
    return Quantized(x, operand.fmt, *state.scales(x, operand.fmt, operand.key))


def matmul(state: ScaleState, A: Operand, B: Operand, *, transpose: str = "NN",
           alpha: float = 1.0, where: str = "", out=None, fast: bool = False, **_) -> Tensor:
    """C = alpha * op(A) @ op(B) in FP8 (C keeps A's leading dims in N* modes); `out`: the
    planned bytes of C (or None); `fast`: cuBLAS's fast accumulation (FAST_ACCUM)."""
    C = scaled_product(quantized(state, A), quantized(state, B), transpose, float(alpha),
                       A.value.dtype, where, out[0] if out else None, fast)
    if transpose[0] == "N" and A.value.dim() > 2:
        C = C.view(*A.value.shape[:-1], C.shape[-1])
    return C


def matmul_backward(state: ScaleState, d_C: Operand, A: Operand, B: Operand, *,
                    transpose: str = "NN", alpha: float = 1.0, wanted=(True, True),
                    where: str = "", out=None, **_) -> list:
    """(d_A, d_B) of C = alpha * op(A) @ op(B), each operand quantized once (the
    emulation quantizes all three), None for an unwanted gradient."""
    q = [quantized(state, o) for o in (d_C, A, B)]
    # each operand's layouts, made in one pass
    for operand, (plain, transposed) in zip(q, backward_layouts(transpose, wanted)):
        operand.prepare(plain, transposed)
    grads = []
    for want, (x, y, mode), like, raw in zip(wanted, GRADIENTS[transpose], (A, B),
                                             out or (None, None)):
        grads.append(None if not want else scaled_product(
            q[x], q[y], mode, float(alpha), d_C.value.dtype, where, raw).view(
                like.value.shape))
    return grads
