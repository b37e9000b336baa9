"""Delayed scaling's FP8 cast fused into its producer (runtime/cuda/fp8_producers.py;
decisions.md, "FP8 on the GPU: the cast in its producer"), opt-in (`FUSED`). On the CPU:
the step's plumbing (which matmul reads a norm's / SwiGLU's output first, its key and
layouts, the copies handed to that first use), the kernels emulated by the torch ops the
separate cast runs: the same gradients and amax histories bit for bit with the switch on
and off. The `cuda` tests: the fused kernels against the plain kernel then the separate
cast (csrc/kernels/norms.cu, swiglu.cu, fp8_amax.cu), bit for bit, and a tiny FP8 step
with the switch on and off (the same losses)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime import fp8_gemm  # noqa: E402
from runtime.cuda import fp8_producers  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

TINY = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "2",
        "num_kv_heads": "2", "d_ff": "32"}  # every FP8 GEMM dim a multiple of 16


def emulated_launch(kernels):
    """fp8_producers.launch with torch ops: the plain kernel, then the amax, the delayed
    scale and the cast that ScaleState.scales and fp8_gemm.cast run on the CPU."""
    def launch(target, inputs, attrs, out, work, slot, transposed):
        pending, past, top, code = slot
        fmt = ("fp8_e4m3", "fp8_e5m2")[code]
        outputs = list(kernels[target].forward(list(inputs), dict(attrs)))
        y = fp8_gemm._fold(outputs[fp8_producers.PRODUCERS[target][0]])
        amax = fp8_gemm.amax_of(y)
        if pending is not None:
            torch.fmax(pending, amax, out=pending)
        wide = torch.where(past >= 0, past, amax).to(torch.float64)
        ok = torch.isfinite(wide) & (wide > 0)
        scale = torch.where(ok, top / wide, torch.ones_like(wide)).to(torch.float32)
        q, *q_t = fp8_gemm.cast(y, fmt, scale, True, transposed)
        return outputs, (scale, torch.reciprocal(scale), q, q_t[0] if q_t else None)
    return launch


@pytest.mark.parametrize("derive", [True, False])
def test_the_produced_casts_give_the_same_bits_as_the_separate_ones(derive, monkeypatch):
    """Two steps of a tiny Llama (bf16, the arena, x^T kept for the wgrads) with the casts
    of the norms' and SwiGLU's outputs made by their producers (emulated) against the
    separate casts: the same gradients and histories bit for bit. The second step fuses
    (the first makes the keys' rows): both norms of each layer, and SwiGLU's output where
    the derived backward is used (std's written MLP backward recomputes it: the forward's
    down projection reads it alone, still fused)."""
    from runtime import arena as arena_module
    from runtime.cuda.fp8_step import StepFp8
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.cuda.train_kernels import train_kernels
    from runtime.inputs import fed_inputs, sized_inputs
    from runtime.model import parameter_shapes
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8",
                          derive_written=derive)
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, 2, 16))
    assert program.metadata["precision"]["recipe"]["scaling"]["kind"] == "delayed"
    g = torch.Generator().manual_seed(0)
    params = {p: (torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)).bfloat16()
              for p, s in parameter_shapes(program.graph).items()}
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"], "cpu")
    kernels = train_kernels("cpu")
    monkeypatch.setattr(fp8_producers, "kernels_take", lambda scales: scales.kind == "delayed")
    monkeypatch.setattr(fp8_producers, "launch", emulated_launch(kernels))

    def steps(fused):
        monkeypatch.setattr(fp8_producers, "FUSED", fused)
        state = StepFp8(program.metadata["precision"], "cpu", program.graph)
        for _ in range(2):
            state.begin_step()
            run = _StepInterpreter(program.graph, params, torch.bfloat16, check_finite=False,
                                   keep_only_saved=True, kernels=kernels, arena=arena)
            run.fp8_run = state
            inputs = fed_inputs(names, tokens, None)
            (logits,), frame = run.forward([inputs[n] for n in names])
            _, seed = logits_cross_entropy(logits, next_token_labels(tokens))
            grads = {p: t.clone() for p, t in run.backward(frame, [seed])[1].items()}
            state.end_step()
        return grads, state

    (grads, state), (reference, separate) = steps(True), steps(False)
    assert not hasattr(separate, "producers")
    layers = int(TINY["n_layers"])
    fused = state.producers.counts["fused"]
    assert fused == 3 * layers  # ln1 -> qkv, ln2 -> up, swiglu -> down, each layer
    assert state.casts.counts["produced"] == fused  # each taken by its first use
    assert state.casts.counts["held"] == separate.casts.counts["held"]
    assert grads.keys() == reference.keys()
    for path, grad in reference.items():
        assert torch.equal(grads[path], grad), path
    assert {k: v.tolist() for k, v in state.state_dict().items()} == \
        {k: v.tolist() for k, v in separate.state_dict().items()}


def test_the_first_reader_is_found_through_a_call():
    """ln1's output is read first by the attention's QKV projection (in the function the
    block calls), ln2's by the MLP's up projection, SwiGLU's by the down projection."""
    from runtime.cuda.fp8_step import StepFp8
    from runtime.inputs import sized_inputs
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8",
                          derive_written=True)
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, 2, 16))
    state = StepFp8(program.metadata["precision"], "cpu", program.graph)
    producers = fp8_producers.Producers(state, program.graph)
    found = {}
    for f in program.graph.functions:
        for n in f.nodes:
            reader = producers.first_reader(f, n) if n.kind == "op" else None
            if reader is not None:
                callee, call, matmul, index = reader
                found.setdefault(n.target, set()).add(
                    (f.module, callee.module, call is not None,
                     dict(matmul.attrs).get("transpose"), index))
    assert found["fused_residual_rmsnorm"] >= {
        ("DenseTransformerBlock", "CausalSelfAttention", True, "NT", 0),
        ("DenseTransformerBlock", "SwiGLU_MLP", True, "NT", 0)}
    assert found["swiglu"] == {("SwiGLU_MLP", "SwiGLU_MLP", False, "NT", 0)}


# ----------------------------------------------------------------------- on a GPU
def _ext():
    from runtime.cuda.build import load

    return load()


def _slot(past_value, pending):
    past = torch.tensor(past_value, device="cuda")
    return past, (None if pending is None else torch.tensor(pending, device="cuda"))


def _separate(ext, y2, past, pending, top, code):
    """The separate cast of the plain kernel's output: fp8_amax.cu's delayed cast."""
    work = torch.zeros(2, dtype=torch.int32, device="cuda")
    return ext.fp8_cast_delayed(y2, work, pending, past, top, code, True, True)


def _same(ours, ref, what):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    if ours.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        ours, ref = ours.view(torch.uint8), ref.view(torch.uint8)
    assert torch.equal(ours, ref) or (ours.is_floating_point() and torch.equal(
        torch.nan_to_num(ours, 7.0), torch.nan_to_num(ref, 7.0))), what


SLOTS = [(2.5, -1.0), (-1.0, 3.0), (0.7, None)]  # (past, pending): a history / none


@needs_gpus(1)
@pytest.mark.parametrize("rows,C", [(64, 64), (200, 136), (16, 24576), (8, 8)])
@pytest.mark.parametrize("fused_residual", [False, True])
@pytest.mark.parametrize("code", [0, 1])
def test_the_norm_with_its_fp8_copy_is_the_norm_then_the_cast(rows, C, fused_residual, code):
    """rmsnorm_forward_fp8 against rmsnorm_forward then fp8_cast_delayed: y (and
    residual_out), rstd, the scale, both fp8 layouts and the recorded amax bit for bit,
    with a history (the norm quantizes) and without (the finish kernel casts), short rows
    (a warp slice a row), long ones (past the register cache) and a NaN."""
    ext = _ext()
    g = torch.Generator(device="cuda").manual_seed(rows + C)
    x = (torch.randn(rows, C, generator=g, device="cuda") * 3).bfloat16()
    inp = (torch.randn(rows, C, generator=g, device="cuda")).bfloat16()
    w = (torch.randn(C, generator=g, device="cuda")).bfloat16()
    top = (448.0, 57344.0)[code]
    for past_value, pending_value in SLOTS + ([(1.0, 0.5)] if rows == 64 else []):
        if rows == 64 and pending_value == 0.5:
            x[3, 5] = float("nan")
        past, pending = _slot(past_value, pending_value)
        _, ref_pending = _slot(past_value, pending_value)
        args = (x, inp) if fused_residual else (x,)
        if fused_residual:
            plain = ext.fused_residual_rmsnorm_forward(x, inp, w, 1e-6, offset=0.0)
        else:
            plain = ext.rmsnorm_forward(x, w, 1e-6, offset=0.0)
        y = plain[-2]
        ref = _separate(ext, y, past, ref_pending, top, code)
        work = torch.zeros(2, dtype=torch.int32, device="cuda")
        got = ext.rmsnorm_forward_fp8(args[0], args[1] if fused_residual else None, w, 1e-6,
                                      0.0, [], work, pending, past, top, code, True)
        n = len(plain)
        for i in range(n):
            _same(got[i], plain[i], f"output {i}")
        for i, name in enumerate(("scale", "inv_scale", "fp8 y", "fp8 y^T")):
            _same(got[n + i], ref[i], name)
        if pending is not None:
            _same(pending, ref_pending, "recorded amax")
        assert work.tolist() == [0, 0]


@needs_gpus(1)
@pytest.mark.parametrize("rows,C", [(64, 64), (200, 136), (8, 8)])
@pytest.mark.parametrize("activation", [0, 1, 2])
def test_swiglu_with_its_fp8_copy_is_swiglu_then_the_cast(rows, C, activation):
    """swiglu_forward_fp8 on the two halves of a fused up projection (row stride 2C)
    against swiglu_forward then fp8_cast_delayed, bit for bit (y, scale, both layouts,
    the amax), with and without a history."""
    ext = _ext()
    g = torch.Generator(device="cuda").manual_seed(rows * 3 + C)
    gate_up = (torch.randn(rows, 2 * C, generator=g, device="cuda") * 2).bfloat16()
    gate, up = gate_up[:, :C], gate_up[:, C:]
    for code in (0, 1):
        top = (448.0, 57344.0)[code]
        for past_value, pending_value in SLOTS:
            past, pending = _slot(past_value, pending_value)
            _, ref_pending = _slot(past_value, pending_value)
            y = ext.swiglu_forward(gate, up, [], activation=activation)
            ref = _separate(ext, y, past, ref_pending, top, code)
            work = torch.zeros(2, dtype=torch.int32, device="cuda")
            got = ext.swiglu_forward_fp8(gate, up, [], activation, work, pending, past, top,
                                         code, True)
            _same(got[0], y, "y")
            for i, name in enumerate(("scale", "inv_scale", "fp8 y", "fp8 y^T")):
                _same(got[1 + i], ref[i], name)
            if pending is not None:
                _same(pending, ref_pending, "recorded amax")
            plain_only = ext.swiglu_forward_fp8(gate, up, [], activation, work, None, past,
                                                top, code, False)
            assert len(plain_only) == 4
            _same(plain_only[3], ref[2], "fp8 y alone")


@needs_gpus(1)
def test_a_tiny_fp8_step_with_the_casts_in_their_producers_has_the_same_losses(monkeypatch):
    """The GPU step (TrainStep, the std FP8 recipe's delayed scaling) with FUSED on and
    off, three steps on the same weights (loss_and_gradients: no update): the same losses
    and forward amax histories bit for bit (the fp8 bytes and amaxes are the same; the
    gradients' histories are left out: the attention's backward may sum in another order
    from run to run), the producers' copies used by their first readers; then steps
    captured in a CUDA graph run with them (losses near the eager run's)."""
    from runtime.cuda.step import TrainStep

    def run(fused):
        monkeypatch.setattr(fp8_producers, "FUSED", fused)
        step = TrainStep.from_module("std/models/llama.module", dict(TINY), batch=2, seq=16,
                                     precision="fp8", derive_written=True)
        g = torch.Generator().manual_seed(0)
        step.load({p: torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)
                   for p, s in step.shapes().items()})
        tokens = torch.randint(0, 64, (2, 16), generator=g, dtype=torch.int32).cuda()
        step.set_batch(tokens)
        losses = []
        for _ in range(3):
            step.fp8.begin_step()
            loss, _ = step.loss_and_gradients()
            step.fp8.end_step()
            losses.append(float(loss))
        forward = {k: v.tolist() for k, v in step.fp8.state_dict().items()
                   if not k.endswith(":grad")}
        step.capture(warmup=1)
        graphed = [float(step(tokens).clone()) for _ in range(2)]
        return losses, forward, graphed, step

    (ours, histories, graphed, step), (ref, ref_histories, ref_graphed, plain) = \
        run(True), run(False)
    assert ours == ref
    assert histories == ref_histories and histories
    assert graphed == pytest.approx(ref_graphed, rel=1e-3)
    assert step.cuda_graph is not None
    layers = int(TINY["n_layers"])
    assert step.fp8.producers.counts["fused"] >= 2 * 3 * layers  # steps 2 and 3 at least
    assert step.fp8.casts.counts["produced"] == step.fp8.producers.counts["fused"]
    assert not hasattr(plain.fp8, "producers")
