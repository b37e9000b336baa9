"""A LoRA-adapted projection's input planned with spare columns after each row
(modulec/plan/pads.py), and the GPU step's one GEMM over [x | x A^T] in x's own bytes
(runtime/cuda/lora_kcat.py `laid_wide`): the plan, the arena's strided values, the
layout's `rows`, and the step's values against the two-GEMM path and float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from modulec.plan.from_graph import plan_step  # noqa: E402
from modulec.plan.pads import Pad  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime_models import TINY, token_inputs  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402
from tests.test_lora_step import (  # noqa: E402
    BF16, _arena_step, _errors_beside_two_gemms, _lora_model)

BLOCK, ATTENTION, MLP = "DenseTransformerBlock#1", "CausalSelfAttention#1", "SwiGLU_MLP#1"


def _plan(model):
    program = model.source.program_for(token_inputs(model))
    return program, plan_step(program.graph)


def test_each_adapted_projections_input_is_laid_with_its_adapters_width_spare():
    """Rank 8 on all seven projections of the tiny Llama (d 32, d_ff 48): q/k/v's input
    (the first norm's output, read by the attention call) 24 spare columns, gate/up's (the
    second norm's) 16, down's (SwiGLU's output) 8; o's input is the attention output,
    laid [B, T, H, D] by its kernel (layouts.OUTPUT_ORDER), so it keeps its bytes. The
    values on the way (the callee's `x`) are recorded, the buffers grow by pad / row."""
    program, plan = _plan(_lora_model(rank=8))
    assert plan.pads[BLOCK] == {"%2": Pad(32, 24), "%6": Pad(32, 16)}
    assert plan.pads[ATTENTION] == {"x": Pad(32, 24), "%15": Pad(32, 8)}
    assert plan.pads[MLP] == {"x": Pad(32, 16), "%4": Pad(48, 8)}
    rows = 16  # B x T of the tiny inputs
    sizes = {(f, v): plan.placements[f][v].size_bytes
             for f, v in ((BLOCK, "%2"), (BLOCK, "%6"), (MLP, "%4"), (ATTENTION, "%11"))}
    assert sizes == {(BLOCK, "%2"): rows * 56 * 2, (BLOCK, "%6"): rows * 48 * 2,
                     (MLP, "%4"): rows * 56 * 2, (ATTENTION, "%11"): rows * 32 * 2}
    layout = program.document["schedule"]["layout"]
    laid = {(f["function"], v["value"]): v.get("rows") for f in layout["functions"]
            for v in f["values"]}
    assert laid[(BLOCK, "%2")] == {"elements": 32, "stride": 56}
    assert laid[(MLP, "%4")] == {"elements": 48, "stride": 56}
    assert laid[(BLOCK, "%1")] is None  # the residual: no adapter reads it


def test_nothing_is_laid_wide_without_adapters_or_off_16_byte_rows():
    """No LoRA: no pads. Rank 4 (q/k/v's 12 columns, o's and down's 4: not 16-byte runs
    of bf16): only gate/up's 8 spare columns are laid."""
    path, settings = TINY["llama"]
    plain = Model.from_module(path, settings=settings, dtype=BF16)
    assert not any(_plan(plain)[1].pads.values())
    _, plan = _plan(_lora_model(rank=4))
    assert plan.pads[BLOCK] == {"%6": Pad(32, 8)}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_the_step_writes_x_a_beside_x_and_runs_one_gemm_without_a_copy(monkeypatch, device):
    """Every adapted weight laid with its side columns (lora_kcat.side_columns), the step on
    the arena: q/k/v, gate/up and down find their input laid wide and run one GEMM in its
    bytes (no scratch: nothing copied), o (not laid, 1x as wide out as in) the two GEMMs;
    the values are the two-GEMM path's within bf16 and as near float32. With
    MODULEC_LORA_KCAT_PADDED=0 only the WIDE ones take one GEMM, through a copy of x."""
    import runtime.cuda.lora_kcat as kcat
    import runtime.cuda.train_kernels as train_module
    from modulec.lower.lora import is_adapter
    from runtime.cuda.state import region_of, stacked_order

    model = _lora_model(rank=8)
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    sides = kcat.side_columns(shapes, frozen)
    assert {p.rsplit(".", 1)[1] for p in sides} == {"qkv_weight", "out_weight", "up_weight",
                                                     "down_weight"}
    order = stacked_order(model.source.program_for(token_inputs(model)).graph, sorted(shapes))
    _, (views,) = region_of(shapes, [(BF16, order)], device=device, sides=sides)
    for path, view in views.items():
        view.copy_(model.params[path])
    slots = kcat.lay_sides(views, sides)  # noqa: F841 (held: the registry's are weak)

    def run(padded: str):
        taken, scratch = [], []
        kcat_into, wide = train_module.kcat_into, kcat._wide

        def counted(*args):
            out = kcat_into(*args)
            taken.append((out is not None, args[6]))  # pad
            return out
        monkeypatch.setenv("MODULEC_LORA_KCAT_PADDED", padded)
        # gate/up as cuBLAS's one GEMM + swiglu, not the gated GEMM that takes it where
        # quack imports (tests/test_gated_mlp.py, test_cuda_gated_mlp.py)
        monkeypatch.setenv("MODULEC_GATED_GEMM", "0")
        monkeypatch.setattr(train_module, "kcat_into", counted)
        monkeypatch.setattr(kcat, "_wide", lambda *a, **k: scratch.append(a) or wide(*a, **k))
        outputs, grads, step, copies = _arena_step(model, monkeypatch, True, device,
                                                   params=views)
        return outputs, grads, taken, scratch, copies

    outputs, grads, taken, scratch, copies = run("1")
    if device == "cuda":  # the norms write their rows wide themselves: nothing copied in
        assert not [key for key in copies if key[2] == "fused_residual_rmsnorm"], copies
    # per layer: q/k/v (pad 24), o (recorded, but its bytes not laid wide), gate/up (16),
    # down (8)
    assert taken == [(True, 24), (False, 8), (True, 16), (True, 8)] * 2
    assert scratch == []
    _, _, taken_off, scratch_off, _ = run("0")
    # the WIDE ones through a copy of x: q/k/v (64 out, 32 in here) and gate/up
    assert [t for t, _ in taken_off] == [True, False, True, False] * 2
    assert len(scratch_off) == 4
    new, was, _ = _errors_beside_two_gemms(model, monkeypatch, device, outputs, grads)
    assert max(new) < 0.1 and max(was) < 0.1, (new, was)
    assert sum(new) < 1.5 * sum(was), (sum(new), sum(was))


@pytest.mark.cuda
@needs_gpus(1)
@pytest.mark.parametrize("C, pad", [(4096, 48), (4096, 16), (64, 8), (36, 4)])
def test_the_norm_writes_its_output_into_rows_laid_wide(C, pad):
    """The fused residual RMSNorm's y into rows `pad` elements wider than C (the plan's
    wide buffer for a LoRA'd projection's input): the contiguous call's bits, the spare
    columns untouched (36 + 4: rows not 16-byte aligned, the scalar path)."""
    from runtime.arena import padded_view
    from runtime.cuda.build import load

    ext, rows = load(), 64
    gen = torch.Generator().manual_seed(0)
    residual, input = (torch.randn(rows, C, generator=gen).to(BF16).cuda() for _ in range(2))
    weight = torch.randn(C, generator=gen).to(BF16).cuda()
    dense = ext.fused_residual_rmsnorm_forward(residual, input, weight, 1e-5, [])
    raw = torch.full((rows * (C + pad) * 2,), 7, dtype=torch.uint8, device="cuda")
    wide = padded_view(raw, BF16, (rows, C), C, pad)
    out = ext.fused_residual_rmsnorm_forward(residual, input, weight, 1e-5, [None, wide, None])
    assert out[1].data_ptr() == wide.data_ptr() and out[1].stride() == (C + pad, 1)
    assert torch.equal(out[1], dense[1]) and torch.equal(out[2], dense[2])
    spare = raw.view(BF16).view(rows, C + pad)[:, C:]
    assert torch.equal(spare.view(torch.uint8), torch.full_like(spare.view(torch.uint8), 7))


def test_the_schedule_ir_says_which_outputs_are_laid_wide_and_the_verifier_checks_it(
        tmp_path):
    """A LoRA build's ops give `rows` ({output: [elements, stride]}) for the outputs laid
    wide; the verifier re-derives their bytes from it, and a `rows` dropped or garbled is
    reported."""
    import json

    from modulec.cli.build_cmd import verify_document
    from modulec.lower.lora import LoraOptions
    from tests.test_lora import _build

    document = _build(lora=LoraOptions(8, 16.0, ("q", "k", "v", "up", "down"))).document
    ops = document["schedule"]["functions"]
    laid = {(f, v): rows for f, listed in ops.items() for op in listed
            for v, rows in op.get("rows", {}).items()}
    assert laid and all(stride > elements for elements, stride in laid.values())
    path = tmp_path / "lora.ir"
    path.write_text(json.dumps(document))
    assert verify_document(path) == []
    function, value = sorted(laid)[0]
    op = next(op for op in ops[function] if value in op.get("rows", {}))
    op["rows"][value] = [8, 4]
    path.write_text(json.dumps(document))
    assert any("is not [elements, stride]" in p for p in verify_document(path))
    del op["rows"]
    path.write_text(json.dumps(document))
    assert any(f"buffer of `{value}` holds" in p for p in verify_document(path))


def test_a_tensor_parallel_ranks_program_lays_nothing_wide():
    """`--tp 2`: the rank's program has collectives (dense buffers) and its step runs no
    one-GEMM path: no value is laid wide, as the same build without --tp does."""
    from modulec.lower.build import BuildRequest, build
    from modulec.lower.lora import LoraOptions
    from tests.test_lora import DENSE, LLAMA, SHAPES

    def pads(**more):
        built = build(BuildRequest(LLAMA, settings={k: str(v) for k, v in DENSE.items()},
                                   shapes=SHAPES, lora=LoraOptions(8, 16.0, ("q", "k", "v")),
                                   **more))
        ops = built.document["schedule"]["functions"]
        return {v for listed in ops.values() for op in listed for v in op.get("rows", {})}
    assert pads() and not pads(tensor_parallel=2)
