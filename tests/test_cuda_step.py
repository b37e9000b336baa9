"""The GPU training step's parts that run anywhere (CPU, float64): the interpreter's
keep_only_saved, the LM-head split and the chunked fused LM head + cross-entropy, the
no-cast kernel registry. Their GPU runs are in tests/test_cuda_train.py."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.lm_head import (lm_head_cross_entropy, logits_cross_entropy,  # noqa: E402
                                  reference_loss, split_head)
from runtime.cuda.train_kernels import train_kernels  # noqa: E402
from runtime.interpreter import Interpreter  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime_models import TINY, token_inputs  # noqa: E402

F64 = torch.float64
DENSE_MODELS = ["llama", "llama_tied", "qwen3", "mistral", "example_llama"]


def _model(name: str) -> Model:
    path, settings = TINY[name]
    return Model.from_module(path, settings=settings, dtype=F64).init_random(seed=1)


def _grads(model, inputs, keep_only_saved=False, kernels=None):
    program = model.source.program_for(inputs)
    values = [model._input(inputs[n]) for n in program.input_names()]
    options = {"kernels": kernels} if kernels else {}
    run = Interpreter(program.graph, model.params, F64, keep_only_saved=keep_only_saved,
                      **options)
    outputs, frame = run.forward(values)
    seeds = [torch.randn(o.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
             for o in outputs]
    return outputs, run.backward(frame, seeds)[1], frame


@pytest.mark.parametrize("name", sorted(TINY))
def test_keep_only_saved_gives_the_same_gradients(name):
    model = _model(name)
    inputs = token_inputs(model)
    out_a, grads_a, _ = _grads(model, inputs)
    out_b, grads_b, frame = _grads(model, inputs, keep_only_saved=True)
    assert torch.equal(out_a[0], out_b[0])
    assert grads_a.keys() == grads_b.keys()
    for path in grads_a:
        assert torch.equal(grads_a[path], grads_b[path]), path
    assert not frame.children  # each layer's frame went with its backward


def test_keep_only_saved_drops_unsaved_values():
    model = _model("llama")
    program = model.source.program_for(token_inputs(model))
    run = Interpreter(program.graph, model.params, F64, keep_only_saved=True)
    _, frame = run.forward([token_inputs(model)["token_ids"]])
    block = next(iter(frame.children.values()))
    attention = next(iter(block.children.values()))
    kept = {v for v, t in attention.env.items() if t.stride() != (0,) * t.dim()}
    saved = {v for f in program.graph.functions
             if f.gradient_of == attention.function.name for v in f.saved}
    assert kept and kept <= saved | {"%12"}  # lse is one of the saved too
    assert len(attention.env) > len(kept)  # the rest are stand-ins


@pytest.mark.parametrize("name", sorted(TINY))
def test_train_kernels_match_the_reference_in_float64(name):
    model = _model(name)
    inputs = token_inputs(model)
    out_a, grads_a, _ = _grads(model, inputs)
    out_b, grads_b, _ = _grads(model, inputs, kernels=train_kernels("cpu"))
    assert torch.allclose(out_a[0], out_b[0], rtol=1e-12, atol=1e-12)
    for path in grads_a:
        assert torch.allclose(grads_a[path], grads_b[path], rtol=1e-10, atol=1e-12), path


def test_split_head_cuts_the_lm_head_matmul():
    graph = _model("llama").source.program_for(token_inputs(_model("llama"))).graph
    split = split_head(graph)
    assert split is not None and split.head_param == "lm_head"
    entry = split.graph.function(split.graph.entry)
    assert entry.nodes[-1].target == "fused_residual_rmsnorm"
    backward = split.graph.function(split.graph.backward)
    assert "lm_head" not in dict(backward.param_grads)
    assert backward.nodes[0].target != "matmul_backward"


@pytest.mark.parametrize("rows,chunk", [(12, 5), (16, 16), (7, 100)])
def test_fused_lm_head_cross_entropy_matches_autograd(rows, chunk):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 8, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=F64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (rows,), generator=g)
    labels[::3] = -100
    loss, d_x, d_w = lm_head_cross_entropy(x.detach(), w.detach(), labels, chunk)
    expected = reference_loss(x @ w.t(), labels)
    expected.backward()
    assert torch.allclose(loss, expected.float(), rtol=1e-6)
    assert torch.allclose(d_x, x.grad, rtol=1e-6, atol=1e-7)
    assert torch.allclose(d_w.double(), w.grad, rtol=1e-6, atol=1e-7)
    loss2, d_logits = logits_cross_entropy((x @ w.t()).detach(), labels, chunk)
    assert loss2.dtype == torch.float64  # float64 logits keep float64 (fp32 otherwise)
    assert torch.allclose(loss2.float(), expected.float(), rtol=1e-6)
    assert torch.allclose(d_logits @ w.detach(), x.grad, rtol=1e-6, atol=1e-7)


def test_split_program_gives_the_full_programs_gradients():
    """Cut head + fused CE == full logits + CE seed, on every parameter (float64)."""
    model = _model("llama")
    inputs = token_inputs(model, batch=2, seq=8)
    tokens = inputs["token_ids"]
    labels = torch.full(tokens.shape, -100, dtype=torch.int64)
    labels[:, :-1] = tokens[:, 1:]
    graph = model.source.program_for(inputs).graph
    full = Interpreter(graph, model.params, F64)
    (logits,), frame = full.forward([tokens])
    loss, d_logits = logits_cross_entropy(logits, labels, 5)
    _, expected = full.backward(frame, [d_logits.to(F64)])
    split = split_head(graph)
    cut = Interpreter(split.graph, model.params, F64)
    (xF,), frame = cut.forward([tokens])
    loss2, d_xF, d_head = lm_head_cross_entropy(xF, model.params["lm_head"], labels, 5)
    _, grads = cut.backward(frame, [d_xF])
    grads["lm_head"] = d_head.to(F64)
    assert torch.allclose(loss.float(), loss2)  # the unfused path keeps float64
    assert expected.keys() == grads.keys()
    for path in expected:  # the fused head computes in fp32, the unfused path in float64
        assert torch.allclose(expected[path], grads[path], rtol=1e-5, atol=1e-7), path


def test_tied_head_is_left_unfused_or_cut_correctly():
    graph = _model("llama_tied").source.program_for(token_inputs(_model("llama_tied"))).graph
    split = split_head(graph)
    assert split is None or split.head_param == "embedding"


# ---------------------------------------------------------------- memory budget (planner)
def _budgeted(name: str, derive_written: bool, share: float):
    """The tiny model's program built with a budget between the planner's keep-all peak
    and the lowest it reaches (`share` of the way up), on the no-swap profile."""
    from runtime.cuda.step import budget_programs

    path, settings = TINY[name]
    model = _model(name)
    inputs = token_inputs(model, batch=2, seq=16)
    program, planned, _ = budget_programs(path, settings, inputs, share, derive_written)
    return model, inputs, program, planned


def test_noswap_profile_plans_recompute_only():
    from modulec.plan.budget import make_problem, no_recompute, plan_budget
    from modulec.plan.devices import device

    model = _model("llama")
    graph = model.source.program_for(token_inputs(model, batch=2, seq=16)).graph
    for name in ("h200", "h200-noswap"):
        problem = make_problem(graph, None, "full", device(name))
        high = no_recompute(problem).peak_bytes
        result = plan_budget(problem, int(high * 0.97))
        if name == "h200-noswap":
            assert result.feasible and not result.swap and result.recompute
    assert device("h200-noswap").peak_flops == device("h200").peak_flops
    assert device("h200-noswap").host_bytes_per_s == 0


@pytest.mark.parametrize("derive_written", [True, False])
def test_budgeted_step_releases_early_and_gives_the_same_gradients(derive_written):
    """The GPU step's interpreter (early release of `recompute` values as each forward
    run returns, keep_only_saved, TRAIN_KERNELS) on a budgeted build, float64 on the CPU:
    the same outputs and gradients as the unbudgeted program, bit for bit."""
    from runtime.cuda.step import _StepInterpreter
    from runtime.decisions import Decisions

    model, inputs, program, planned = _budgeted("llama", derive_written, 0.3)
    decisions = Decisions.from_schedule(planned.document["schedule"])
    assert decisions is not None and not any(
        kind == "swap" for runs in decisions.table.values() for kind, _, _ in runs)
    tokens = inputs["token_ids"]
    seed = None
    results = []
    released_early = []
    for graph, decided in ((program.graph, None), (planned.graph, decisions)):
        run = _StepInterpreter(graph, model.params, F64, check_finite=False,
                               kernels=train_kernels("cpu"), keep_only_saved=True,
                               decisions=decided)
        if decided is not None:  # layer 0's values are gone before layer 1 runs
            original = run._run

            def spy(frame, args, forward, original=original):
                if frame.instance == 1 and frame.function.name.startswith("DenseTransformer"):
                    released_early.append(decided.counts["dropped"])
                return original(frame, args, forward)
            run._run = spy
        (out,), frame = run.forward([tokens])
        if decided is not None:  # every run of the tree kept only its saved / replay inputs
            stack = [frame]
            while stack:
                run_frame = stack.pop()
                stack += run_frame.children.values()
                if run_frame is frame:
                    continue
                kept = run._kept(run_frame.function.name)
                real = {v for v, t in run_frame.env.items()
                        if t.numel() > 1 and t.stride() != (0,) * t.dim()}
                assert real <= kept, (run_frame.function.name, real - kept)
                assert not real & run_frame.dropped
        if seed is None:
            seed = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
        _, grads = run.backward(frame, [seed])
        results.append((out, grads))
    assert released_early and released_early[0] > 0
    assert decisions.counts["recomputed"] > 0
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for path in grads_a:
        assert torch.allclose(grads_a[path], grads_b[path], rtol=1e-12, atol=1e-14), path


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_budgeted_step_holds_no_released_storage(share):
    """What the planner counts as released is released: after the forward of a budgeted
    step (the GPU step's interpreter, float64 on the CPU), no tensor the decisions dropped
    shares storage with anything the frame tree still holds. (A block's norm output is a
    callee's `x`: keep_only_saved used to replace the block's own reference by a stand-in
    before the release, so the callee's copy was not forgotten and stayed to the
    backward.) Its gradients stay the unbudgeted program's."""
    from runtime.cuda.step import _StepInterpreter
    from runtime.decisions import Decisions

    model, inputs, program, planned = _budgeted("llama", True, share)
    decisions = Decisions.from_schedule(planned.document["schedule"])
    run = _StepInterpreter(planned.graph, model.params, F64, check_finite=False,
                           kernels=train_kernels("cpu"), keep_only_saved=True,
                           decisions=decisions)
    made = []  # every value decided `recompute`, as its forward op made it
    dispatch = run._dispatch

    def spy(node, frame, forward):
        dispatch(node, frame, forward)
        if node.kind == "op" and not frame.function.gradient_of:
            for value in node.outputs:
                tensor = frame.env.get(value)
                if (value and decisions.of(frame.function.name, value, frame.instance)
                        == "recompute" and isinstance(tensor, torch.Tensor)):
                    made.append((frame.function.name, value, tensor))
    run._dispatch = spy
    (out,), frame = run.forward([inputs["token_ids"]])
    run._dispatch = dispatch
    held, stack = {}, [frame]
    while stack:
        run_frame = stack.pop()
        stack += run_frame.children.values()
        for value, tensor in run_frame.env.items():
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 1 and any(tensor.stride()):
                held[tensor.untyped_storage().data_ptr()] = (run_frame.function.name, value)
    assert made
    still = [(name, value, held[t.untyped_storage().data_ptr()]) for name, value, t in made
             if t.untyped_storage().data_ptr() in held]
    made.clear()  # release the tensors before the backward below
    assert not still, still[:4]
    seed = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    _, grads = run.backward(frame, [seed])
    reference = Interpreter(program.graph, model.params, F64, keep_only_saved=True)
    (out_ref,), frame_ref = reference.forward([inputs["token_ids"]])
    _, grads_ref = reference.backward(frame_ref, [seed])
    assert torch.allclose(out, out_ref, rtol=1e-12, atol=1e-14)
    for path in grads_ref:
        assert torch.allclose(grads[path], grads_ref[path], rtol=1e-10, atol=1e-12), path


# ------------------------------------------------------------------ LoRA (frozen base)
ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def _lora_model(name: str = "llama") -> Model:
    path, settings = TINY[name]
    model = Model.from_module(path, settings=settings, dtype=F64,
                              lora=dict(rank=4, alpha=8, targets=ALL_TARGETS)).init_random(1)
    g = torch.Generator().manual_seed(2)
    for p, t in model.params.items():  # B != 0, so that A's gradients mean something
        if p.endswith("lora_B"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g, dtype=F64))
    return model


@pytest.mark.parametrize("mode", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("batched", [False, True])
def test_matmul_grads_computes_only_the_wanted_gradient(mode, batched):
    from runtime.cuda.train_kernels import matmul_grads
    from runtime.kernels import KERNELS

    g = torch.Generator().manual_seed(0)
    lead = (2,) if batched else (3,)
    a_shape = (*lead, 5, 4) if mode[0] == "N" else (*lead, 4, 5)
    b_shape = (4, 6) if mode[1] == "N" else (6, 4)
    if not batched:
        a_shape = a_shape[1:] if mode[0] == "T" else a_shape
    A = torch.randn(a_shape, generator=g, dtype=F64)
    B = torch.randn(b_shape, generator=g, dtype=F64)
    name = "batched_matmul" if batched else "matmul"
    attrs = {"transpose": mode} | ({} if batched else {"alpha": 0.5})
    (C,) = KERNELS[name].forward_fn(A, B, **attrs)
    d_C = torch.randn(C.shape, generator=g, dtype=F64)
    ref = KERNELS[name].backward_fn(d_C, A, B, **attrs)
    d_A, none = matmul_grads(d_C, A, B, wanted=(True, False), batched=batched, **attrs)
    assert none is None and torch.allclose(d_A, ref[0])
    none, d_B = matmul_grads(d_C, A, B, wanted=(False, True), batched=batched, **attrs)
    assert none is None and torch.allclose(d_B, ref[1])


def test_lora_step_interpreter_skips_frozen_weight_gradients():
    """The GPU step's interpreter with the train kernels (on the CPU, float64): a frozen
    base weight's matmul backward is told its d_B is unwanted and computes d_A alone; the
    gradients are the reference's, the adapters' only."""
    from runtime.cuda.step import _StepInterpreter, frozen_paths
    from runtime.lora import adapter_params

    model = _lora_model()
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    _, ref, _ = _grads(model, inputs)
    kernels = train_kernels("cpu")
    matmul, wanted = kernels["matmul"], []
    original = matmul.backward

    def recording(inputs, attrs):
        asked = attrs.get("wanted_outputs")
        outputs = original(inputs, attrs)
        wanted.append((asked, tuple(o is not None for o in outputs)))
        return outputs

    matmul.backward = recording
    run = _StepInterpreter(program.graph, model.params, F64, check_finite=False,
                           kernels=kernels, keep_only_saved=True, decisions=None)
    outputs, frame = run.forward([model._input(inputs["token_ids"])])
    seeds = [torch.randn(o.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
             for o in outputs]
    _, grads = run.backward(frame, seeds)
    assert set(grads) == set(ref) == set(adapter_params(model))
    assert frozen_paths(program) == set(model.params) - set(grads)
    for path in ref:
        assert torch.allclose(grads[path], ref[path], rtol=1e-10, atol=1e-12), path
    skipped = [w for w in wanted if w == ((True, False), (True, False))]
    # the LM head asked with d_B unwanted and answering without it; the 4 frozen layer
    # matmuls (qkv, out, up, down) x 2 layers make d_x alone as an addmm into the adapter
    # path's d_x (runtime/cuda/lora_backward.py), not through the kernel; every other one
    # computes both
    assert len(skipped) == 1 and run.lora_dx_fused == 4 * 2, wanted
    assert all(w == (None, (True, True)) for w in wanted if w not in skipped), wanted


def test_lora_fixed_state_counts_frozen_weights_at_their_compute_copy():
    from runtime.cuda.step import frozen_paths, runtime_fixed_bytes
    from runtime.model import parameter_shapes

    model = _lora_model()
    program = model.source.program_for(token_inputs(model))
    shapes = parameter_shapes(program.graph)
    frozen = frozen_paths(program)
    count = lambda paths: sum(torch.Size(shapes[p]).numel() for p in paths)  # noqa: E731
    adapters = set(shapes) - frozen
    assert adapters and all(p.endswith(("lora_A", "lora_B")) for p in adapters)
    # + the spare columns the one-GEMM path lays beside each layer's gate/up rows (2 x 4
    # ranks: runtime/cuda/lora_kcat.py), the 8 spare rows after them (its d_x's) and that
    # d_x's scratch, [tokens, out + 8] (one for both layers)
    up = [shapes[f"blocks[{i}].mlp.up_weight"] for i in (0, 1)]
    tokens = math.prod(token_inputs(model)["token_ids"].shape)
    sides = 2 * sum(rows * 8 + 8 * cols for rows, cols in up) + 2 * tokens * (up[0][0] + 8)
    # + each layer's q/k/v and gate/up block-diagonal B in its slot, outside the plan
    # (runtime/cuda/stacked_blocks.py: [q + k + v rows, 3 x 4] and [gate + up rows, 2 x 4])
    b_rows = lambda i, parts: sum(shapes[f"blocks[{i}].{p}.lora_B"][0] for p in parts)  # noqa: E731
    blocks = 2 * sum(12 * b_rows(i, ["attention.qkv_weight." + p for p in "qkv"]) +
                     8 * b_rows(i, ["mlp.up_weight.gate", "mlp.up_weight.up"]) for i in (0, 1))
    assert runtime_fixed_bytes(program) == \
        12 * count(adapters) + 2 * count(frozen) + sides + blocks
    plain = _model("llama").source.program_for(token_inputs(model))
    assert frozen_paths(plain) == set()


def test_fused_lm_head_without_the_head_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 8, generator=g, dtype=F64)
    w = torch.randn(16, 8, generator=g, dtype=F64)
    labels = torch.randint(0, 16, (2, 9), generator=g)
    loss, d_x, d_w = lm_head_cross_entropy(x, w, labels, chunk_rows=4)
    frozen = lm_head_cross_entropy(x, w, labels, chunk_rows=4, head_grad=False)
    assert frozen[2] is None and torch.equal(frozen[0], loss) and torch.equal(frozen[1], d_x)


@pytest.mark.parametrize("keep_only_saved", [False, True])
def test_lora_delta_runs_as_one_addmm_with_the_same_gradients(keep_only_saved, monkeypatch):
    """The GPU step's interpreter runs each LoRA `d = matmul(t, B, alpha)` + `y = add(base,
    d)` as one addmm into base (d never materialized): 4 adapted matmuls (qkv, out, up,
    down) x 2 layers; outputs and adapter gradients match the unfused run (float64)."""
    import runtime.cuda.step_interpreter as step_module
    from runtime.cuda.step_interpreter import LoraPairs, _StepInterpreter, lora_addmm_pairs

    model = _lora_model()
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    pairs = [lora_addmm_pairs(f) for f in program.graph.functions]
    assert sum(len(p.adds) for p in pairs) == 4  # per block function: qkv, out, up, down
    assert all(inplace for p in pairs for _, inplace in p.adds.values())

    def run(fused: bool):
        if not fused:
            monkeypatch.setattr(step_module, "lora_addmm_pairs", lambda *a: LoraPairs())
        interp = _StepInterpreter(program.graph, model.params, F64, check_finite=False,
                                  kernels=train_kernels("cpu"),
                                  keep_only_saved=keep_only_saved, decisions=None)
        outputs, frame = interp.forward([model._input(inputs["token_ids"])])
        seeds = [torch.randn(o.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
                 for o in outputs]
        _, grads = interp.backward(frame, seeds)
        monkeypatch.undo()
        return interp.lora_fused, outputs, grads

    count, outputs, grads = run(True)
    none, ref_outputs, ref = run(False)
    assert (count, none) == (4 * 2, 0)
    assert set(grads) == set(ref) and ref
    for a, b in zip(outputs, ref_outputs):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    for path in ref:
        assert torch.allclose(grads[path], ref[path], rtol=0, atol=1e-12), path


def _float_bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_split_master_is_exact_and_its_top_half_is_the_rounded_value():
    """runtime/cuda/state.py: a master as bf16 top half + int16 low half joins back to the
    same fp32 bits (every exponent, signs, zeros, infinities, subnormals, the largest
    finite); the top half is round-to-nearest-even but for exact ties, which it rounds
    away from zero (low half -2^15)."""
    from runtime.cuda.state import joined_master, split_master

    g = torch.Generator().manual_seed(0)
    scale = torch.float_power(10.0, torch.randint(-40, 39, (50_000,), generator=g)).float()
    edges = [0.0, -0.0, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1e-39,
             float("inf"), float("-inf")]
    ties = torch.randint(0, 0x7F7F, (2_000,), generator=g) << 16 | 0x8000  # finite
    values = torch.cat([torch.randn(50_000, generator=g) * scale, torch.tensor(edges),
                        _float_bits(ties.tolist()), -_float_bits(ties.tolist())])
    hi = torch.empty(values.shape, dtype=torch.bfloat16)
    lo = torch.empty(values.shape, dtype=torch.int16)
    split_master(values, hi, lo)
    assert torch.equal(joined_master(hi, lo).view(torch.int32), values.view(torch.int32))
    differs = hi.view(torch.int16) != values.to(torch.bfloat16).view(torch.int16)
    assert differs.any() and bool((lo[differs] == -2**15).all())
    away = hi[differs].float().abs() > values[differs].abs()
    assert bool(away.all())


def test_split_masters_join_one_path_at_a_time():
    from runtime.cuda.state import SplitMasters, split_master

    values = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    compute = {p: torch.empty(v.shape, dtype=torch.bfloat16) for p, v in values.items()}
    lows = {p: torch.empty(v.shape, dtype=torch.int16) for p, v in values.items()}
    for p, v in values.items():
        split_master(v, compute[p], lows[p])
    masters = SplitMasters(compute, lows)
    assert sorted(masters) == ["a", "b"] and len(masters) == 2
    assert all(torch.equal(masters[p], v) for p, v in values.items())
    assert all(torch.equal(masters.on("cpu")[p], v) for p, v in values.items())
