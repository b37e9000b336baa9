"""The fused cross-entropy kernel (csrc/kernels/cross_entropy.cu) and the chunked LM head
that uses it (runtime/cuda/lm_head.py). On a GPU (`-m cuda`): the kernel against the torch
path `_chunk` (fp32 on the same logits, upcast) in bf16, fp16 and fp32, on rows of odd
lengths (unaligned rows, head and tail logits), rows longer than the register cache,
large logits, ignored and out-of-range labels, under CUDA-graph replay; then
lm_head_cross_entropy and logits_cross_entropy with the kernel against their torch path.
Without CUDA: the torch path still serves CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import runtime.cuda.lm_head as lm_head  # noqa: E402
from runtime.cuda.lm_head import (_add_head_grad, _chunk, _kernel_for,  # noqa: E402
                                  lm_head_cross_entropy, logits_cross_entropy, reference_loss)
from tests.dist_testing import needs_gpus  # noqa: E402

IGNORE = -100
# |kernel - reference| <= RTOL * |reference| + ATOL * scale: the gradient is rounded to the
# logits' dtype once (bf16: half an ulp is 2^-9), the fp32 arithmetic differs in the order
# of the sums; ATOL covers p - 1 on a label whose p is ~1 (a few fp32 ulps of 1)
RTOL = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10, torch.float32: 1e-5}
ATOL = 1e-6
FP16_TINY = 6e-8  # fp16's smallest subnormal: smaller gradients round to 0 or to it


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ------------------------------------------------------------------ without a GPU
def test_the_kernel_takes_cuda_logits_only():
    assert _kernel_for(torch.zeros(2, 8)) is None
    assert _kernel_for(torch.zeros(2, 8, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_cross_entropy_on_cpu_tensors(dtype):
    """The torch path (`_chunk`) serves CPU tensors of the model's dtype, in chunks."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 16, generator=g).to(dtype)
    w = torch.randn(37, 16, generator=g).to(dtype)
    labels = torch.randint(0, 37, (10,), generator=g)
    labels[::4] = IGNORE
    loss, d_x, d_w = lm_head_cross_entropy(x, w, labels, chunk_rows=4)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    expected = reference_loss(xr @ wr.t(), labels)
    expected.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert d_x.dtype == dtype and d_w.dtype == torch.float32
    assert abs(float(loss) - expected.item()) <= tol * expected.item()
    assert _rel(d_x, xr.grad) < tol and _rel(d_w, wr.grad) < tol


def test_head_grad_accumulates_on_cpu():
    g = torch.Generator().manual_seed(4)
    d_w = torch.randn(9, 5, generator=g)
    grad, rows = torch.randn(6, 9, generator=g), torch.randn(6, 5, generator=g)
    want = d_w.double() + grad.double().t() @ rows.double()
    _add_head_grad(d_w, grad, rows)
    assert _rel(d_w, want) < 1e-6


# ----------------------------------------------------------------------- on a GPU
def _logits(rows, V, dtype, magnitude, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, V, device="cuda", generator=g) * magnitude).to(dtype)
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
    labels[0] = V - 1  # the row's last logit: a tail logit where V is not a whole vector
    if rows > 2:
        labels[2] = 0  # the first: a head logit where the row starts off 16 bytes
    labels[1::3] = IGNORE
    return x, labels


def _reference(x, labels, scale=None):
    """(loss per row, d_logits fp32, summed loss, scale) from the torch path on x upcast;
    scale: 1 / n unless given."""
    keep = labels != IGNORE
    inv_n = 1.0 / keep.sum().clamp(min=1).to(torch.float32) if scale is None else scale
    xf = x.float()
    target = torch.where(keep, labels, 0)[:, None]
    per_row = (torch.logsumexp(xf, -1) - xf.gather(1, target)[:, 0]) * keep
    total = torch.zeros((), device="cuda")
    grad = _chunk(xf.clone(), labels, keep, inv_n, total)
    return per_row, grad, total, inv_n


def _check_grad(got, want, dtype, scale, rtol=None):
    atol = ATOL * scale + (FP16_TINY if dtype == torch.float16 else 0.0)
    err = (got.float() - want).abs() - (rtol or RTOL[dtype]) * want.abs()
    worst = float(err.max())
    assert worst <= atol, f"gradient off by {worst:.3g} beyond tolerance (atol {atol:.3g})"


def _ext():
    ext = lm_head._extension()
    assert ext is not None, "the CUDA extension did not build"
    return ext


@needs_gpus(1)
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("V", [7, 1000, 32001, 50257, 128257])
def test_cross_entropy_kernel_matches_the_torch_path(V, rows, dtype, magnitude):
    """V=7: a row of head/tail logits only; 1000: whole vectors; 32001: every other row
    off a 16-byte boundary; 50257 and 128257 (and 32001 in fp32): rows past the register
    cache, streamed a few loads at a time (128257: past the last batch's end too)."""
    x, labels = _logits(rows, V, dtype, magnitude, seed=V + rows)
    per_row, want, total, inv_n = _reference(x, labels)
    d = x.clone()
    losses = _ext().cross_entropy_(d, labels, inv_n, IGNORE)
    assert losses.dtype == torch.float32 and losses.shape == (rows,)
    assert torch.all((losses - per_row).abs() <= 1e-3 * per_row.abs().clamp(min=1.0))
    assert abs(float(losses.sum()) - float(total)) <= 1e-4 * max(float(total), 1.0)
    ignored = labels == IGNORE
    assert torch.all(losses[ignored] == 0) and torch.all(d[ignored] == 0)
    _check_grad(d, want, dtype, float(inv_n))


@needs_gpus(1)
def test_cross_entropy_kernel_with_every_row_ignored():
    x = torch.randn(5, 300, device="cuda", dtype=torch.bfloat16)
    labels = torch.full((5,), IGNORE, device="cuda")
    losses = _ext().cross_entropy_(x, labels, torch.ones((), device="cuda"), IGNORE)
    assert torch.all(losses == 0) and torch.all(x == 0)


@needs_gpus(1)
def test_cross_entropy_kernel_out_of_range_labels_read_nothing():
    """A label outside [0, V) (not ignore_index) gives a NaN loss, no one-hot term, and no
    memory error."""
    V = 1001
    x = torch.randn(3, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.tensor([V, -5, 4], device="cuda")
    scale = torch.full((), 0.25, device="cuda")
    d = x.clone()
    losses = _ext().cross_entropy_(d, labels, scale, IGNORE)
    torch.cuda.synchronize()
    assert torch.isnan(losses[:2]).all() and torch.isfinite(losses[2])
    softmax = torch.softmax(x.float(), -1) * 0.25
    _check_grad(d[:2], softmax[:2], torch.bfloat16, 0.25)


@needs_gpus(1)
def test_cross_entropy_kernel_is_deterministic():
    x, labels = _logits(64, 32001, torch.bfloat16, 4.0, seed=5)
    scale = torch.full((), 1 / 40, device="cuda")
    a, b = x.clone(), x.clone()
    la = _ext().cross_entropy_(a, labels, scale, IGNORE)
    lb = _ext().cross_entropy_(b, labels, scale, IGNORE)
    assert torch.equal(la, lb) and torch.equal(a, b)


@needs_gpus(1)
def test_cross_entropy_kernel_replays_in_a_cuda_graph_with_the_scale_read_on_device():
    ext = _ext()
    x, labels = _logits(16, 4099, torch.bfloat16, 2.0, seed=6)
    scale = torch.full((), 1.0, device="cuda")
    d = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ext.cross_entropy_(d, labels, scale, IGNORE)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        losses = ext.cross_entropy_(d, labels, scale, IGNORE)
    d.copy_(x)
    scale.fill_(0.125)
    graph.replay()
    per_row, want, _, _ = _reference(x, labels, scale)
    torch.cuda.synchronize()
    assert torch.all((losses - per_row).abs() <= 1e-3 * per_row.abs().clamp(min=1.0))
    _check_grad(d, want, torch.bfloat16, 0.125)


def _no_kernel(monkeypatch):
    monkeypatch.setattr(lm_head, "_kernel_for", lambda logits: None)


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,V,chunk", [(300, 1000, 128), (130, 32001, 64), (64, 50257, 2048)])
def test_lm_head_cross_entropy_with_the_kernel_matches_the_torch_path(rows, V, chunk, dtype,
                                                                      monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 64, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, 64, device="cuda", generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
    labels[::5] = IGNORE
    assert _kernel_for(x @ w[:8].t()) is not None, "the kernel does not take these logits"
    loss, d_x, d_w = lm_head_cross_entropy(x, w, labels, chunk)
    frozen = lm_head_cross_entropy(x, w, labels, chunk, head_grad=False)
    with monkeypatch.context() as m:
        _no_kernel(m)
        ref_loss, ref_d_x, ref_d_w = lm_head_cross_entropy(x, w, labels, chunk)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert d_x.dtype == dtype and d_w.dtype == torch.float32
    assert abs(float(loss) - float(ref_loss)) <= 1e-3 * float(ref_loss)
    assert _rel(d_x, ref_d_x) < tol and _rel(d_w, ref_d_w) < tol
    assert frozen[2] is None and torch.equal(frozen[0], loss) and torch.equal(frozen[1], d_x)


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_cross_entropy_with_the_kernel_matches_the_torch_path(dtype, monkeypatch):
    x, labels = _logits(96, 32001, dtype, 3.0, seed=7)
    logits, before = x.reshape(4, 24, -1), x.clone()
    loss, d_logits = logits_cross_entropy(logits, labels.reshape(4, 24), chunk_rows=40)
    assert torch.equal(x, before), "the logits were overwritten"
    with monkeypatch.context() as m:
        _no_kernel(m)
        ref_loss, ref_d = logits_cross_entropy(logits, labels.reshape(4, 24), chunk_rows=40)
    assert d_logits.shape == logits.shape and d_logits.dtype == dtype
    assert abs(float(loss) - float(ref_loss)) <= 1e-4 * float(ref_loss)
    # both rounded to the dtype: one ulp apart where the fp32 values straddle a rounding
    keep = labels != IGNORE
    _check_grad(d_logits.reshape(96, -1), ref_d.reshape(96, -1).float(), dtype,
                1.0 / float(keep.sum()), rtol=2 * RTOL[dtype])


@needs_gpus(1)
def test_head_grad_accumulates_bf16_operands_into_fp32():
    """Either CUDA path of `_add_head_grad` (addmm with out_dtype=fp32, or the bf16 product
    added) against float64."""
    g = torch.Generator(device="cuda").manual_seed(8)
    d_w = torch.randn(1000, 64, device="cuda", generator=g)
    grad = (torch.randn(256, 1000, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    rows = torch.randn(256, 64, device="cuda", generator=g).to(torch.bfloat16)
    want = d_w.double() + grad.double().t() @ rows.double()
    _add_head_grad(d_w, grad, rows)
    assert d_w.dtype == torch.float32 and _rel(d_w, want) < 1e-3
