"""grouped_gemm on the GPU without a host sync: `torch._grouped_mm` (CUTLASS's grouped
GEMM, bf16 on sm90) reads the group boundaries on the device, so a step with MoE experts
is captured in one CUDA graph. The reference kernel (runtime/kernels/linalg.py) loops
over the groups in Python and reads `offsets` back to the host (`offsets.tolist()`).

The products, by mode (weights NT: [G, N, K], NN: [G, K, N]; `ends` = offsets[1:], the
cumulative group ends `torch._grouped_mm` takes):

    forward   y = x @ W[g]^T (NT)            _grouped_mm(x, W.transpose(1, 2), ends)
              y = x @ W[g]   (NN)            _grouped_mm(x, W, ends)
    d_input   d_x = d_y @ W[g]   (NT)        _grouped_mm(d_y, W, ends)
              d_x = d_y @ W[g]^T (NN)        _grouped_mm(d_y, W.transpose(1, 2), ends)
    d_weights d_W[g] = d_y_g^T @ x_g (NT)    _grouped_mm(d_y.t(), x, ends)    2-D x 2-D,
              d_W[g] = x_g^T @ d_y_g (NN)    _grouped_mm(x.t(), d_y, ends)    ragged K

An expert with no rows gets zero output rows (none) and a zero weight gradient (a
2-D x 2-D group with K = 0; tests/test_cuda_grouped_gemm.py checks it on memory filled
with NaN first).

What the GPU path assumes that the reference does not: `offsets[0] == 0` and
`offsets[-1] == rows` (every row in a group), which is what moe_compute_offsets makes
(it counts all N * top_k assignments). `torch._grouped_mm` leaves rows outside the groups
unwritten where the reference zeroes them; the forward checks the assumption on the
device (`torch._assert_async`, no host read).

Calls it does not cover go to the reference kernel: tensors not on CUDA, dtypes other
than bf16 (torch's fp32 path loops on the host as the reference does), devices other
than sm90 (the fast path is sm90 / sm100, and sm100's empty groups get non-zero weight
gradients, pytorch#172439), K or N not a multiple of 8 (16-byte rows for TMA), 1024
groups or more, a torch without `_grouped_mm`. Such a call while a CUDA graph is being
captured is refused by name (RuntimeUserError) instead of failing on the loop's host read.
"""

from __future__ import annotations

import functools

import torch

from runtime.kernels import KERNELS

MAX_GROUPS = 1024  # torch._grouped_mm's limit (one thread per group sets up the problems)


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def device_covered(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped GEMMs of `dtype` on `device` take the sync-free path."""
    return (available() and dtype == torch.bfloat16 and device.type == "cuda"
            and _sm90(device.index if device.index is not None
                      else torch.cuda.current_device()))


def shapes_covered(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> bool:
    """The shapes and dtypes `torch._grouped_mm` takes, device aside."""
    return (isinstance(rows, torch.Tensor) and isinstance(weights, torch.Tensor)
            and isinstance(offsets, torch.Tensor) and rows.dim() == 2 and weights.dim() == 3
            and rows.dtype == weights.dtype and offsets.dtype == torch.int32
            and offsets.dim() == 1 and offsets.numel() == weights.shape[0] + 1
            and 0 < weights.shape[0] < MAX_GROUPS
            and weights.shape[1] % 8 == 0 and weights.shape[2] % 8 == 0
            and rows.device == weights.device == offsets.device)


def covered(rows, weights, offsets, *more) -> bool:
    return (shapes_covered(rows, weights, offsets)
            and all(isinstance(m, torch.Tensor) and m.dtype == rows.dtype
                    and m.device == rows.device for m in more)
            and device_covered(rows.device, rows.dtype))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous rows at a 16-byte boundary (TMA's requirement)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def forward(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
            transpose: str = "NT", check: bool = True) -> torch.Tensor:
    """y = x_g @ op(W[g]) for each group g of rows (module docstring's table)."""
    if check:  # every row in a group: on the device, no host read
        torch._assert_async(offsets[0].eq(0) & offsets[-1].eq(x.shape[0]),
                            "grouped_gemm: offsets must run from 0 to the row count")
    w = _aligned(weights)
    return torch._grouped_mm(_aligned(x), w.transpose(1, 2) if transpose == "NT" else w,
                             offs=offsets[1:])


def backward(d_y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
             offsets: torch.Tensor, transpose: str = "NT") -> tuple:
    """(d_x, d_W) of `forward` (module docstring's table)."""
    ends, d_y, x, w = offsets[1:], _aligned(d_y), _aligned(x), _aligned(weights)
    d_x = torch._grouped_mm(d_y, w if transpose == "NT" else w.transpose(1, 2), offs=ends)
    if transpose == "NT":
        d_w = torch._grouped_mm(d_y.t(), x, offs=ends)
    else:
        d_w = torch._grouped_mm(x.t(), d_y, offs=ends)
    return d_x, d_w


class GroupedGemm:
    """The registry's grouped_gemm on the GPU: `forward` / `backward` above where
    `covered`, the reference kernel otherwise. `allocates_outputs`: `_grouped_mm` has no
    `out=`, so on the arena a transient result (the backward's d_input) stays where the
    kernel made it instead of being copied into its planned bytes (runtime/interpreter.py
    `place`, as cuDNN attention's); saved ones are still copied into their records."""

    allocates_outputs = True

    def __init__(self):
        self.reference = KERNELS["grouped_gemm"]

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        x, weights, offsets = inputs
        if not covered(x, weights, offsets):
            _refuse_capture(x)
            return self.reference.forward(inputs, attrs)
        return [forward(x, weights, offsets, attrs.get("transpose", "NT"))]

    def backward(self, inputs: list, attrs: dict) -> list:
        d_y, x, weights, offsets = inputs
        if not covered(x, weights, offsets, d_y):
            _refuse_capture(x)
            return self.reference.backward(inputs, attrs)
        return list(backward(d_y, x, weights, offsets, attrs.get("transpose", "NT")))


def _refuse_capture(x) -> None:
    """The reference's loop reads the offsets back to the host: not inside a capture."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda
            and torch.cuda.is_current_stream_capturing()):
        return
    from runtime.errors import RuntimeUserError

    # no device query here: a capture may refuse API calls beyond the stream's work
    raise RuntimeUserError(
        f"grouped_gemm (the MoE experts) in {x.dtype} runs here as a loop over the experts "
        "that reads their sizes back to the host, which a CUDA graph cannot capture",
        help=["the captured path is one grouped GEMM: bf16 on an sm90 GPU (H100, H200), "
              "K and N multiples of 8", "or run the step eagerly (without capture())"])
