"""The residual stream's gradient written into the one-GEMM d_x scratch by the fused
residual norms' backward (runtime/cuda/residual_rows.py): which values qualify (every
reader takes rows with one stride), which weights get tail rows for it (o_proj), and the
step: o_proj's and down_proj's d_x one GEMM each with nothing copied, within bf16 of the
two-GEMM step, on the CPU and on the GPU (the norm kernel's strided, in-place rows)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda import residual_rows  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime_models import TINY, token_inputs  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402
from tests.test_lora_step import (  # noqa: E402
    BF16, _arena_step, _counting_copies, _error, _laid_views, _lora_model, _reference_step)

BLOCK, ENTRY = "DenseTransformerBlock#1.backward", "Llama#1.backward"


def _norm_backwards(graph) -> dict:
    """{(function, node id): whether both of its results' readers take rows}."""
    return {(f.name, n.id): all(residual_rows.takes_rows(graph, f, v) for v in n.outputs[:2])
            for f in graph.functions for n in f.nodes
            if n.target == "fused_residual_rmsnorm_backward"}


def test_every_norm_result_qualifies_where_its_readers_take_rows():
    """Under LoRA (frozen embedding: its backward has no output and reads nothing) each
    fused residual norm's result is read by matmul backwards (o's and down's d_y, through
    the attention and MLP calls) and the next norm's d_residual_out, across the layer
    stack's runs: all qualify. Fully fine-tuned, the std Llama's written backward reads
    d_y with `matmul` ops (not among ROW_READERS) and the first layer's input norm hands
    its result to the embedding's backward: none does."""
    lora = _lora_model(rank=8)
    graph = lora.source.program_for(token_inputs(lora)).graph
    assert _norm_backwards(graph) == {(BLOCK, "b1"): True, (BLOCK, "b3"): True,
                                      (ENTRY, "b1"): True}
    path, settings = TINY["llama"]
    full = Model.from_module(path, settings=settings, dtype=BF16)
    graph = full.source.program_for(token_inputs(full)).graph
    assert _norm_backwards(graph) == {(BLOCK, "b1"): False, (BLOCK, "b3"): False,
                                      (ENTRY, "b1"): False}


def test_o_proj_gets_tail_rows_where_a_residual_stream_is_that_wide(monkeypatch):
    """The residual width (the fused norms' last dim, 32) adds the single adapter whose
    output is that wide and is not WIDE (o_proj, rank 8) to the weights laid with tail
    rows; MODULEC_LORA_RESIDUAL_ROWS=0 names no width."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter

    model = _lora_model(rank=8)
    graph = model.source.program_for(token_inputs(model)).graph
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    assert residual_rows.residual_widths(graph) == {32}
    tails = kcat.tail_rows(shapes, frozen, residual_rows.residual_widths(graph))
    assert {p: r for p, r in tails.items() if "out_weight" in p or "down" in p} == {
        f"blocks[{i}].{path}": 8 for i in (0, 1)
        for path in ("attention.out_weight", "mlp.down_weight")}
    monkeypatch.setenv("MODULEC_LORA_RESIDUAL_ROWS", "0")
    assert residual_rows.residual_widths(graph) == frozenset()


def test_the_train_kernels_leave_only_the_norm_backwards_d_residual_out_strided():
    """train_kernels' Contiguous wrapper keeps as they are the backward inputs the CUDA
    kernel's layout names (runtime/cuda/kernels.py LAYOUTS): the fused residual norm's
    d_residual_out (position 0), nothing of the other contiguous-only kernels; a strided
    d_residual_out reaches the kernel as it is, the other inputs contiguous."""
    from runtime.cuda.train_kernels import CONTIGUOUS, train_kernels

    kernels = train_kernels("cpu")
    kept = {name: kernels[name].rows_backward for name in CONTIGUOUS}
    assert kept == {name: frozenset({0}) if name == "fused_residual_rmsnorm" else frozenset()
                    for name in CONTIGUOUS}
    seen = []
    norm = kernels["fused_residual_rmsnorm"]
    norm.kernel = type("Spy", (), {"backward": lambda self, inputs, attrs: seen.extend(
        inputs)})()
    wide = torch.zeros(4, 40)
    norm.backward([wide[:, :32], wide[:, :32], None, torch.ones(32), torch.ones(4)], {})
    assert not seen[0].is_contiguous() and seen[1].is_contiguous()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_the_norms_write_the_residual_gradient_where_o_and_down_read_it(monkeypatch,
                                                                        device):
    """With o_proj and down_proj laid with tail rows, every norm backward writes its
    result into the scratch's left columns (in place over its d_residual_out, handed
    across the layers' runs as it is), o's and down's d_x are one GEMM each over
    [d_y | d_t] and nothing is copied beside d_t; the step is within bf16 of the
    two-GEMM step (down's d_y found in the scratch needs no WIDE rule). Switched off
    (MODULEC_LORA_RESIDUAL_ROWS=0) o's d_x is two GEMMs again and down's d_y is copied
    (WIDE lowered to 1.4 for it)."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter

    model = _lora_model(rank=8)
    graph = model.source.program_for(token_inputs(model)).graph
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    tails = kcat.tail_rows(shapes, frozen, residual_rows.residual_widths(graph))
    # `held` keeps the slots alive to the end: lora_kcat holds weak references to them
    views, held = _laid_views(model, device, kcat.side_columns(shapes, frozen), tails)
    copied = _counting_copies(monkeypatch)
    outputs, grads, run, _ = _arena_step(model, monkeypatch, True, device, params=views)
    assert run.lora_dx_one_gemm == 8  # o, down, q/k/v and gate/up in each of 2 layers
    assert copied == [], copied
    scratch = kcat.residual_rows(16, 32, BF16, next(iter(views.values())).device)
    assert run._residual_at == {scratch.data_ptr()}

    monkeypatch.setenv("MODULEC_LORA_RESIDUAL_ROWS", "0")
    monkeypatch.setenv("MODULEC_LORA_KCAT_MIN", "1.4")  # down (48 in, 32 out) copies d_y
    copied = _counting_copies(monkeypatch)
    off_outputs, off_grads, off_run, _ = _arena_step(model, monkeypatch, True, device,
                                                     params=views)
    assert off_run.lora_dx_one_gemm == 6 and not off_run._residual_at
    assert sorted(set(copied)) == [(16, 32)]  # down's d_y
    exact_outputs, exact, _ = _reference_step(model)
    for got, off, want in [*zip(outputs, off_outputs, exact_outputs),
                           *((grads[p], off_grads[p], exact[p]) for p in exact)]:
        assert _error(got, want) < 0.1 and _error(off, want) < 0.1


@needs_gpus(1)
def test_the_norm_backward_reads_and_writes_rows_one_stride_apart_and_in_place():
    """csrc/kernels/norms.cu: d_residual_out and d_x as rows 16 elements wider than C,
    and as one buffer (d_x over d_residual_out), give the dense kernel's bits; frozen
    (no d_weight) and with d_weight."""
    from runtime.cuda.build import load

    ext = load()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, C, pad = 256, 4096, 16

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(BF16)

    d_y, x, d_res, w = rand(rows, C), rand(rows, C), rand(rows, C), rand(C)
    rstd = torch.rand(rows, generator=g, device="cuda") + 0.5
    for weight_grad in (False, True):
        dense, d_w = ext.rmsnorm_backward(d_y, x, w, rstd, d_res, [None], offset=0.0,
                                          weight_grad=weight_grad)
        wide = torch.zeros(rows, C + pad, dtype=BF16, device="cuda")
        wide[:, :C] = d_res
        rows_view = wide[:, :C]
        made, made_w = ext.rmsnorm_backward(d_y, x, w, rstd, rows_view, [rows_view],
                                            offset=0.0, weight_grad=weight_grad)
        assert made.data_ptr() == rows_view.data_ptr()
        assert torch.equal(rows_view, dense)
        assert torch.equal(wide[:, C:], torch.zeros(rows, pad, dtype=BF16, device="cuda"))
        if weight_grad:
            assert torch.equal(made_w, d_w)
