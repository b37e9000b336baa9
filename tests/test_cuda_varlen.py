"""FlashAttention-2 over packed documents (runtime/cuda/varlen.py): cu_seqlens from a
packed batch's positions (CPU), and on a GPU (`-m cuda`) the varlen forward and backward
against the reference kernel masked to the same documents (float64 on the CPU), and the
GPU step's form of the call (cu_seqlens padded with empty documents, max_seqlen T: the
step's static buffers, runtime/cuda/packed.py) against the exact one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.varlen import cu_seqlens  # noqa: E402
from runtime.train.packing import Packing, split_batch  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402



def test_cu_seqlens_are_the_documents_of_every_row_in_order():
    window = torch.tensor([[5, 6, 1, 7, 1, 8, 9, 10, 1],
                           [1, 3, 4, 5, 6, 7, 8, 9, 2]])
    _, _, documents = split_batch(window, Packing(1))
    cu, longest = cu_seqlens(documents.positions)
    assert cu.tolist() == [0, 3, 5, 8, 9, 16] and cu.dtype == torch.int32
    assert longest == 7


def _packed(B, T, generator):
    """A [B, T+1] window of documents of 1..40 tokens separated by id 1."""
    ids = torch.randint(2, 50, (B, T + 1), generator=generator)
    ends = torch.rand(B, T + 1, generator=generator) < 1 / 20
    return split_batch(ids.masked_fill(ends, 1), Packing(1))[2]


@needs_gpus(1)
@pytest.mark.parametrize("window", [None, 16])
def test_varlen_attention_matches_the_masked_reference(window):
    from runtime.cuda.varlen import varlen_backward, varlen_forward
    from runtime.kernels import KERNELS
    from runtime.kernels.documents import packed

    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hk, D = 2, 128, 4, 2, 64
    documents = _packed(B, T, g)
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, generator=g)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([Hq, Hk, Hk], dim=2))
    d_out = torch.randn(B, Hq, T, D, generator=g)
    attrs = {"causal": True, "window_size": window}
    ref = KERNELS["flash_attention"]
    f64 = [t.double() for t in (q, k, v)]
    with packed(documents):
        out, lse = ref.forward_fn(*f64, None, **attrs)
        want = [out, *ref.backward_fn(d_out.double(), *f64, out, lse, None, **attrs)[:3]]
    on_gpu = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
    cu, longest = cu_seqlens(documents.positions.cuda())
    got_out, got_lse = varlen_forward(*on_gpu, cu, longest, attrs)
    grads = varlen_backward(d_out.cuda().to(torch.bfloat16), *on_gpu, got_out, got_lse, cu,
                            longest, attrs)
    for name, got, ref_t in zip(("out", "d_q", "d_k", "d_v"), [got_out, *grads], want):
        assert got.shape == ref_t.shape, name
        err = (got.double().cpu() - ref_t).abs().max() / ref_t.abs().max()
        assert err < 2e-2, f"{name}: max relative error {float(err):.3g}"


@needs_gpus(1)
def test_empty_padding_documents_and_max_seqlen_t_change_nothing():
    """The packed step's call: cu_seqlens repeated B*T to a fixed capacity (empty
    sequences) and T as the longest document give the exact call's out, lse and
    gradients (bitwise up to the backward's atomics)."""
    from runtime.cuda.packed import padded_cu_seqlens
    from runtime.cuda.varlen import varlen_backward, varlen_forward

    g = torch.Generator().manual_seed(1)
    B, T, Hq, Hk, D = 2, 128, 4, 2, 64
    documents = _packed(B, T, g)
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, generator=g).cuda().to(torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([Hq, Hk, Hk], dim=2))
    d_out = torch.randn(B, Hq, T, D, generator=g).cuda().to(torch.bfloat16)
    attrs = {"causal": True}
    cu, longest = cu_seqlens(documents.positions.cuda())
    padded = padded_cu_seqlens(documents.positions, 64).cuda()
    assert len(cu) - 1 < 64 and longest < T
    runs = []
    for c, m in ((cu, longest), (padded, T)):
        out, lse = varlen_forward(q, k, v, c, m, attrs)
        runs.append([out, lse, *varlen_backward(d_out, q, k, v, out, lse, c, m, attrs)])
    for name, exact, step in zip(("out", "lse", "d_q", "d_k", "d_v"), *runs):
        assert step.shape == exact.shape, name
        err = (step.float() - exact.float()).abs().max() / exact.float().abs().max()
        assert err < 1e-2, f"{name}: max relative error {float(err):.3g}"
