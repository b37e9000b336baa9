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
- `quantize`: x -> (fp8 tensor, 1 / scale): (x in fp32 * scale) clamped to +-fp8_max and
  cast (round to nearest even), the emulation's rounding exactly.
- `matmul` / `matmul_backward`: the IR's matmul (transpose modes, alpha, leading dims
  folded) with every operand quantized once and each product one `_scaled_mm` (fp32
  accumulation, output in the operands' dtype): the first operand row-major, the second
  column-major, fp8 transposed copies made where a mode needs them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from runtime.errors import RuntimeUserError
from runtime.fp8 import FORMATS

EMPTY = -1.0  # a history slot or pending amax with nothing in it (amaxes are >= 0)
ALIGN = 16  # _scaled_mm: every dim a multiple of 16


class Quantized(NamedTuple):
    data: Tensor  # fp8, x's shape (2-D)
    inv_scale: Tensor  # fp32 0-d: the dequantization factor _scaled_mm multiplies by


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
    """x * scale (in fp32) clamped to +-fp8_max, cast to `fmt` (clamp first: the E5M2 cast
    does not saturate); with 1 / scale for _scaled_mm."""
    dtype, top = FORMATS[fmt]
    scaled = x.to(torch.float32) * scale
    return Quantized(scaled.clamp_(-top, top).to(dtype), torch.reciprocal(scale))


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

    def _row(self, key: str) -> int:
        row = self.rows.get(key)
        if row is not None:
            return row
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"FP8 operand {key} first seen while capturing a CUDA graph: "
                               "run an eager step first (capture(warmup >= 1))")
        row = self.rows[key] = len(self.rows)
        if row == self.pending.shape[0]:  # grow (eager steps only, before any capture)
            self.history = torch.cat([self.history, torch.full_like(self.history, EMPTY)])
            self.pending = torch.cat([self.pending, torch.full_like(self.pending, EMPTY)])
        return row

    def begin_step(self) -> None:
        """The delayed scales of this step: each history's maximum (EMPTY when none)."""
        self.window = self.history[:len(self.rows)].amax(dim=1) if self.rows else None

    def scale(self, x: Tensor, fmt: str, key: str) -> Tensor:
        """The scale of operand `key` (value `x`) now; its amax recorded when recording."""
        row, amax = self._row(key), amax_of(x)
        if self.recording:  # fmax: a NaN amax is not recorded (as in the emulation)
            pending = self.pending[row]
            torch.fmax(pending, amax, out=pending)
        if self.kind == "delayed" and self.window is not None and row < len(self.window):
            past = self.window[row]
            amax = torch.where(past >= 0, past, amax)
        return scale_from(amax, fmt, self.margin)

    def end_step(self) -> None:
        """Each operand's amax of the step joins its history (the oldest drops out)."""
        n = len(self.rows)
        if not n:
            return
        history, pending = self.history[:n], self.pending[:n]
        pushed = torch.cat([pending[:, None], history[:, :-1]], dim=1)
        history.copy_(torch.where((pending >= 0)[:, None], pushed, history))
        pending.fill_(EMPTY)

    def state_dict(self) -> dict[str, Tensor]:
        """{key: float64 history, oldest first} (runtime.fp8.Fp8State's format); a host
        sync: checkpoints only."""
        history = self.history[:len(self.rows)].to("cpu", torch.float64)
        out = {}
        for key, row in self.rows.items():
            values = history[row][history[row] >= 0].flip(0)
            if values.numel():
                out[key] = values
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.history.fill_(EMPTY)
        self.pending.fill_(EMPTY)
        for key, values in state.items():
            values = values.reshape(-1)[-self.history_len:].flip(0)
            row = self._row(key)  # first: it may grow (replace) self.history
            self.history[row, :values.numel()] = values.to(self.history)


# ====================================================================== the GEMMs
def _fold(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x


def _first(q: Tensor, flag: str) -> Tensor:
    """op(q) row-major (K contiguous): _scaled_mm's first operand."""
    return q.contiguous() if flag == "N" else q.t().contiguous()


def _second(q: Tensor, flag: str) -> Tensor:
    """op(q) column-major (K contiguous): _scaled_mm's second operand."""
    return q.contiguous().t() if flag == "T" else q.t().contiguous().t()


def scaled_product(x: Quantized, y: Quantized, mode: str, alpha: float, out_dtype,
                   where: str = "") -> Tensor:
    """alpha * op(x) @ op(y) of two quantized 2-D operands: one _scaled_mm."""
    a, b = _first(x.data, mode[0]), _second(y.data, mode[1])
    check_dims(a.shape[0], a.shape[1], b.shape[1], where)
    c = torch._scaled_mm(a, b, scale_a=x.inv_scale, scale_b=y.inv_scale, out_dtype=out_dtype)
    return c if alpha == 1.0 else c.mul_(alpha)


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


def quantized(state: ScaleState, operand: Operand) -> Quantized:
    x = _fold(operand.value)
    return quantize(x, operand.fmt, state.scale(x, operand.fmt, operand.key))


def matmul(state: ScaleState, A: Operand, B: Operand, *, transpose: str = "NN",
           alpha: float = 1.0, where: str = "", **_) -> Tensor:
    """C = alpha * op(A) @ op(B) in FP8 (C keeps A's leading dims in N* modes)."""
    C = scaled_product(quantized(state, A), quantized(state, B), transpose, float(alpha),
                       A.value.dtype, where)
    if transpose[0] == "N" and A.value.dim() > 2:
        C = C.view(*A.value.shape[:-1], C.shape[-1])
    return C


# (d_A, d_B) as (x, y, mode) products over (g, a, b) = (d_C, A, B): runtime/kernels/linalg.py
GRADIENTS = {"NN": ((0, 2, "NT"), (1, 0, "TN")), "NT": ((0, 2, "NN"), (0, 1, "TN")),
             "TN": ((2, 0, "NT"), (1, 0, "NN")), "TT": ((2, 0, "TT"), (0, 1, "TT"))}


def matmul_backward(state: ScaleState, d_C: Operand, A: Operand, B: Operand, *,
                    transpose: str = "NN", alpha: float = 1.0, wanted=(True, True),
                    where: str = "", **_) -> list:
    """(d_A, d_B) of C = alpha * op(A) @ op(B), each operand quantized once (the
    emulation quantizes all three), None for an unwanted gradient."""
    q = [quantized(state, o) for o in (d_C, A, B)]
    grads = []
    for want, (x, y, mode), like in zip(wanted, GRADIENTS[transpose], (A, B)):
        grads.append(None if not want else scaled_product(
            q[x], q[y], mode, float(alpha), d_C.value.dtype, where).view(like.value.shape))
    return grads
