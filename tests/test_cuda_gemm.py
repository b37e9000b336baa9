"""runtime/cuda/gemm.py: the step's GEMMs with a measured cuBLASLt algorithm.

Without a GPU: `mm_into` is torch's mm / addmm (alpha, beta) on CPU tensors and times
nothing; the tuning's choice (cuBLASLt faked) is the fastest candidate that runs. On a GPU (`-m cuda`): every candidate cuBLASLt offers for the step's kinds of
GEMM (the three transpose modes, beta 0 and 1, alpha, strided operands and outputs, bf16
and fp16) computes the product torch does; `mm_into` keeps a choice per problem and
leaves out's old values where beta reads them; a problem first met during a CUDA graph's
capture runs torch's call and is not timed; MODULEC_GEMM_TUNE=0 times nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import runtime.cuda.gemm as gemm  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402


def test_cpu_mm_into_is_torch_alpha_beta():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=g), torch.randn(3, 4, generator=g)
    out = torch.randn(5, 4, generator=g)
    before = gemm.choices()
    expect = 0.5 * a @ b + out
    assert gemm.mm_into(a, b, out, 0.5, beta=1.0) is out
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(gemm.mm_into(a, b, torch.full((5, 4), float("nan"))), a @ b)
    assert gemm.choices() == before  # CPU tensors: nothing timed


def test_tuning_keeps_the_fastest_candidate_that_runs(monkeypatch):
    """The choice logic on the CPU: cuBLASLt offers 3 candidates, #1 fails to run and
    would be fastest, #2 is faster than torch's call: #2 is kept; with beta the old
    output is put back after the timing runs."""
    import runtime.cuda.build as build

    class Offers:
        def gemm_candidates(self, a, b, out, reads_out, count):
            return 3

    ran = []

    def lt(a, b, out, alpha, beta, index):
        if index == 1:
            raise RuntimeError("cuBLASLt matmul failed")
        ran.append(index)
        out.add_(1.0)  # the timing runs' sums, to be undone

    monkeypatch.setattr(build, "load", lambda: Offers())
    monkeypatch.setattr(gemm, "_lt", lt)
    monkeypatch.setattr(gemm, "_median_times", lambda runs: [(run(), ms)[1] for run, ms
                                                             in zip(runs, [2.0, 3.0, 1.0])])
    a, b, out = torch.ones(4, 3), torch.ones(3, 5), torch.zeros(4, 5)
    key = ("test", 4, 3, 5)
    assert gemm._tune(key, a, b, out, beta=1.0) == 2
    assert gemm.choices()[key] == 2 and gemm._timings[key] == [2.0, 3.0, 1.0]
    assert 1 not in ran
    torch.testing.assert_close(out, torch.zeros(4, 5))
    del gemm._choices[key], gemm._timings[key]


def _operand(rows: int, cols: int, transposed: bool, dtype, pad: int = 0):
    """A rows x cols view: row-major (a wider buffer's first `cols` columns when pad > 0)
    or, `transposed`, the transpose of a cols x rows matrix."""
    if transposed:
        return torch.randn(cols, rows + pad, device="cuda", dtype=dtype)[:, :rows].t()
    return torch.randn(rows, cols + pad, device="cuda", dtype=dtype)[:, :cols]


def _expected(a, b, out, alpha, beta):
    return alpha * (a.float() @ b.float()) + beta * out.float()


def _close(got, expect, tol=1e-2):
    err = (got.float() - expect).abs().max() / expect.abs().max()
    assert err <= tol, f"relative error {err:.2e}"


CASES = [  # (M, N, K, a transposed, b transposed, beta, alpha, pad, dtype)
    (256, 384, 512, False, True, 0.0, 1.0, 0, torch.bfloat16),   # y = x W^T
    (256, 512, 384, False, False, 1.0, 1.0, 0, torch.bfloat16),  # d_x += d_y W (LoRA)
    (384, 512, 256, True, False, 0.0, 0.5, 0, torch.bfloat16),   # d_W = d_y^T x, alpha
    (200, 48, 512, False, True, 0.0, 2.0, 8, torch.bfloat16),    # x A^T, strided rows
    (256, 320, 48, False, True, 1.0, 2.0, 0, torch.float16),     # base + s t B^T
]


@needs_gpus(1)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}")
def test_every_candidate_computes_the_product(case):
    M, N, K, ta, tb, beta, alpha, pad, dtype = case
    torch.manual_seed(0)
    a, b = _operand(M, K, ta, dtype, pad), _operand(K, N, tb, dtype)
    wide = torch.randn(M, N + pad, device="cuda", dtype=dtype)
    out = wide[:, :N]
    start, padding = out.clone(), wide[:, N:].clone()
    from runtime.cuda.build import load

    found = load().gemm_candidates(a, b, out, beta != 0.0, gemm.TUNE_CANDIDATES)
    assert found >= 1
    expect = _expected(a, b, start, alpha, beta)
    for index in range(found):
        out.copy_(start)
        load().gemm_run(a, b, out, alpha, beta, gemm.TUNE_CANDIDATES, index)
        _close(out, expect)
    assert torch.equal(wide[:, N:], padding)  # no candidate wrote past out's columns


@needs_gpus(1)
def test_mm_into_keeps_a_choice_and_reads_old_out():
    torch.manual_seed(1)
    a, b = _operand(512, 256, False, torch.bfloat16), _operand(256, 768, True, torch.bfloat16)
    out = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    expect = _expected(a, b, out, 0.25, 1.0)
    before = len(gemm.choices())
    assert gemm.mm_into(a, b, out, 0.25, beta=1.0) is out
    _close(out, expect)  # the timing runs did not leave their sums behind
    assert len(gemm.choices()) == before + 1
    again = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    expect = _expected(a, b, again, 0.25, 1.0)
    gemm.mm_into(a, b, again, 0.25, beta=1.0)  # same problem: the kept choice
    _close(again, expect)
    assert len(gemm.choices()) == before + 1
    assert "problems timed" in gemm.summary()


@needs_gpus(1)
def test_capture_replays_the_choice_and_times_nothing_new():
    torch.manual_seed(2)
    a, b = _operand(256, 512, False, torch.bfloat16), _operand(512, 640, True, torch.bfloat16)
    c = _operand(640, 128, False, torch.bfloat16)
    y = torch.empty(256, 640, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
    gemm.mm_into(a, b, y)  # timed eagerly
    known = gemm.choices()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm.mm_into(a, b, y)  # as a step's warm-up runs before its capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        gemm.mm_into(a, b, y)
        gemm.mm_into(y, c, z)  # first met in capture: torch's call, nothing timed
    assert gemm.choices() == known
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    _close(y, a.float() @ b.float())
    _close(z, y.float() @ c.float())


@needs_gpus(1)
def test_tuning_off_times_nothing(monkeypatch):
    monkeypatch.setenv("MODULEC_GEMM_TUNE", "0")
    a, b = _operand(128, 96, False, torch.bfloat16), _operand(96, 160, False, torch.bfloat16)
    out = torch.empty(128, 160, device="cuda", dtype=torch.bfloat16)
    before = gemm.choices()
    gemm.mm_into(a, b, out)
    assert gemm.choices() == before
    _close(out, a.float() @ b.float())
