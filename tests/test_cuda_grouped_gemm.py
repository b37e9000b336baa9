"""The GPU MoE path without host reads (`-m cuda`; skipped without CUDA): the grouped
GEMM (runtime/cuda/grouped_gemm.py, torch._grouped_mm) against the reference loop in bf16,
forward and both gradients in both modes, experts with no rows included (their weight
gradient exactly zero on memory filled with NaN first); routing, counting, permuting and
the grouped GEMMs captured in a CUDA graph and replayed on a new routing; the bf16 router
against the reference; tiny Mixtral and Qwen3-MoE GPU steps captured in one graph against
eager steps; an fp32 MoE step's capture refused by name. The fast path needs sm90 (H100 / H200)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

from runtime.cuda import grouped_gemm as gg  # noqa: E402
from runtime.cuda.train_kernels import TRAIN_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(),
                                reason="the grouped GEMM's fast path is sm90")

BF16 = torch.bfloat16
# rows per expert: empty experts first, in the middle and last; one expert with them all
SIZES = [(0, 37, 0, 130, 5, 0, 64, 0), (300, 0, 0, 0), (1, 2, 3, 250, 17, 0, 0, 9)]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _poison(nbytes: int) -> None:
    """Leave a freed block of NaNs in the caching allocator, so that an output the kernel
    does not write shows."""
    block = torch.full((nbytes // 2 + 4096,), float("nan"), dtype=BF16, device="cuda")
    del block


def _case(sizes, mode, K=256, N=384, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, K, device="cuda", generator=g).to(BF16)
    shape = (N, K) if mode == "NT" else (K, N)
    w = (torch.randn(len(sizes), *shape, device="cuda", generator=g) / K ** 0.5).to(BF16)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda")
    d_y = torch.randn(rows, N, device="cuda", generator=g).to(BF16)
    return x, w, offsets, d_y


@needs_sm90
@pytest.mark.parametrize("mode", ["NT", "NN"])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_gemm_matches_the_loop_in_bf16(sizes, mode):
    x, w, offsets, d_y = _case(sizes, mode)
    kernel, ref, attrs = TRAIN_KERNELS["grouped_gemm"], KERNELS["grouped_gemm"], {"transpose": mode}
    assert gg.covered(x, w, offsets, d_y)
    _poison(x.shape[0] * max(w.shape[1], w.shape[2]) * 2)
    y = kernel.forward([x, w, offsets], dict(attrs))[0]
    want = ref.forward([x, w, offsets], dict(attrs))[0]   # fp32 products, rounded to bf16
    assert y.dtype == BF16 and _rel(y, want) < 1e-2
    _poison(w.numel() * 4)
    d_x, d_w = kernel.backward([d_y, x, w, offsets], dict(attrs))
    want_x, want_w = ref.backward([d_y, x, w, offsets], dict(attrs))
    assert d_x.dtype == d_w.dtype == BF16
    assert _rel(d_x, want_x) < 1e-2 and _rel(d_w, want_w) < 1e-2
    for e, size in enumerate(sizes):
        if size == 0:  # no rows: a zero gradient, not what the memory held
            assert not d_w[e].isnan().any() and not d_w[e].any(), e
        else:
            assert _rel(d_w[e], want_w[e]) < 1e-2, e


@needs_sm90
def test_routing_and_grouped_gemms_are_captured_and_follow_a_new_routing():
    """router -> offsets -> permute -> grouped GEMM (forward and backward) in one CUDA
    graph; a replay on new tokens (another routing, other group sizes) equals an eager
    run on them."""
    N, D, F, E, k = 96, 128, 256, 8, 2
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(N, D, device="cuda", generator=g).to(BF16)
    gate = torch.randn(E, D, device="cuda", generator=g).to(BF16)
    w = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).to(BF16)
    d_y = torch.randn(N * k, F, device="cuda", generator=g).to(BF16)
    K = TRAIN_KERNELS

    def run():
        weights, indices, stats = K["moe_router"].forward([x, gate], {"top_k": k})
        offsets = K["moe_compute_offsets"].forward([indices], {"num_experts": E})[0]
        rows, scatter = K["moe_permute"].forward([x, indices, offsets],
                                                 {"input_shapes": {"x": (N, D)}})
        y = K["grouped_gemm"].forward([rows, w, offsets], {"transpose": "NT"})[0]
        d_rows, d_w = K["grouped_gemm"].backward([d_y, rows, w, offsets], {"transpose": "NT"})
        return [stats, offsets, scatter, y, d_rows, d_w]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    before = [t.clone() for t in captured]
    x.copy_(torch.randn(N, D, device="cuda", generator=g).to(BF16))
    graph.replay()
    eager = run()
    assert not torch.equal(captured[1], before[1])  # the routing changed
    for got, want in zip(captured, eager):
        if got.is_floating_point():  # the same kernels on the same inputs
            assert _rel(got, want) < 1e-3
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("use_sigmoid", [False, True])
def test_the_bf16_router_matches_the_reference_on_the_gpu(use_sigmoid):
    """moe_router with bf16 x and gate (runtime/cuda/moe.py router_forward_bf16 /
    router_backward_bf16: torch.mm's fp32 output, d_logits as two bf16 halves) against the
    reference kernel on the same tensors: the same picks, weights and statistics to fp32
    summation order, both gradients to bf16 rounding."""
    N, D, E, k = 4096, 256, 8, 2
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(N, D, device="cuda", generator=g).to(BF16)
    gate = (torch.randn(E, D, device="cuda", generator=g) * 0.2).to(BF16)
    attrs = {"top_k": k, "use_sigmoid": use_sigmoid}
    kernel, ref = TRAIN_KERNELS["moe_router"], KERNELS["moe_router"]
    got, want = kernel.forward([x, gate], dict(attrs)), ref.forward([x, gate], dict(attrs))
    assert [t.dtype for t in got] == [t.dtype for t in want]
    same = (got[1] == want[1]).all(-1)
    assert same.float().mean() > 0.999  # a near-tie may flip
    assert _rel(got[0][same], want[0][same]) < 4e-3 and _rel(got[2], want[2]) < 2e-3
    d_weights = torch.randn(N, k, device="cuda", generator=g).to(BF16)
    d_stats = torch.randn(2, E, device="cuda", generator=g)
    inputs = [d_weights, d_stats, x, gate, want[1]]
    have = kernel.backward(list(inputs), dict(attrs))
    for a, b in zip(have, ref.backward(list(inputs), dict(attrs))):
        assert a.dtype == b.dtype == BF16 and _rel(a, b) < 4e-3


MOE_MODELS = {
    "mixtral": ("std/models/mixtral.module",
                dict(d_model=256, num_heads=8, num_kv_heads=2, n_layers=2, d_ff=256,
                     num_experts=4, top_k=2, eps=1e-5)),
    "qwen3_moe": ("std/models/qwen3_moe.module",
                  dict(d_model=256, num_heads=8, num_kv_heads=2, n_layers=4, head_dim=32,
                       d_ff=512, moe_d_ff=128, num_experts=8, top_k=2, sparse_step=2,
                       norm_topk_prob="true", eps=1e-6, rope_theta=10000.0)),
}
B, T, VOCAB = 2, 128, 512


def _moe_step(name: str, dtype=BF16):
    from runtime.cuda.step import TrainStep

    path, settings = MOE_MODELS[name]
    settings = dict(settings, vocab_size=VOCAB, max_seq=T, output_router_logits="true",
                    aux_loss_coef=0.01)
    step = TrainStep.from_module(path, settings, batch=B, seq=T, dtype=dtype)
    step.init_random(seed=3)
    step.adamw.lr = 1e-3
    return step


def _tokens():
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5),
                         dtype=torch.int32).cuda()


@needs_sm90
@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_moe_step_captured_in_one_graph_matches_eager_steps(name):
    tokens = _tokens()
    eager, graphed = _moe_step(name), _moe_step(name)
    eager_losses = [float(eager(tokens)) for _ in range(6)]
    graphed.set_batch(tokens)
    graphed.capture(warmup=2)
    assert graphed.cuda_graph is not None
    graphed_losses = [float(graphed(tokens)) for _ in range(4)]
    for a, b in zip(eager_losses[2:], graphed_losses):
        assert abs(a - b) / abs(a) < 2e-3, (eager_losses, graphed_losses)
    assert graphed_losses[-1] < eager_losses[0]


def test_fp32_moe_step_refuses_capture_by_name():
    """fp32 grouped GEMMs loop over the experts on the host: capture says so."""
    from runtime.errors import RuntimeUserError

    step = _moe_step("mixtral", torch.float32)
    step.set_batch(_tokens())
    with pytest.raises(RuntimeUserError, match="cannot capture"):
        step.capture(warmup=1)
