"""mamba_conv1d and mamba_selective_scan on the GPU (csrc/kernels/mamba.cu through
runtime/cuda/mamba.py) against the reference loop (runtime/kernels/mamba.py) run in
float64 on the CPU from the same (rounded) inputs: forward and every gradient, fp32 and
bf16 I/O, odd T, T not a multiple of the 128-step tile or of the chunk, one and several
chunks, groups, incoming states. The CUDA tests are `-m cuda` (skipped without CUDA); the
last tests are CPU ones of the host side (the state tail, the fallback to the reference)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.mamba import MAMBA_KERNELS, conv_state_out  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

F64, BF16, F32 = torch.float64, torch.bfloat16, torch.float32
TOL = {F32: 1e-4, BF16: 2e-2}  # relative (norm) error of the kernel vs float64


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _compare(got: list, want: list, dtype, names, same_dtype=True):
    """Each output within TOL[dtype] of the float64 reference (and in `dtype` itself when
    same_dtype: every input was)."""
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.is_cuda and (g.dtype == dtype or not same_dtype), (name, g.dtype)
        assert torch.isfinite(g.float()).all(), f"{name}: not finite"
        err = _rel(g, w)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} ({dtype})"


def _round(tensors: list, dtype) -> list:
    """The inputs in `dtype` (None stays), and the same values in float64 on the CPU."""
    low = [None if t is None else t.to(dtype) for t in tensors]
    return low, [None if t is None else t.to(F64) for t in low]


# ------------------------------------------------------------------------- mamba_conv1d
def _conv_inputs(B, D, T, W, bias=True, state=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, T, generator=g)
    w = torch.randn(D, 1, W, generator=g) * 0.5
    b = torch.randn(D, generator=g) * 0.1 if bias else None
    s = torch.randn(B, D, W - 1, generator=g) if state else None
    return [x, w, b, s]


CONV_CASES = [  # (B, D, T, W, bias, state, activation)
    (2, 8, 37, 4, True, False, "silu"),
    (2, 8, 300, 4, True, True, "silu"),
    (1, 5, 1, 4, False, False, "silu"),
    (3, 4, 2, 4, True, True, "none"),
    (2, 6, 129, 3, False, True, "none"),
]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv1d_matches_the_reference(case, dtype):
    B, D, T, W, bias, state, act = case
    low, exact = _round(_conv_inputs(B, D, T, W, bias, state), dtype)
    attrs = dict(kernel_size=W, activation=act)
    on_gpu = [None if t is None else t.cuda() for t in low]
    ours = MAMBA_KERNELS["mamba_conv1d"].forward(on_gpu, dict(attrs))
    ref = KERNELS["mamba_conv1d"].forward(exact, dict(attrs))
    _compare(ours, ref, dtype, ["y", "conv_state_out"])
    d_y = torch.randn(B, D, T, generator=torch.Generator().manual_seed(9)).to(dtype)
    ours = MAMBA_KERNELS["mamba_conv1d"].backward([d_y.cuda(), *on_gpu], dict(attrs))
    ref = KERNELS["mamba_conv1d"].backward([d_y.to(F64), *exact], dict(attrs))
    _compare(ours, ref, dtype, ["d_x", "d_weight", "d_bias"])


# ----------------------------------------------------------------- mamba_selective_scan
def _scan_inputs(batch, ch, G, N, T, state=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, ch, T, generator=g)
    delta = torch.randn(batch, ch, T, generator=g) * 0.5 - 1.0
    A = -torch.arange(1, N + 1, dtype=F32).repeat(ch, 1) * (0.5 + torch.rand(ch, 1, generator=g))
    Bm = torch.randn(batch, G, N, T, generator=g)
    Cm = torch.randn(batch, G, N, T, generator=g)
    D = torch.randn(ch, generator=g)
    dt_bias = torch.randn(ch, generator=g) * 0.3
    s = torch.randn(batch, ch, N, generator=g) if state else None
    return [u, delta, A, Bm, Cm, D, dt_bias, s]


SCAN_CASES = [  # (batch, channels, G, N, T, chunk_size, state)
    (2, 8, 1, 4, 7, 256, False),       # T below one lane's share of a tile
    (2, 8, 2, 16, 300, 128, True),     # 3 tiles (the last partial), a chunk per tile
    (1, 16, 1, 16, 513, 256, False),   # 5 tiles, 2-tile chunks, the last chunk short
    (2, 12, 3, 5, 131, 4, True),       # chunk below a tile (one tile a chunk), 4 per group
    (1, 3, 1, 3, 1, 256, False),       # odd channels (one warp a block), T = 1
]
SCAN_GRADS = ["d_u", "d_delta", "d_A", "d_B", "d_C", "d_D", "d_dt_bias"]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", SCAN_CASES)
def test_selective_scan_matches_the_reference(case, dtype):
    batch, ch, G, N, T, chunk, state = case
    low, exact = _round(_scan_inputs(batch, ch, G, N, T, state), dtype)
    attrs = dict(chunk_size=chunk)
    on_gpu = [None if t is None else t.cuda() for t in low]
    ours = MAMBA_KERNELS["mamba_selective_scan"].forward(on_gpu, dict(attrs))
    ref = KERNELS["mamba_selective_scan"].forward(exact, dict(attrs))
    _compare(ours, ref, dtype, ["y", "ssm_state_out"])
    d_y = torch.randn(batch, ch, T, generator=torch.Generator().manual_seed(5)).to(dtype)
    ours = MAMBA_KERNELS["mamba_selective_scan"].backward([d_y.cuda(), *on_gpu], dict(attrs))
    ref = KERNELS["mamba_selective_scan"].backward([d_y.to(F64), *exact], dict(attrs))
    _compare(ours, ref, dtype, SCAN_GRADS)


@needs_gpus(1)
def test_the_gpu_registries_run_the_kernels_with_fp32_parameters_and_strided_delta():
    """CUDA_KERNELS / TRAIN_KERNELS hold these entries; bf16 activations with fp32 A, D,
    dt_bias (a parameter held in fp32) and a transposed delta still take the kernel, and
    the gradients come back in each input's dtype."""
    from runtime.cuda.kernels import CUDA_KERNELS
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    kernel = TRAIN_KERNELS["mamba_selective_scan"]
    assert kernel is CUDA_KERNELS["mamba_selective_scan"] is MAMBA_KERNELS["mamba_selective_scan"]
    u, delta, A, Bm, Cm, D, dt_bias, _ = _scan_inputs(2, 8, 1, 16, 200)
    delta_t = delta.to(BF16).cuda().transpose(1, 2).contiguous().transpose(1, 2)  # strided
    inputs = [u.to(BF16).cuda(), delta_t, A.cuda(), Bm.to(BF16).cuda(), Cm.to(BF16).cuda(),
              D.cuda(), dt_bias.cuda(), None]
    assert kernel._covers(*inputs)
    exact = [None if t is None else t.double().cpu() for t in inputs]
    _compare(kernel.forward(inputs, {}), KERNELS["mamba_selective_scan"].forward(exact, {}),
             BF16, ["y", "ssm_state_out"], same_dtype=False)
    d_y = torch.randn(2, 8, 200, dtype=BF16, device="cuda")
    grads = kernel.backward([d_y, *inputs], {"chunk_size": 256})
    assert [g.dtype for g in grads] == [BF16, BF16, F32, BF16, BF16, F32, F32]
    _compare(grads, KERNELS["mamba_selective_scan"].backward([d_y.double().cpu(), *exact], {}),
             BF16, SCAN_GRADS, same_dtype=False)


# ------------------------------------------------------------------ host side (CPU tests)
@pytest.mark.parametrize("T,W,state", [(10, 4, False), (2, 4, True), (1, 4, False),
                                       (5, 1, False), (3, 3, True)])
def test_conv_state_out_is_the_padded_input_tail(T, W, state):
    x, _, _, s = _conv_inputs(2, 3, T, W, state=state)
    pad = s if s is not None else torch.zeros(2, 3, W - 1)
    want = torch.cat([pad, x], -1)[..., T:]
    got = conv_state_out(x, s, W)
    assert got.shape == (2, 3, W - 1) and torch.equal(got, want)


def test_calls_the_kernels_do_not_cover_run_the_reference():
    """CPU tensors (and float64, a kernel wider than 8) go to the reference loop: the same
    results as calling it."""
    conv = MAMBA_KERNELS["mamba_conv1d"]
    inputs = _conv_inputs(2, 4, 9, 4, state=True)
    attrs = dict(kernel_size=4, activation="silu")
    want = KERNELS["mamba_conv1d"].forward(inputs, dict(attrs))
    for a, b in zip(conv.forward(inputs, dict(attrs)), want):
        assert torch.equal(a, b)
    assert not conv._covers(*[t.double() for t in inputs], attrs)
    wide = _conv_inputs(1, 2, 5, 9)
    assert not conv._covers(*wide, dict(kernel_size=9))
    scan = MAMBA_KERNELS["mamba_selective_scan"]
    inputs = _scan_inputs(1, 4, 2, 3, 6, state=True)
    d_y = torch.randn(1, 4, 6)
    for a, b in zip(scan.backward([d_y, *inputs], {}),
                    KERNELS["mamba_selective_scan"].backward([d_y, *inputs], {})):
        assert torch.equal(a, b)
    assert not scan._covers(*inputs)  # on the CPU
