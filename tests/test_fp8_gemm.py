"""FP8 on the GPU step (decisions.md, "FP8 on the GPU"): the FP8 GEMMs of
runtime/fp8_gemm.py (torch._scaled_mm) against the CPU emulation of runtime/fp8.py, on
CPU tensors (the same functions the GPU step runs): the same quantization bit for bit, the
products within fp32 accumulation-order rounding, forward and both gradients in every
transpose mode; the device amax histories against the emulation's over delayed-scaling
steps and through its checkpoint format; the step's interpreter with the recipe against
the emulating interpreter; what the GPU refuses. The `cuda` tests run the step itself."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime import fp8_gemm  # noqa: E402
from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.fp8 import GPU_REFUSAL, Fp8State, quantize, refuse_on_gpu, scale_for  # noqa: E402
from runtime.kernels.linalg import _matmul_backward, _matmul_forward  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

TINY = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "2",
        "num_kv_heads": "2", "d_ff": "32"}  # every FP8 GEMM dim a multiple of 16
RECIPE = {"name": "R", "forward": "fp8_e4m3", "gradient": "fp8_e5m2",
          "scaling": {"kind": "current", "margin": 0}, "granularity": {"kind": "per_tensor"}}


def emulated(x, fmt):
    return quantize(x, fmt, scale_for(float(x.abs().max()), fmt))


def draw(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_quantize_is_the_emulations_rounding(fmt):
    x = torch.cat([draw(256, seed=1, scale=1e-3), draw(256, seed=2, scale=40.0)])
    state = fp8_gemm.ScaleState(RECIPE)
    q = fp8_gemm.quantize(x[None], fmt, state.scale(x, fmt, "k"))
    assert q.plain().dtype == fp8_gemm.FORMATS[fmt][0]
    assert torch.equal(q.plain()[0].float() / q.scale, emulated(x, fmt))
    assert torch.equal(q.transposed()[:, 0].view(torch.uint8), q.plain()[0].view(torch.uint8))


# (A shape, B shape) by mode for M=32, K=48, N=16, A with a leading batch dim where it folds
SHAPES = {"NN": ((2, 16, 48), (48, 16)), "NT": ((2, 16, 48), (16, 48)),
          "TN": ((48, 32), (48, 16)), "TT": ((48, 32), (16, 48))}


@pytest.mark.parametrize("mode", list(SHAPES))
def test_fp8_gemms_match_the_emulation_forward_and_both_gradients(mode):
    """C = alpha op(A) op(B) with E4M3 operands; d_A, d_B from an E5M2 d_C: each the
    emulation's quantize-dequantize then the fp32 reference kernel, within fp32 rounding
    (the GEMM sums the fp8 products, then scales once)."""
    (a_shape, b_shape), alpha = SHAPES[mode], 0.5
    A, B = draw(*a_shape, seed=3, scale=3.0), draw(*b_shape, seed=4, scale=0.02)
    state = fp8_gemm.ScaleState(RECIPE)
    ops = [fp8_gemm.Operand(A, "fp8_e4m3", "a"), fp8_gemm.Operand(B, "fp8_e4m3", "b")]
    C = fp8_gemm.matmul(state, *ops, transpose=mode, alpha=alpha)
    qa, qb = emulated(A, "fp8_e4m3"), emulated(B, "fp8_e4m3")
    (expected,) = _matmul_forward(qa, qb, transpose=mode, alpha=alpha)
    torch.testing.assert_close(C, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    d_C = draw(*C.shape, seed=5, scale=1e-4)
    grads = fp8_gemm.matmul_backward(state, fp8_gemm.Operand(d_C, "fp8_e5m2", "g"), *ops,
                                     transpose=mode, alpha=alpha)
    want = _matmul_backward(emulated(d_C, "fp8_e5m2"), qa, qb, transpose=mode, alpha=alpha)
    for got, ref in zip(grads, want):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    only = fp8_gemm.matmul_backward(state, fp8_gemm.Operand(d_C, "fp8_e5m2", "g"), *ops,
                                    transpose=mode, alpha=alpha, wanted=(True, False))
    assert only[1] is None and torch.equal(only[0], grads[0])


def test_products_go_into_the_planned_bytes_where_they_fit():
    """`out` (the arena's planned bytes, uint8, as the bf16 Matmul takes them): the product
    is written there, the same values; bytes too few: allocated (place() copies it)."""
    A, B, d_C = draw(2, 16, 32, seed=12), draw(48, 32, seed=13), draw(2, 16, 48, seed=14)
    state = fp8_gemm.ScaleState(RECIPE)
    ops = [fp8_gemm.Operand(A, "fp8_e4m3", "a"), fp8_gemm.Operand(B, "fp8_e4m3", "b")]
    grad = fp8_gemm.Operand(d_C, "fp8_e5m2", "g")
    raw = [torch.empty(32 * 48 * 4 + 8, dtype=torch.uint8)]
    C = fp8_gemm.matmul(state, *ops, transpose="NT", out=raw)
    assert C.shape == (2, 16, 48) and C.data_ptr() == raw[0].data_ptr()
    assert torch.equal(C, fp8_gemm.matmul(state, *ops, transpose="NT"))
    raws = [torch.empty(32 * 32 * 4, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)]
    d_A, d_B = fp8_gemm.matmul_backward(state, grad, *ops, transpose="NT", out=raws)
    assert d_A.data_ptr() == raws[0].data_ptr() and d_B.data_ptr() != raws[1].data_ptr()
    for got, ref in zip((d_A, d_B), fp8_gemm.matmul_backward(state, grad, *ops,
                                                             transpose="NT")):
        assert torch.equal(got, ref)


def test_bf16_operands_give_a_bf16_product_of_the_fp8_values():
    A, B = draw(32, 16, seed=6).bfloat16(), draw(16, 16, seed=7).bfloat16()
    state = fp8_gemm.ScaleState(RECIPE)
    C = fp8_gemm.matmul(state, fp8_gemm.Operand(A, "fp8_e4m3", "a"),
                        fp8_gemm.Operand(B, "fp8_e4m3", "b"), transpose="NT")
    expected = emulated(A.float(), "fp8_e4m3") @ emulated(B.float(), "fp8_e4m3").T
    assert C.dtype == torch.bfloat16
    torch.testing.assert_close(C.float(), expected, rtol=2 ** -8, atol=1e-3)


def test_shapes_off_the_16_grid_are_a_user_error():
    state = fp8_gemm.ScaleState(RECIPE)
    A, B = draw(32, 24, seed=8), draw(16, 24, seed=9)
    with pytest.raises(RuntimeUserError, match="multiple of 16") as caught:
        fp8_gemm.matmul(state, fp8_gemm.Operand(A, "fp8_e4m3", "a"),
                        fp8_gemm.Operand(B, "fp8_e4m3", "b"), transpose="NT", where="M/f0")
    assert "32 x 24 x 16" in caught.value.message and "M/f0" in caught.value.message


def test_the_device_histories_follow_the_emulations_over_delayed_steps():
    """history_len 2: each step's scale from the window (the tensor's own at first), NaN
    amaxes not recorded, a key unused in a step not pushed; the checkpoint format (float64,
    oldest first) read by either side."""
    recipe = dict(RECIPE, scaling={"kind": "delayed", "history_len": 2, "margin": 1})
    device, host = fp8_gemm.ScaleState(recipe), Fp8State({"recipe": recipe, "matmuls": []})
    host.recording = True
    amaxes = [(2.0, 5.0), (100.0, None), (float("nan"), 3.0), (0.5, 0.25), (7.0, 8.0)]
    for step, values in enumerate(amaxes):
        device.begin_step()
        device.recording = True
        for key, amax in zip("ab", values):
            if amax is None:
                continue
            x = torch.tensor([[amax / 2, -amax, 0.1]])
            ours = fp8_gemm.quantize(x, "fp8_e4m3", device.scale(x, "fp8_e4m3", key))
            theirs = host.fake_quantize(x, "fp8_e4m3", key, False)
            torch.testing.assert_close(ours.plain().float() / ours.scale, theirs, rtol=0,
                                       atol=0, equal_nan=True, msg=f"step {step}")
        device.recording = False
        device.end_step()
        host.end_step()
        assert device.state_dict().keys() == host.state_dict().keys()
        for key, history in host.state_dict().items():
            assert torch.equal(device.state_dict()[key], history)
    restored = fp8_gemm.ScaleState(recipe)
    restored.load_state_dict(host.state_dict())
    assert {k: v.tolist() for k, v in restored.state_dict().items()} == host.histories


def test_keys_share_a_history_row_only_from_the_same_history():
    """ScaleState.share: a key with no row takes another's (the same tensor's operand)
    where it starts from the same history; one with its own, or loaded from another
    history, keeps its own; a checkpoint is read back key by key either way."""
    recipe = dict(RECIPE, scaling={"kind": "delayed", "history_len": 2, "margin": 0})
    state = fp8_gemm.ScaleState(recipe)
    state.load_state_dict({"w:fwd": torch.tensor([2.0]), "w:bwd": torch.tensor([2.0]),
                           "x:fwd": torch.tensor([1.0, 3.0]), "x:bwd": torch.tensor([4.0])})
    x = torch.ones(2, 2)
    for key in ("w:fwd", "x:fwd", "new"):
        state.scales(x, "fp8_e4m3", key)
    assert state.share("w:bwd", state.rows["w:fwd"])  # the same history loaded
    assert not state.share("x:bwd", state.rows["x:fwd"])  # another one
    assert not state.share("w:bwd", state.rows["new"])  # it has its row now
    assert state.share("fresh", state.rows["new"])  # neither has one
    assert {k: v.tolist() for k, v in state.state_dict().items()} == {
        "w:fwd": [2.0], "w:bwd": [2.0], "x:fwd": [1.0, 3.0], "x:bwd": [4.0]}


def test_the_gpu_refuses_per_block_scaling_and_e5m2_times_e5m2():
    sites = [{"function": "F", "op": "f0", "role": "forward", "operands": ["forward"] * 2}]
    refuse_on_gpu({"precision": {"recipe": RECIPE, "matmuls": sites}})  # runs
    refuse_on_gpu({})
    blocks = dict(RECIPE, granularity={"kind": "per_block"})
    with pytest.raises(RuntimeUserError, match=f"{GPU_REFUSAL}.*scales per block"):
        refuse_on_gpu({"precision": {"recipe": blocks, "matmuls": sites}})
    e5m2 = dict(RECIPE, forward="fp8_e5m2")
    with pytest.raises(RuntimeUserError, match="two E5M2 operands in F/f0"):
        refuse_on_gpu({"precision": {"recipe": e5m2, "matmuls": sites}})


def test_the_step_makes_fp8_state_for_a_recipe_only():
    """TrainStep's FP8 state (runtime/cuda/fp8_step.py): none without a recipe; under data
    / tensor parallel too (each rank its own amaxes), what the GPU cannot run refused."""
    from types import SimpleNamespace

    from runtime.cuda.fp8_step import StepFp8, step_fp8

    sites = [{"function": "F", "op": "f0", "role": "forward", "operands": ["forward"] * 2}]
    program = SimpleNamespace(metadata={"precision": {"recipe": RECIPE, "matmuls": sites}})
    assert isinstance(step_fp8(program, device="cpu"), StepFp8)
    assert isinstance(step_fp8(program, dist=object(), device="cpu"), StepFp8)
    assert step_fp8(SimpleNamespace(metadata={}), device="cpu") is None
    blocks = dict(RECIPE, granularity={"kind": "per_block"})
    with pytest.raises(RuntimeUserError, match=GPU_REFUSAL):
        step_fp8(SimpleNamespace(metadata={"precision": {"recipe": blocks, "matmuls": sites}}),
                 device="cpu")


def test_the_step_interpreter_runs_the_recipe_as_the_emulation_does():
    """A tiny Llama (its written backwards, float32, CPU): the GPU step's interpreter with
    the FP8 GEMMs gives the emulating interpreter's loss and gradients, and after one
    recorded step the same amax histories under the same keys."""
    from runtime.cuda.fp8_step import StepFp8
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.inputs import fed_inputs, sized_inputs
    from runtime.interpreter import Interpreter
    from runtime.model import parameter_shapes
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8")
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, 2, 8))
    shapes = parameter_shapes(program.graph)
    g = torch.Generator().manual_seed(0)
    params = {p: torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)
              for p, s in shapes.items()}
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    section = program.metadata["precision"]

    def run(make):
        interpreter, state = make()
        inputs = fed_inputs(names, tokens, None)
        (logits,), frame = interpreter.forward([inputs[n] for n in names])
        loss, seed = logits_cross_entropy(logits, labels)
        _, grads = interpreter.backward(frame, [seed])
        state.end_step()
        return float(loss), grads, state

    def emulation():
        state = Fp8State(section)
        state.recording = True
        return Interpreter(program.graph, params, torch.float32, fp8=state), state

    def step():
        state = StepFp8(section, "cpu")
        interpreter = _StepInterpreter(program.graph, params, torch.float32,
                                       check_finite=False)
        interpreter.fp8_run = state
        state.begin_step()
        return interpreter, state

    (loss, grads, host), (ours, our_grads, device) = run(emulation), run(step)
    assert ours == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == our_grads.keys()
    # the layers downstream of the first FP8 GEMMs agree within fp32 rounding (measured
    # 5e-7 relative); upstream, fp32 summation-order differences flip a few elements'
    # FP8 rounding (an E5M2 step is 25%): measured at most 0.9% relative, and an
    # unquantized run is 11% to 35% away from the emulation
    for path, grad in grads.items():
        error = float((our_grads[path] - grad).norm() / grad.norm())
        assert error < 0.02, (path, error)
    histories = host.state_dict()
    layers = int(TINY["n_layers"])  # a key per layer and operand of each covered matmul
    assert len(histories) == layers * sum(len(m["operands"]) for m in section["matmuls"])
    assert device.state_dict().keys() == histories.keys()
    for key, history in histories.items():  # amaxes: within the gradients' bound
        torch.testing.assert_close(device.state_dict()[key], history, rtol=0.02, atol=0)


@pytest.mark.parametrize("derive", [False, True])
def test_the_wgrads_x_t_kept_from_the_forward_gives_the_same_bits(derive):
    """x^T cast in the forward's pass with x and kept to the backward (Casts.keep_transposed)
    against x^T cast again from x in the backward: the same gradients bit for bit over two
    micro-batches of one step (bf16, the arena), one cast a linear fewer where the backward
    reads the forward's x: all four linears with the derived backward, three with std's
    written one (its MLP recomputes the down projection's input: nothing kept for it)."""
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
    g = torch.Generator().manual_seed(0)
    params = {p: (torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)).bfloat16()
              for p, s in parameter_shapes(program.graph).items()}
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
    arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"], "cpu")

    def step(keep):
        state = StepFp8(program.metadata["precision"], "cpu", program.graph)
        state.casts.keep_transposed = keep
        state.begin_step()
        grads = []
        for tokens in batches:  # two micro-batches of one step: each forward's own x^T
            run = _StepInterpreter(program.graph, params, torch.bfloat16, check_finite=False,
                                   keep_only_saved=True, kernels=train_kernels("cpu"),
                                   arena=arena)
            run.fp8_run = state
            inputs = fed_inputs(names, tokens, None)
            (logits,), frame = run.forward([inputs[n] for n in names])
            _, seed = logits_cross_entropy(logits, next_token_labels(tokens))
            grads.append({p: t.clone() for p, t in run.backward(frame, [seed])[1].items()})
        state.end_step()
        return grads, state.casts.counts, state.state_dict()

    (kept, counts, histories), (again, before, reference) = step(True), step(False)
    layers, linears = int(TINY["n_layers"]), 4 if derive else 3
    assert counts["held"] == counts["held_read"] == 2 * layers * linears
    assert before["held"] == before["held_read"] == 0
    for ours, theirs in zip(kept, again):
        assert ours.keys() == theirs.keys()
        for path, grad in theirs.items():
            assert torch.equal(ours[path], grad), path
    assert {k: v.tolist() for k, v in histories.items()} == \
        {k: v.tolist() for k, v in reference.items()}


def test_fast_accumulation_is_asked_for_the_forwards_products_only(monkeypatch):
    """fp8_gemm.FAST_ACCUM["forward"] (a measurement knob, off by default): the step's
    forward products ask _scaled_mm for cuBLAS's fast accumulation, the backward's (dgrad,
    wgrad) never; off, none does."""
    from runtime.cuda.fp8_step import StepFp8
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.inputs import fed_inputs, sized_inputs
    from runtime.model import parameter_shapes
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8",
                          derive_written=True)
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, 2, 16))
    g = torch.Generator().manual_seed(0)
    params = {p: torch.randn(s, generator=g) * 0.2 for p, s in
              parameter_shapes(program.graph).items()}
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    asked, product = [], torch._scaled_mm

    def recorded(*args, use_fast_accum=False, **kwargs):
        asked.append(use_fast_accum)
        return product(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    layers = int(TINY["n_layers"])
    for fast in (True, False):
        monkeypatch.setitem(fp8_gemm.FAST_ACCUM, "forward", fast)
        asked.clear()
        state = StepFp8(program.metadata["precision"], "cpu", program.graph)
        run = _StepInterpreter(program.graph, params, torch.float32, check_finite=False)
        run.fp8_run = state
        state.begin_step()
        inputs = fed_inputs(names, tokens, None)
        (logits,), frame = run.forward([inputs[n] for n in names])
        run.backward(frame, [logits_cross_entropy(logits, next_token_labels(tokens))[1]])
        state.end_step()
        assert asked[:layers * 4] == [fast] * (layers * 4)  # qkv, out, up, down
        assert asked[layers * 4:] == [False] * (layers * 4 * 2)  # dgrad, wgrad


# ====================================================================== on the GPU


@needs_gpus(1)
@pytest.mark.parametrize("mode", ["NT", "NN", "TN"])
def test_a_cuda_fp8_gemm_is_the_cpu_one_and_near_bf16(mode):
    """On the GPU (cuBLAS's FP8 GEMM, bf16 output): the CPU FP8 GEMM's result within bf16
    rounding, and within the recipe's error of the bf16 GEMM: E4M3 keeps 3 mantissa bits
    (up to 2^-4 relative per operand), E5M2 2 bits (2^-3); over K = 512 random terms the
    product's relative error (norm) is a few percent."""
    a_shape, b_shape = {"NT": ((256, 512), (384, 512)), "NN": ((256, 512), (512, 384)),
                        "TN": ((512, 256), (512, 384))}[mode]
    A, B = draw(*a_shape, seed=10, scale=2.0), draw(*b_shape, seed=11, scale=0.05)
    for fmt, bound in (("fp8_e4m3", 0.06), ("fp8_e5m2", 0.12)):  # A's format; B E4M3
        results = {}
        for device in ("cpu", "cuda"):
            state = fp8_gemm.ScaleState(RECIPE, device)
            a, b = A.to(device, torch.bfloat16), B.to(device, torch.bfloat16)
            results[device] = fp8_gemm.matmul(state, fp8_gemm.Operand(a, fmt, "a"),
                                              fp8_gemm.Operand(b, "fp8_e4m3", "b"),
                                              transpose=mode)
        ours = results["cuda"].float().cpu()
        assert results["cuda"].dtype == torch.bfloat16
        torch.testing.assert_close(ours, results["cpu"].float(), rtol=2 ** -7,
                                   atol=2 ** -7 * float(ours.abs().max()))
        (bf16,) = _matmul_forward(A.bfloat16().cuda(), B.bfloat16().cuda(), transpose=mode)
        error = float((ours - bf16.float().cpu()).norm() / bf16.float().norm())
        assert 1e-4 < error < bound, (fmt, error)  # FP8 acts, within its rounding


@needs_gpus(1)
def test_a_cuda_fp8_gemm_with_fast_accumulation_is_near_the_fp32_one():
    """cuBLAS's fast FP8 accumulation (fp8_gemm.FAST_ACCUM's products, into planned bytes
    as the step writes them): the fp32-accumulated product within 2^-6 relative (norm)
    at K = 4096."""
    A, B = draw(512, 4096, seed=12, scale=2.0), draw(256, 4096, seed=13, scale=0.05)
    state = fp8_gemm.ScaleState(RECIPE, "cuda")
    a, b = (fp8_gemm.Operand(t.cuda().bfloat16(), "fp8_e4m3", k) for t, k in ((A, "a"), (B, "b")))
    precise = fp8_gemm.matmul(state, a, b, transpose="NT")
    raw = torch.empty(512 * 256 * 2, dtype=torch.uint8, device="cuda")
    fast = fp8_gemm.matmul(state, a, b, transpose="NT", out=[raw], fast=True)
    assert fast.data_ptr() == raw.data_ptr() and fast.dtype == torch.bfloat16
    error = float((fast.float() - precise.float()).norm() / precise.float().norm())
    assert error < 2 ** -6, error


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [70, 136])
def test_the_cuda_cast_kernel_is_the_torch_ops_bit_for_bit(dtype, cols, monkeypatch):
    """csrc/kernels/fp8_cast.cu (x and x^T in one pass) against the torch ops it replaces,
    on magnitudes from subnormal to saturating, NaN and infinities, at shapes off the
    kernel's tiles: 200 x 136 bf16 takes its 8-wide path, the others the scalar one."""
    x = torch.cat([draw(50, cols, seed=20, scale=s) for s in (1e-6, 1.0, 300.0, 1e5)])
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x = x.to("cuda", dtype)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        scale = fp8_gemm.scale_from(fp8_gemm.amax_of(x[1:]), fmt)
        made = fp8_gemm.cast(x, fmt, scale, True, True)
        monkeypatch.setitem(fp8_gemm.CAST, "cuda", "torch")
        want = fp8_gemm.cast(x, fmt, scale, True, True)
        monkeypatch.setitem(fp8_gemm.CAST, "cuda", "kernel")
        for got, ref in zip(made, want):
            assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
            same = got.view(torch.uint8) == ref.view(torch.uint8)
            nan = torch.isnan(ref.float())  # the NaN's bits may differ: NaN both
            assert bool((same | (nan & torch.isnan(got.float()))).all()), fmt
        only = fp8_gemm.cast(x, fmt, scale, False, True)
        assert len(only) == 1 and torch.equal(only[0].view(torch.uint8), made[1].view(torch.uint8))


@needs_gpus(1)
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_the_cuda_scale_kernel_is_the_torch_ops(kind, monkeypatch):
    """csrc/kernels/fp8_cast.cu's fp8_scale (record, delayed window, scale and its
    reciprocal in one launch) against the torch ops over steps with NaN, zero and infinite
    amaxes: the same scales bit for bit and the same histories."""
    recipe = dict(RECIPE, scaling={"kind": kind, "history_len": 2, "margin": 1})
    states = {mode: fp8_gemm.ScaleState(recipe, "cuda") for mode in ("kernel", "torch")}
    amaxes = [(2.0, 0.0), (100.0, float("nan")), (float("inf"), 3.0), (0.5, 7e-3)]
    for values in amaxes:
        got = {}
        for mode, state in states.items():
            monkeypatch.setitem(fp8_gemm.CAST, "cuda", mode)
            state.begin_step()
            state.recording = True
            got[mode] = [state.scales(torch.tensor([[a, -a / 3]], device="cuda"), fmt, key)
                         for key, a, fmt in zip("ab", values, ("fp8_e4m3", "fp8_e5m2"))]
            state.recording = False
            state.end_step()
        for ours, ref in zip(got["kernel"], got["torch"]):
            assert [float(t) for t in ours] == [float(t) for t in ref], values
    monkeypatch.setitem(fp8_gemm.CAST, "cuda", "kernel")
    assert torch.equal(states["kernel"].history, states["torch"].history)


@needs_gpus(1)
def test_the_cuda_amax_kernel_is_torchs_amax(monkeypatch):
    """csrc/kernels/fp8_amax.cu (max |x|, record and scale in one launch, a grid of blocks
    meeting in the last one): the torch ops' scales and pending amaxes bit for bit, call
    after call (its work counters reset), on the 8-wide bf16 path, the scalar one (a length
    off 8, fp32), more blocks than its grid (a grid-stride loop), empty, NaN, infinity."""
    g = torch.Generator().manual_seed(30)
    tensors = [torch.randn(n, generator=g) * s for n, s in
               ((8 * 4096 * 33, 3.0), (1001, 1e-3), (8, 50.0), (0, 1.0), (4099, 7.0))]
    tensors[2][5] = float("inf")
    tensors[4][4000] = float("nan")
    cases = [t.to("cuda", dtype) for t in tensors for dtype in (torch.bfloat16, torch.float32)]
    recipe = dict(RECIPE, scaling={"kind": "current", "margin": 1})
    got = {}
    for mode in ("kernel", "torch"):
        monkeypatch.setitem(fp8_gemm.CAST, "cuda", mode)
        state = fp8_gemm.ScaleState(recipe, "cuda")
        state.begin_step()
        state.recording = True
        scales = [state.scales(x, fmt, f"k{i}") for i, x in enumerate(cases)
                  for fmt in ("fp8_e4m3", "fp8_e5m2")]
        got[mode] = ([[float(t) for t in pair] for pair in scales], state.pending.clone())
    assert got["kernel"][0] == got["torch"][0]
    torch.testing.assert_close(got["kernel"][1], got["torch"][1], rtol=0, atol=0, equal_nan=True)


@needs_gpus(1)
@pytest.mark.parametrize("shape", [(256, 128), (200, 136), (8, 8)])
def test_the_cuda_fused_delayed_cast_is_the_separate_passes(shape, monkeypatch):
    """Delayed scaling's cast with the amax in one pass (fp8_amax.cu fp8_cast_delayed)
    against the amax-and-scale launch then the cast kernel, over three steps: the first
    makes the rows (not recording: nothing pushed), the second finds empty histories in
    the window (the scale from the tensor itself, the second launch casting), the third
    scales by the second's amaxes; a NaN operand is not recorded (its history stays
    empty). The same scales, fp8 bytes in both layouts and histories."""
    recipe = dict(RECIPE, scaling={"kind": "delayed", "history_len": 2, "margin": 0})
    g = torch.Generator().manual_seed(40)
    steps = [[torch.randn(*shape, generator=g) * 10.0 ** k for k in (-2, 0, 3)]
             for _ in range(3)]
    steps[1][2][0, 0] = float("nan")
    got, fused = {}, 0
    for mode in ("fused", "separate"):
        monkeypatch.setitem(fp8_gemm.CAST, "delayed", mode)
        state, out = fp8_gemm.ScaleState(recipe, "cuda"), []
        for step, xs in enumerate(steps):
            state.begin_step()
            state.recording = step > 0
            for i, x in enumerate(xs):
                x = x.to("cuda", torch.bfloat16)
                fmt = ("fp8_e4m3", "fp8_e5m2")[i % 2]
                q = state.cast_delayed(x, fmt, f"k{i}", True, True)
                fused += q is not None
                if q is None:
                    q = fp8_gemm.Quantized(x, fmt, *state.scales(x, fmt, f"k{i}"))
                out.append((float(q.scale), float(q.inv_scale),
                            q.plain().view(torch.uint8).cpu(),
                            q.transposed().view(torch.uint8).cpu()))
            state.recording = False
            state.end_step()
        got[mode] = (out, state.history.cpu())
    assert fused == 2 * 3  # steps 2 and 3, fused mode
    for ours, ref in zip(got["fused"][0], got["separate"][0]):
        assert ours[:2] == ref[:2] and torch.equal(ours[2], ref[2]) and torch.equal(ours[3],
                                                                                      ref[3])
    assert torch.equal(got["fused"][1], got["separate"][1])


# the std recipe, and as `--fp8-scaling current --fp8-gradient e4m3` change it
RECIPES = {"std": None, "current-e4m3": {"scaling": "current", "gradient": "fp8_e4m3"}}


def tiny_step(precision="fp8", batch=2, seq=16, overrides=None):
    from runtime.cuda.step import TrainStep

    step = TrainStep.from_module("std/models/llama.module", dict(TINY), batch=batch, seq=seq,
                                 precision=precision, precision_overrides=overrides)
    g = torch.Generator().manual_seed(0)
    params = {p: torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)
              for p, s in step.shapes().items()}
    tokens = torch.randint(0, 64, (batch, seq), generator=g, dtype=torch.int32)
    return step.load(params), params, tokens


def forced_emulation(params, tokens, records, steps=1, overrides=None):
    """The CPU emulation (float32) replayed with every covered node forced to the step's
    recorded inputs and outputs (tests/fp8_forced.py), `steps` steps on the same weights
    and batch: (the Forced interpreter, the last step's loss and gradients, the amax
    histories after it). `overrides`: the std recipe's (RECIPES)."""
    from fp8_forced import Forced
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.inputs import fed_inputs, sized_inputs
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8",
                          precision_overrides=overrides)
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, *tokens.shape))
    state = Fp8State(program.metadata["precision"])
    state.recording = True
    run = Forced(program.graph, params, torch.float32, fp8=state, records=records)
    inputs = fed_inputs(names, tokens.long(), None)
    for _ in range(steps):
        (logits,), frame = run.forward([inputs[n] for n in names])
        loss, seed = logits_cross_entropy(logits, next_token_labels(tokens.long()))
        _, grads = run.backward(frame, [seed])
        state.end_step()
    return run, float(loss), grads, state.state_dict()


def check_forced(run, records, loss, grads, histories, ref_loss, ref, ref_histories):
    """Node by node (tests/fp8_forced.py): every covered node of the step replayed, its
    output the emulation's product of its own inputs within bf16 output rounding, its
    inputs the emulation's within bf16 compute; then loss, gradients and histories."""
    from fp8_forced import rel

    assert run.checked == sum(len(v) for v in records.values()) > 0
    assert not any(run.records.values())
    assert run.worst["outputs"][0] < 2 ** -7, run.worst  # measured 0.2% (CPU, bf16)
    assert run.worst["inputs"][0] < 0.02, run.worst  # measured 0.4% (CPU, bf16)
    assert loss == pytest.approx(ref_loss, rel=0.01)
    for path, grad in ref.items():
        if path in grads:  # the fused LM head's gradient is handed on, not returned
            assert rel(grads[path], grad) < 0.02, path  # measured 0.4% (CPU, bf16)
    assert histories.keys() == ref_histories.keys()
    for key, history in ref_histories.items():  # the amaxes of the same bf16 operands
        torch.testing.assert_close(histories[key], history, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_bf16_arena_step_is_the_emulation_node_by_node(recipe, monkeypatch):
    """The GPU step's interpreter as the GPU runs it (bf16, the arena's planned bytes, the
    train kernels' concat views and out= GEMMs, each tensor quantized once a step; CPU
    tensors), two steps, against the emulation forced node by node, with the std recipe
    and with current scaling and E4M3 gradients. (End to end the two are as far apart as
    an unquantized step: FP8 on a tiny model is chaotic, tests/fp8_forced.py.)
    Per linear (4 a layer, 3 GEMMs each) 3 amaxes (x, W, dy; and the MLP's recomputed
    hidden) and 4 casts (x; W and W^T; dy and dy^T; x^T), where each use quantizing its
    operands took 6 and 6; 3 where the backward reads the forward's x (qkv, out, up: x
    and x^T in the forward's cast, x^T kept for the wgrad), not the recomputed hidden."""
    from fp8_forced import record
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
                          precision_overrides=RECIPES[recipe])
    names = source.program(planned=False).input_names()
    program = source.program_for(sized_inputs(names, 2, 16))
    g = torch.Generator().manual_seed(0)
    params = {p: torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0)
              for p, s in parameter_shapes(program.graph).items()}
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    state = StepFp8(program.metadata["precision"], "cpu", program.graph)
    assert state.recipe["gradient"] == ("fp8_e4m3" if RECIPES[recipe] else "fp8_e5m2")
    arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"], "cpu")
    passes = {"amax_of": 0, "cast": 0}  # each a pass over its operand
    for name in passes:
        def counted(*args, name=name, original=getattr(fp8_gemm, name)):
            passes[name] += 1
            return original(*args)
        monkeypatch.setattr(fp8_gemm, name, counted)
    records = record(state)
    for _ in range(2):  # std: the second scaled by the first's amaxes (delayed), no update
        run = _StepInterpreter(program.graph, {p: t.bfloat16() for p, t in params.items()},
                               torch.bfloat16, check_finite=False, keep_only_saved=True,
                               kernels=train_kernels("cpu"), arena=arena)
        run.fp8_run = state
        state.begin_step()
        inputs = fed_inputs(names, tokens, None)
        (logits,), frame = run.forward([inputs[n] for n in names])
        loss, seed = logits_cross_entropy(logits, next_token_labels(tokens))
        _, grads = run.backward(frame, [seed])
        state.end_step()
    monkeypatch.undo()
    forced, *ref = forced_emulation(params, tokens, records, steps=2,
                                    overrides=RECIPES[recipe])
    layers = int(TINY["n_layers"])  # qkv, out, up, down: forward, dgrad, wgrad each
    assert forced.checked == 2 * layers * 4 * 3
    assert passes == {"amax_of": 2 * layers * (4 * 3 + 1), "cast": 2 * layers * (4 * 4 - 3)}
    assert state.casts.counts["held"] == state.casts.counts["held_read"] == 2 * layers * 3
    restored = StepFp8(program.metadata["precision"], "cpu", program.graph)
    restored.load_state_dict(state.state_dict())  # shared rows: each key its history
    assert {k: v.tolist() for k, v in restored.state_dict().items()} == \
        {k: v.tolist() for k, v in state.state_dict().items()}
    check_forced(forced, records, float(loss), {p: t.float() for p, t in grads.items()},
                 state.state_dict(), *ref)


@needs_gpus(1)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_tiny_llama_fp8_step_on_cuda_is_the_cpu_emulation(recipe):
    """The GPU step with `--precision fp8` (bf16 compute, FP8 GEMMs, the cast kernels, the
    arena, each tensor quantized once) against the CPU emulation (float32) forced node by
    node (tests/fp8_forced.py), over two steps on the same weights (std: the second scaled
    by the first's amaxes, the delayed casts that take the amax in the same pass;
    current-e4m3: each operand by its own amax, the gradients in E4M3): each FP8 GEMM the
    emulation's product of the step's own operands, each operand what the emulation
    computes from the values upstream, then the same loss, gradients and amax histories
    within bf16 rounding."""
    from fp8_forced import record

    step, params, tokens = tiny_step(overrides=RECIPES[recipe])
    assert step.fp8.scales.kind == ("current" if RECIPES[recipe] else "delayed")
    records = record(step.fp8)
    step.set_batch(tokens.cuda())
    for _ in range(2):  # no update between: loss_and_gradients only
        step.fp8.begin_step()
        loss, grads = step.loss_and_gradients()
        step.fp8.end_step()
    grads = {p: g.float().cpu() for p, g in grads.items()}
    forced, *ref = forced_emulation(params, tokens, records, steps=2,
                                    overrides=RECIPES[recipe])
    check_forced(forced, records, float(loss), grads, step.fp8.state_dict(), *ref)


@needs_gpus(1)
def test_an_fp8_step_captures_in_a_cuda_graph():
    """Eager steps and graph replays of the same step give the same losses (the delayed
    scales are read from the device histories at each replay, not baked in), and the
    histories grow by one entry a replay."""
    eager, _, tokens = tiny_step()
    graphed, _, _ = tiny_step()
    tokens = tokens.cuda()
    eager_losses = [float(eager(tokens).clone()) for _ in range(4)]
    graphed_losses = [float(graphed(tokens).clone())]
    graphed.set_batch(tokens)
    graphed.capture(warmup=1)  # its warm-up is step 2
    graphed_losses.append(float(graphed.loss))
    graphed_losses += [float(graphed(tokens).clone()) for _ in range(2)]
    assert graphed.cuda_graph is not None
    assert graphed_losses == pytest.approx(eager_losses, rel=1e-3)
    assert all(len(h) == 4 for h in graphed.fp8.state_dict().values())
    for key, history in eager.fp8.state_dict().items():
        torch.testing.assert_close(graphed.fp8.state_dict()[key], history, rtol=1e-3, atol=0)
