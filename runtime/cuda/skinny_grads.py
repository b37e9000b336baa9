"""Both gradients of a skinny NT matmul in one pass over d_C (csrc/kernels/skinny_grads.cu).

C = alpha A B^T with A [T, R] and R at most 64 is LoRA's delta (h, the rank-wide
x A^T, against the block-diagonal B) and other rank-wide products. Its backward is two
thin GEMMs, d_A = alpha d_C B and d_B = alpha d_C^T A, each reading all of d_C, the
largest operand by far, and each too thin for cuBLAS to reach the card's bandwidth (one
H100, LoRA 8B's gate/up at T=2048: 54 + 51 us for 117 MB read twice;
benchmarks/kernels/bench_skinny_grads.py). The kernel reads d_C once.

`skinny_nt_backward` returns [d_A, d_B] where the kernel covers the call, else None (the
caller runs its two GEMMs): bf16 CUDA tensors, T a multiple of 256, N of 128, R one of
16, 32, 48, 64, d_C's and A's rows 16-byte aligned (A's may lie apart), B contiguous, a
card of compute capability 8.0 or newer (bf16 mma.sync), and MODULEC_SKINNY_GRADS not 0.

Where the kernel's CTAs meet (`_work`): each stores its own part of the sums in a
workspace kept per problem (`partials`: no atomics, the same bits every run), up to
PARTIALS_MAX_BYTES of it (it grows with T: 19 MB at LoRA 8B's gate/up, T=2048); above
that, or with MODULEC_SKINNY_PARTIALS=0, fp32 sums added into through atomics, whose
order varies: those calls are not taken under torch's deterministic mode.
"""

from __future__ import annotations

import os

import torch

from runtime.cuda.kernels import rows_apart

RANKS = (16, 32, 48, 64)
ROWS, COLS = 256, 128  # the multiples of T and N the kernel needs (skinny_grads.cu)
PARTIALS_MAX_BYTES = 64 << 20  # the most a problem's partials may keep (else the sums)


def covers(d_C, A, B) -> bool:
    if os.environ.get("MODULEC_SKINNY_GRADS", "1") == "0":
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.bfloat16
               and t.dim() == 2 for t in (d_C, A, B)):
        return False
    rows, cols = d_C.shape
    return A.shape[1] in RANKS and tuple(A.shape) == (rows, A.shape[1]) \
        and tuple(B.shape) == (cols, A.shape[1]) and rows % ROWS == 0 and cols % COLS == 0 \
        and _rows_aligned(A) and B.is_contiguous() and d_C.stride(1) == 1 \
        and d_C.stride(0) % 8 == 0 and d_C.data_ptr() % 16 == 0 \
        and A.data_ptr() % 16 == 0 and B.data_ptr() % 16 == 0 \
        and A.device == B.device == d_C.device \
        and torch.cuda.get_device_capability(d_C.device)[0] >= 8  # bf16 mma.sync


def skinny_nt_backward(d_C, A, B, alpha: float = 1.0, out=None, blocks=None,
                       compact: bool = False) -> list | None:
    """[d_A, d_B] of C = alpha A B^T (2-D), or None where the kernel does not cover them;
    `out`: typed tensors for (d_A, d_B) to write into, or None each: contiguous, or for
    d_A rows apart (d_t written beside d_y in the one-GEMM d_x's scratch,
    runtime/cuda/lora_kcat.py). `blocks`: where B is block-diagonal with blocks 16 wide
    (LoRA's B of a fused projection, made by block_diag), each block's last row + 1; the
    kernel then sums each chunk of d_C against its own block alone (`block_ends`) and
    writes d_B's diagonal blocks only (block_diag's backward reads no other). `compact`:
    where the kernel sums blocks, d_B comes back [N, 16], each row its own block's columns
    (the blocks' gradients stacked: the step's interpreter hands its row ranges to the
    parts as their gradients, no block_diag backward); else d_B as B is."""
    if not covers(d_C, A, B):
        return None
    from runtime.cuda.build import load

    d_a, d_b = out or (None, None)
    targets = [d_a if d_a is not None and (d_a.is_contiguous() or rows_apart(d_a)) else None,
               d_b if d_b is not None and d_b.is_contiguous() else None]
    ends = block_ends(blocks, B)
    work, partials = _work(d_C.device, d_C.shape[0], d_C.shape[1], A.shape[1], ends)
    if work is None:
        return None
    compact = compact and bool(ends)
    if compact:
        targets[1] = None
    return list(load().skinny_nt_backward(d_C, A, B, float(alpha), work, partials, targets,
                                          ends, compact))


def _rows_aligned(t) -> bool:
    """Rows a multiple of 16 bytes apart, contiguous or not: A may be t = x A^T written
    into x's spare columns (runtime/cuda/lora_kcat.py `t_beside_x`)."""
    return rows_apart(t) and t.stride(0) % 8 == 0


def block_ends(blocks, B) -> list[int]:
    """The kernel's blocks for a block-diagonal B whose blocks have `blocks` rows each (all
    16 wide, B = block_diag of them: no zero rows): their row ends, where there are two to
    four of them and each ends on a multiple of COLS, else [] (B summed as dense, its zero
    blocks included: the same gradients, more work). MODULEC_SKINNY_BLOCKS=0: [] (A/B)."""
    if not blocks or os.environ.get("MODULEC_SKINNY_BLOCKS", "1") == "0":
        return []
    ends = [sum(blocks[:i + 1]) for i in range(len(blocks))]
    if not 2 <= len(blocks) <= 4 or B.shape[1] != 16 * len(blocks) or ends[-1] != B.shape[0] \
            or any(end % COLS for end in ends):
        return []
    return ends


# (device, stream, T, N, R, B blocked, partials wanted) -> (work, partials)
_work_kept: dict[tuple, tuple] = {}


def _work(device, rows: int, cols: int, rank: int, ends: list[int]) -> tuple:
    """The problem's fp32 workspace and whether it holds the CTAs' partials (else the sums,
    zero: the kernel leaves them zero after each call), one per stream, kept for the
    process; (None, False) where only the sums would do and torch's deterministic mode is
    on (their atomics' order varies). `ends`: B's blocks (`block_ends`), or []."""
    from runtime.cuda.build import load

    wanted = os.environ.get("MODULEC_SKINNY_PARTIALS", "1") != "0"
    key = (device.index, torch.cuda.current_stream(device).cuda_stream, rows, cols, rank,
           bool(ends), wanted)  # the partials' size: blocked or not, whichever the blocks
    if key not in _work_kept:
        with torch.cuda.device(device):  # the kernel's grid: this device's multiprocessors
            floats = load().skinny_partial_floats(rows, cols, rank, ends)
        partials = wanted and floats * 4 <= PARTIALS_MAX_BYTES
        # the partials are written before they are read: no zeros, whose fill a capture
        # would record and every replay would run (the sums start at zero and stay so)
        make = torch.empty if partials else torch.zeros
        size = floats if partials else (rows + cols) * rank
        _work_kept[key] = (make(size, device=device, dtype=torch.float32), partials)
    work, partials = _work_kept[key]
    if not partials and torch.are_deterministic_algorithms_enabled():
        return None, False
    return work, partials
