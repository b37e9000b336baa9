"""The GPU MoE path's host-free pieces on the CPU (their GPU runs and the captured step
are tests/test_cuda_grouped_gemm.py): the grouped GEMM's operand layouts through
`torch._grouped_mm` (CPU torch has it too) against the reference loop, forward and both
gradients in both modes, with experts that get no rows; what the fast path covers; the
router's and the offsets' counting without bincount against the reference kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda import grouped_gemm as gg  # noqa: E402
from runtime.cuda.moe import (  # noqa: E402
    MOE_KERNELS, _offsets_forward, _router_forward, expert_counts, mm32,
    router_backward_bf16, router_forward_bf16, two_bf16,
)
from runtime.kernels import KERNELS  # noqa: E402

needs_grouped_mm = pytest.mark.skipif(not gg.available(), reason="torch without _grouped_mm")

SIZES = [(0, 5, 0, 11, 4), (7, 0, 0, 9, 0), (26, 0, 0, 0, 0)]  # rows per group, some empty


def _case(sizes, mode, K=16, N=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(len(sizes), *((N, K) if mode == "NT" else (K, N)), generator=g)
    offsets = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32)
    d_y = torch.randn(rows, N, generator=g)
    return x, w, offsets, d_y


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@needs_grouped_mm
@pytest.mark.parametrize("mode", ["NT", "NN"])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_mm_layouts_match_the_loop(sizes, mode):
    x, w, offsets, d_y = _case(sizes, mode)
    ref = KERNELS["grouped_gemm"]
    attrs = {"transpose": mode}
    y = gg.forward(x, w, offsets, mode)
    assert _rel(y, ref.forward([x, w, offsets], attrs)[0]) < 1e-6
    d_x, d_w = gg.backward(d_y, x, w, offsets, mode)
    want_x, want_w = ref.backward([d_y, x, w, offsets], attrs)
    assert d_x.shape == want_x.shape and d_w.shape == want_w.shape
    assert _rel(d_x, want_x) < 1e-6 and _rel(d_w, want_w) < 1e-6
    for e, size in enumerate(sizes):
        if size == 0:  # an expert with no rows: a zero weight gradient
            assert not d_w[e].any()


@needs_grouped_mm
def test_transposed_and_offset_operands_are_made_contiguous():
    """Strided inputs (a transposed view, a column slice) give the same products."""
    x, w, offsets, d_y = _case(SIZES[0], "NT")
    wide = torch.cat([x, x], dim=1)[:, 16:]           # row stride 32, not contiguous
    y = gg.forward(wide, w.transpose(1, 2).contiguous().transpose(1, 2), offsets, "NT")
    assert _rel(y, gg.forward(x, w, offsets, "NT")) < 1e-6


def test_the_fast_path_covers_bf16_on_sm90_cuda_only():
    x, w, offsets, _ = _case(SIZES[0], "NT")
    bf = [x.bfloat16(), w.bfloat16(), offsets]
    assert gg.shapes_covered(*bf)
    assert not gg.covered(*bf)                         # CPU tensors
    assert not gg.device_covered(torch.device("cpu"), torch.bfloat16)
    assert not gg.shapes_covered(bf[0], bf[1], offsets[:-1])             # G + 1 offsets
    assert not gg.shapes_covered(bf[0], bf[1], offsets.long())           # int32 offsets
    assert not gg.shapes_covered(bf[0], w, offsets)                      # mixed dtypes
    odd = torch.zeros(x.shape[0], 12, dtype=torch.bfloat16)              # K not 8k
    assert not gg.shapes_covered(odd, torch.zeros(5, 24, 12, dtype=torch.bfloat16), offsets)


def test_uncovered_calls_run_the_reference_loop():
    x, w, offsets, d_y = _case(SIZES[1], "NT")
    kernel, ref = MOE_KERNELS["grouped_gemm"], KERNELS["grouped_gemm"]
    assert kernel.reference is ref and kernel.backward_inputs == ref.backward_inputs
    attrs = {"transpose": "NT"}
    assert torch.equal(kernel.forward([x, w, offsets], attrs)[0],
                       ref.forward([x, w, offsets], attrs)[0])
    got = kernel.backward([d_y, x, w, offsets], attrs)
    assert all(torch.equal(a, b) for a, b in zip(got, ref.backward([d_y, x, w, offsets], attrs)))


def test_counting_without_bincount_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    E, top_k = 6, 2
    x, gate = torch.rand(40, 16, generator=g), torch.randn(E, 16, generator=g) * 3
    gate[5] = -100.0  # expert 5 is never picked: a zero count
    for normalize in (True, False):
        attrs = {"top_k": top_k, "normalize": normalize}
        got = _router_forward(x, gate, **attrs)
        want = KERNELS["moe_router"].forward([x, gate], dict(attrs))
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        assert torch.equal(got[2], want[2]) and got[2][0, 5] == 0
        offsets = _offsets_forward(got[1], num_experts=E)[0]
        assert offsets.dtype == torch.int32
        assert torch.equal(offsets, KERNELS["moe_compute_offsets"].forward(
            [got[1]], {"num_experts": E})[0])
    assert expert_counts(torch.tensor([[0, 7]], dtype=torch.int32), 3).tolist() == [1, 0, 0]


def test_sync_free_kernels_keep_the_reference_signatures_and_backward():
    for name in ("moe_router", "moe_compute_offsets"):
        kernel = MOE_KERNELS[name]
        assert kernel.reference is KERNELS[name]
        assert kernel.forward_outputs == KERNELS[name].forward_outputs
        assert kernel.backward_outputs == KERNELS[name].backward_outputs
    assert MOE_KERNELS["moe_compute_offsets"].backward.__func__ is type(
        KERNELS["moe_compute_offsets"]).backward
    inputs = [torch.randn(4, 2), None, torch.randn(4, 8), torch.randn(3, 8),
              torch.zeros(4, 2, dtype=torch.int32)]  # CPU: the reference backward itself
    got = MOE_KERNELS["moe_router"].backward(list(inputs), {"top_k": 2})
    want = KERNELS["moe_router"].backward(list(inputs), {"top_k": 2})
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    x, gate = torch.randn(8, 16), torch.randn(4, 16)   # CPU: the reference forward itself
    got = MOE_KERNELS["moe_router"].forward([x, gate], {"top_k": 2})
    want = KERNELS["moe_router"].forward([x, gate], {"top_k": 2})
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("use_sigmoid,normalize", [(False, True), (False, False), (True, True)])
def test_the_bf16_router_is_the_reference_in_bf16(use_sigmoid, normalize):
    """The GPU's bf16 moe_router (no fp32 copy of x; its arithmetic on the CPU, where mm32
    runs through fp32 copies) against the reference kernel on the same bf16 tensors: the
    same picks and statistics, weights and both gradients equal but for the bf16
    rounding of the outputs (d_logits split in two bf16 halves sums to nearly fp32)."""
    g = torch.Generator().manual_seed(5)
    N, D, E = 64, 32, 6
    x = torch.randn(N, D, generator=g).bfloat16()
    gate = (torch.randn(E, D, generator=g) * 0.5).bfloat16()
    attrs = {"top_k": 2, "normalize": normalize, "use_sigmoid": use_sigmoid}
    ref = KERNELS["moe_router"]
    want = ref.forward([x, gate], dict(attrs))
    got = router_forward_bf16(x, gate, **attrs)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert torch.equal(got[1], want[1])
    assert _rel(got[0].float(), want[0].float()) < 4e-3
    assert _rel(got[2], want[2]) < 1e-6
    d_weights = torch.randn(N, 2, generator=g).bfloat16()
    d_stats = torch.randn(2, E, generator=g)
    for dw, ds in ((d_weights, d_stats), (d_weights, None), (None, d_stats)):
        inputs = [dw, ds, x, gate, got[1]]
        want = ref.backward(list(inputs), dict(attrs))
        have = router_backward_bf16(*inputs, **attrs)
        assert [t.dtype for t in have] == [torch.bfloat16, torch.bfloat16]
        for a, b in zip(have, want):
            assert a.shape == b.shape and _rel(a.float(), b.float()) < 4e-3


def test_the_bf16_router_in_the_gpu_steps_interpreter(monkeypatch):
    """A tiny bf16 Mixtral through the GPU step's interpreter and kernels on the arena,
    its routers through the bf16 path (forward and backward: the wiring of inputs and
    attrs), against the same run through the reference router: the same results, the
    router gradients equal to bf16 rounding."""
    import runtime.cuda.moe as moe
    from tests.test_runtime_arena import _train_kernel_run

    want_out, want = _train_kernel_run("mixtral", arena=True, own=True)
    calls = []
    monkeypatch.setattr(moe, "_router_bf16", lambda x, gate: calls.append(1) or (
        x.dtype == gate.dtype == torch.bfloat16))
    out, grads = _train_kernel_run("mixtral", arena=True, own=True)
    assert len(calls) == 4  # 2 layers, forward and backward
    assert all(torch.equal(a, b) for a, b in zip(out, want_out))
    assert grads.keys() == want.keys()
    for path, value in want.items():
        assert _rel(grads[path].float(), value.float()) < 4e-3, path


def test_two_bf16_halves_sum_to_nearly_fp32():
    t = torch.randn(1000, 8, generator=torch.Generator().manual_seed(6)) * 1e-3
    parts = two_bf16(t)
    assert parts.dtype == torch.bfloat16 and parts.shape == (1000, 16)
    total = parts[:, :8].double() + parts[:, 8:].double()
    assert float(((total - t.double()).abs() / t.double().abs()).max()) < 2 ** -16
    assert _rel(mm32(parts, torch.cat([torch.eye(8)] * 2).bfloat16()), t) < 2 ** -16


class _Always:
    """A sync-free forward run on CPU tensors too (its wrapper takes CUDA ones only)."""

    def __init__(self, name, fn):
        self.reference, self.fn = KERNELS[name], fn

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def forward(self, inputs, attrs):
        from runtime.kernels.base import _call

        r = self.reference
        return _call(r, self.fn, r.forward_inputs, r.forward_outputs, inputs, attrs)


def _permute_as_on_the_gpu(x, indices, expert_offsets, **_):
    """runtime/cuda/moe.py MoePermute.forward's arithmetic (its gather is a CUDA kernel):
    the stable sort of the assignments, no check of the offsets against the indices."""
    order = torch.argsort(indices.reshape(-1), stable=True)
    return [x[order // indices.shape[1]], order.to(torch.int32)]


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def _refuse_host_reads(monkeypatch):
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"a host read on the MoE path: {name}")
        return read
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch, "bincount", refuse("bincount"))


@needs_grouped_mm
def test_mixtral_through_the_fast_paths_matches_the_reference_and_reads_nothing_back(
        monkeypatch):
    """A tiny Mixtral's logits, aux_loss and every gradient with the GPU MoE path's
    arithmetic (grouped_gemm through torch._grouped_mm, its device check lifted; the
    counting without bincount; the permutation without the offsets check), against the
    reference kernels, in fp32 on the CPU: the wiring (inputs, attrs, modes) of the whole
    MoE path. Its forward and backward run with every Python-level host read (tolist,
    item, bool(), int(), nonzero, bincount) made to fail."""
    from runtime.model import Model

    settings = {k: str(v) for k, v in dict(
        vocab_size=64, d_model=32, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
        num_experts=4, top_k=2, max_seq=16, eps=1e-5, output_router_logits="true",
        aux_loss_coef=0.3).items()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2),
                        dtype=torch.int32)
    seed = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))

    def run(refuse=False):
        model = Model.from_module("std/models/mixtral.module", settings=settings,
                                  dtype=torch.float32).init_random(seed=1)
        model.check_finite = False  # the GPU step's setting (the check reads each value)
        with torch.no_grad():  # decisive routers: top-k picks far apart
            for path, value in model.params.items():
                if path.endswith("router.gate"):
                    value.mul_(30.0)
        with monkeypatch.context() as patch:
            if refuse:
                _refuse_host_reads(patch)
            out = model.forward(token_ids=ids)
            grads = model.backward(logits=seed, aux_loss=torch.ones(())).params
        return out, grads

    want_out, want_grads = run()
    calls = []
    monkeypatch.setattr(gg, "device_covered", lambda device, dtype: True)
    for name in ("forward", "backward"):
        inner = getattr(gg, name)
        monkeypatch.setattr(gg, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n)
                            or _f(*a, **k))
    monkeypatch.setitem(KERNELS, "grouped_gemm", MOE_KERNELS["grouped_gemm"])
    monkeypatch.setitem(KERNELS, "moe_router", _Always("moe_router", _router_forward))
    monkeypatch.setitem(KERNELS, "moe_compute_offsets",
                        _Always("moe_compute_offsets", _offsets_forward))
    monkeypatch.setitem(KERNELS, "moe_permute", _Always("moe_permute", _permute_as_on_the_gpu))
    out, grads = run(refuse=True)
    assert calls.count("forward") == 4 and calls.count("backward") == 4  # 2 layers x 2
    for name, value in want_out.items():
        assert _rel(out[name], value) < 1e-6, name
    assert grads.keys() == want_grads.keys()
    for path, value in want_grads.items():
        assert _rel(grads[path], value) < 1e-6, path


def test_a_host_loop_inside_a_capture_is_refused_by_name(monkeypatch):
    """A grouped GEMM that would take the reference loop while a CUDA graph is being
    captured raises RuntimeUserError (CUDA tensors and the capture stood in for)."""
    from runtime.errors import RuntimeUserError

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    x, w, offsets, d_y = _case(SIZES[0], "NT")
    kernel, attrs = MOE_KERNELS["grouped_gemm"], {"transpose": "NT"}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeUserError, match="cannot capture"):
        kernel.forward([x.as_subclass(OnCuda), w, offsets], dict(attrs))
    with pytest.raises(RuntimeUserError, match="float32 runs here as a loop"):
        kernel.backward([d_y, x.as_subclass(OnCuda), w, offsets], dict(attrs))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert kernel.forward([x.as_subclass(OnCuda), w, offsets], dict(attrs))[0].shape == (
        x.shape[0], w.shape[1])
