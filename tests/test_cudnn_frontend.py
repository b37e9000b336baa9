"""The `cudnn_fe` attention backend (runtime/cuda/cudnn_frontend.py): cuDNN's fused attention
through the `nvidia-cudnn-frontend` package's graphs. CPU: what the backend does where the
package is missing or switched off, and the layouts it allocates. GPU (`-m cuda`, where the
package imports): the same bits as torch's cuDNN entry both ways, eager and in a captured
graph, and the step's default order taking it."""

from __future__ import annotations

import sys

import pytest
import torch

from runtime.cuda import cudnn_frontend
from runtime.cuda.cudnn_frontend import CudnnFrontend, like_layout


@pytest.fixture
def fresh_frontend():
    cudnn_frontend.frontend.cache_clear()
    yield
    cudnn_frontend.frontend.cache_clear()


def test_a_missing_package_leaves_the_backend_out_and_says_why(monkeypatch, fresh_frontend):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    assert cudnn_frontend.frontend() is None and not cudnn_frontend.enabled()
    assert "import of cudnn halted" in CudnnFrontend().unavailable
    q = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    assert not CudnnFrontend().covers(q, q, q, {"causal": True})


def test_the_switch_leaves_the_backend_out(monkeypatch):
    monkeypatch.setenv("MODULEC_CUDNN_FRONTEND", "0")
    assert not cudnn_frontend.enabled()


def test_the_default_order_tries_it_after_fa4_and_before_torchs_cudnn_entry():
    from runtime.cuda.attention import BACKENDS, DEFAULT_ORDER

    assert DEFAULT_ORDER.index("cudnn_fe") < DEFAULT_ORDER.index("cudnn")
    assert isinstance(BACKENDS["cudnn_fe"], CudnnFrontend)


@pytest.mark.parametrize("order", [(0, 2, 1, 3), (0, 1, 2, 3), (2, 0, 3, 1)])
def test_like_layout_keeps_the_stride_order_dense(order):
    base = torch.empty([(2, 3, 5, 8)[d] for d in order]).permute(
        [order.index(d) for d in range(4)])
    made = like_layout(base)
    assert made.shape == base.shape and made.stride() == base.stride()
    assert made.is_contiguous() == base.is_contiguous()


# ------------------------------------------------------------------------------ GPU
def _cuda_frontend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    if cudnn_frontend.frontend() is None:
        pytest.skip(f"nvidia-cudnn-frontend missing: {cudnn_frontend.frontend.unavailable}")


def _qkv(b, t, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return [x.transpose(1, 2) for x in qkv.split([hq, hkv, hkv], dim=2)]  # strided views


@pytest.mark.cuda
@pytest.mark.parametrize("b,t,hq,hkv,d,causal", [(1, 512, 32, 8, 128, True),
                                                 (2, 256, 8, 2, 64, True),
                                                 (2, 128, 4, 4, 128, False)])
def test_the_frontend_computes_torchs_cudnn_bits_both_ways(b, t, hq, hkv, d, causal):
    """Same kernels, same bits: out and lse, then d_q, d_k, d_v against torch's entry."""
    _cuda_frontend()
    from runtime.cuda.attention import BACKENDS

    q, k, v = _qkv(b, t, hq, hkv, d, seed=t + d)
    attrs = {"causal": causal, "softmax_scale": None, "window_size": None}
    fe, torch_entry = BACKENDS["cudnn_fe"], BACKENDS["cudnn"]
    assert fe.covers(q, k, v, attrs)
    out, lse = fe.forward(q, k, v, attrs)
    want_out, want_lse = torch_entry.forward(q, k, v, attrs)
    assert out.stride() == want_out.stride() and lse.shape == want_lse.shape
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    d_out = torch.randn_like(out)
    grads = fe.backward(d_out, q, k, v, out, lse, attrs)
    wanted = torch_entry.backward(d_out, q, k, v, want_out, want_lse, attrs)
    for got, want in zip(grads, wanted):  # laid as torch's too: RoPE's backward reads them
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_the_frontend_replays_in_a_captured_graph():
    """Built on the first eager call, executed on the capture's stream: a replay on new
    values gives what an eager call on them gives."""
    _cuda_frontend()
    from runtime.cuda.attention import BACKENDS

    fe = BACKENDS["cudnn_fe"]
    attrs = {"causal": True, "softmax_scale": None, "window_size": None}
    q, k, v = _qkv(1, 256, 8, 2, 128, seed=1)
    d_out = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        out, lse = fe.forward(q, k, v, attrs)
        return [out, lse, *fe.backward(d_out, q, k, v, out, lse, attrs)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = _qkv(1, 256, 8, 2, 128, seed=2)
    for into, value in zip((q, k, v), fresh):
        into.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_the_step_entry_runs_the_frontend_and_says_so():
    _cuda_frontend()
    from runtime.cuda.attention import DEFAULT_ORDER, FlashAttention, ran_note

    entry = FlashAttention(DEFAULT_ORDER)
    q, k, v = _qkv(1, 128, 4, 2, 128, seed=3)
    attrs = {"causal": True, "softmax_scale": None, "window_size": None}
    out, lse = entry.forward([q, k, v, None], attrs)
    entry.backward([torch.randn_like(out), q, k, v, out, lse, None], attrs)
    assert {(d, kernel) for d, kernel, _ in entry.ran} == {("forward", "cudnn_fe"),
                                                           ("backward", "cudnn_fe")}
    assert "cuDNN (frontend graphs)" in ran_note(entry.ran)
