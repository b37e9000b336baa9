"""The GPU step's LoRA paths that run anywhere (CPU, bf16 on the arena): nothing copied into
the arena for the adapted projections' adds or the block-diagonal B, the same bits as the
step's kernels without those paths; the add kernel's bits; the batched gradient norm; the
first weights (`random_params`: adapters as PEFT makes them). decisions.md, "LoRA step
copies"; the GPU runs: tests/test_cuda_annotations.py, benchmarks/gpu/profile_step.py."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")

import runtime.arena as arena_module  # noqa: E402
import runtime.cuda.step_interpreter as step_module  # noqa: E402
from runtime.cuda.train_kernels import Add, train_kernels  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime_models import TINY, token_inputs  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
BF16 = torch.bfloat16


def _lora_model(rank: int = 4) -> Model:
    path, settings = TINY["llama"]
    model = Model.from_module(path, settings=settings, dtype=BF16,
                              lora=dict(rank=rank, alpha=2 * rank, targets=ALL_TARGETS))
    model.init_random(1, std=0.3)
    g = torch.Generator().manual_seed(2)
    for p, t in model.params.items():  # B != 0: the deltas mean something
        if p.endswith("lora_B"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model


def _arena_step(model, monkeypatch, planned: bool, device: str = "cpu", params=None,
                inputs=None, decisions=None):
    """One forward + backward of the step's interpreter on the arena (CPU, bf16): outputs,
    gradients, the interpreter, and the (function, value, op) of each copy into the arena.
    `planned=False`: the kernels and LoRA pairs as they were before (the reference add,
    zeros and concat made elsewhere and copied in, base's matmul not deferred)."""
    inputs = inputs or token_inputs(model)
    program = model.source.program_for(inputs)
    kernels = train_kernels(device)
    if not planned:
        kernels["add"] = KERNELS["add"]
        for name in ("zeros", "concat", "block_diag"):
            kernels[name].takes_out = False
        found = step_module.lora_addmm_pairs

        def without_bases(*args):
            pairs = found(*args)
            pairs.deferred -= {source.id for source in pairs.bases.values()}
            pairs.bases = {}
            return pairs
        monkeypatch.setattr(step_module, "lora_addmm_pairs", without_bases)
        monkeypatch.setattr(step_module, "lora_dx_pairs", lambda *_: step_module.DxPairs())
    copies = collections.Counter()
    place = arena_module.Arena.place

    def counted(self, frame, node, value, tensor):
        placed = place(self, frame, node, value, tensor)
        if isinstance(tensor, torch.Tensor) and placed.data_ptr() != tensor.data_ptr():
            copies[(frame.function.name, value, node.target if node else None)] += 1
        return placed
    monkeypatch.setattr(arena_module.Arena, "place", counted)
    arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"], device,
                               parameter_views=True)
    if params is None:
        params = {p: t.to(device) for p, t in model.params.items()}
    run = step_module._StepInterpreter(program.graph, params, BF16, check_finite=False,
                                       kernels=kernels, keep_only_saved=True,
                                       decisions=decisions, arena=arena)
    outputs, frame = run.forward([model._input(inputs["token_ids"]).to(device)])
    _, grads = run.backward(frame, [torch.full_like(o, 0.01) for o in outputs])
    monkeypatch.undo()
    return outputs, grads, run, copies


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_lora_step_on_the_arena_writes_the_adds_and_block_diagonal_B_where_planned(
        monkeypatch, device):
    """On the GPU too (its custom kernels, cuBLAS): the old path's values to bf16 rounding
    (the delta is now written first and base's GEMM adds into it; the backward's d_x
    sums are addmms: the roundings differ, not the sums)."""
    model = _lora_model()
    outputs, grads, run, copies = _arena_step(model, monkeypatch, True, device)
    ref_outputs, ref, ref_run, ref_copies = _arena_step(model, monkeypatch, False, device)
    exact_outputs, exact, _ = _reference_step(model)  # float32, the reference kernels
    assert set(grads) == set(ref) == set(exact)
    triples = [*zip(outputs, ref_outputs, exact_outputs),
               *((grads[p], ref[p], exact[p]) for p in exact)]
    assert all(got.shape == old.shape and got.dtype == old.dtype for got, old, _ in triples)
    # as close to float32 as the old path's roundings were: a tiny model at std 0.3 spreads
    # bf16 rounding to 1-8% of a tensor's largest value on both paths (which one is
    # nearer varies tensor by tensor), ~3% on average
    new = [_error(got, want) for got, _, want in triples]
    was = [_error(old, want) for _, old, want in triples]
    assert max(new) < 0.1 and max(was) < 0.1, (new, was)
    # qkv, out, up, down x 2 layers: the delta into y's bytes, base's GEMM added there;
    # each d_x sum: the adapter path's d_x in the sum's bytes, base's d_x GEMM added there
    assert (run.lora_fused, run.lora_into_planned, run.lora_dx_fused) == (8, 8, 8)
    assert (ref_run.lora_fused, ref_run.lora_into_planned, ref_run.lora_dx_fused) == (8, 0, 0)
    by_op = lambda counts, op: sum(n for (_, _, o), n in counts.items() if o == op)  # noqa
    assert by_op(ref_copies, "add") > 0
    assert by_op(copies, "add") == by_op(copies, "block_diag") == 0, copies
    # concat_backward's parts are views of the stacked gradient (the planner aliases them,
    # as split's); the stacked d_A is in bytes of its own (its row blocks, the A
    # gradients, are handed as they are); block_diag's backward writes each B gradient
    # in a tensor of its own (one kernel): no gradient is copied
    graph = model.source.program_for(token_inputs(model)).graph
    made = collections.Counter(n.target for f in graph.functions for n in f.nodes)
    assert made["block_diag"] == made["block_diag_backward"] == 2
    assert not [v for _, v, op in copies if op in ("concat_backward", "block_diag_backward")]
    assert run.lora_dx_fused == 8
    assert sum(copies.values()) < sum(ref_copies.values())


def test_the_stacked_A_is_a_view_of_the_parts_laid_side_by_side(monkeypatch):
    """The GPU step lays the parameters a dim-0 concat stacks side by side, in its order
    (runtime/cuda/state.py `stacked_order`: LoRA's q, k, v and gate, up A of each layer):
    the stacked A is then a view of them, neither concatenated nor copied into the arena,
    and the step's values are those of separate parameters, bit for bit."""
    from runtime.cuda.state import region_of, stacked_order

    model = _lora_model()
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    order = stacked_order(model.source.program_for(token_inputs(model)).graph, sorted(shapes))
    assert sorted(order) == sorted(shapes)
    for layer in ("0", "1"):
        at = [order.index(p) for p in order if p.startswith(f"blocks[{layer}].")
              and "qkv_weight" in p and p.endswith("lora_A")]
        names = [order[i].split(".")[-2] for i in at]
        assert names == ["q", "k", "v"] and at == list(range(at[0], at[0] + 3)), names
    _, (views,) = region_of(shapes, [(BF16, order)], device="cpu")
    for path, view in views.items():
        view.copy_(model.params[path])
    import runtime.cuda.train_kernels as train_module

    stacked, cat_into = [], train_module._cat_into

    def counted(parts, dim, out):  # the dim-0 concats that copy (none where they join)
        stacked.append(dim % 2 == 0)
        return cat_into(parts, dim, out)
    monkeypatch.setattr(train_module, "_cat_into", counted)
    outputs, grads, run, copies = _arena_step(model, monkeypatch, True, params=views)
    laid_out = stacked.count(True)
    monkeypatch.setattr(train_module, "_cat_into", counted)  # _arena_step undid it
    want_outputs, want, _, _ = _arena_step(model, monkeypatch, True)
    assert laid_out == 0 and stacked.count(True) == 4  # 2 layers x (qkv, gate_up)
    assert not [v for _, v, op in copies if op == "concat"], copies
    assert all(torch.equal(a, b) for a, b in zip(outputs, want_outputs))
    assert set(grads) == set(want) and all(torch.equal(grads[p], want[p]) for p in want)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (0 where both are 0), in float32, on the CPU."""
    a, b = a.float().cpu(), b.float().cpu()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float(a.abs().max())


def _errors_beside_two_gemms(model, monkeypatch, device, outputs, grads):
    """(new, was, the two-GEMM run): each output's and gradient's error against float32
    (`_error`) for the run given and for the step on weights laid without side slots or
    tail rows (the two-GEMM paths)."""
    two_outputs, two_grads, two_run, _ = _arena_step(model, monkeypatch, True, device)
    exact_outputs, exact, _ = _reference_step(model)
    triples = [*zip(outputs, two_outputs, exact_outputs),
               *((grads[p], two_grads[p], exact[p]) for p in exact)]
    new = [_error(got, want) for got, _, want in triples]
    was = [_error(old, want) for _, old, want in triples]
    return new, was, two_run


def _reference_step(model, fused_dx: bool = False):
    """The forward + backward in float32 through the reference interpreter and kernels
    (`fused_dx`: the GPU step's interpreter off the arena, train kernels, its LoRA paths)."""
    from runtime.interpreter import Interpreter

    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    params = {p: t.float() for p, t in model.params.items()}
    if fused_dx:
        run = step_module._StepInterpreter(program.graph, params, torch.float32,
                                           check_finite=False, kernels=train_kernels("cpu"),
                                           keep_only_saved=True, decisions=None)
    else:
        run = Interpreter(program.graph, params, torch.float32, check_finite=False)
    outputs, frame = run.forward([model._input(inputs["token_ids"])])
    _, grads = run.backward(frame, [torch.full_like(o, 0.01) for o in outputs])
    return outputs, grads, run


def test_lora_dx_sums_off_the_arena_are_addmms_into_the_adapter_paths_d_x():
    """No arena: each adapted projection's d_x sum is the frozen weight's d_x GEMM added
    into the adapter path's d_x (it has no other reader); float32 values as the reference's."""
    model = _lora_model()
    outputs, grads, run = _reference_step(model, fused_dx=True)
    ref_outputs, ref, _ = _reference_step(model)
    assert run.lora_dx_fused == 8  # qkv, out, up, down x 2 layers
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(outputs, ref_outputs))
    assert set(grads) == set(ref)
    assert all(_error(grads[p], ref[p]) < 1e-4 for p in ref), \
        {p: _error(grads[p], ref[p]) for p in ref}


def test_lora_dx_pairs_are_the_adapted_projections_sums():
    """Found in the IR: per adapted projection, the add of the adapter path's d_x and the
    frozen weight's (its matmul_backward right before the add, deferred to it)."""
    from runtime.cuda.lora_backward import lora_dx_pairs

    model = _lora_model()
    graph = model.source.program_for(token_inputs(model)).graph
    found = {f.name: lora_dx_pairs(f) for f in graph.functions}
    backward = {name: p for name, p in found.items() if name.endswith(".backward") and p.adds}
    assert sorted(len(p.adds) for p in backward.values()) == [2, 2]  # attention, MLP
    for pairs in backward.values():
        for pair in pairs.adds.values():
            assert pair.base in pair.between and pair.base.outputs[1] == ""
            assert pair.base.inputs[2].startswith("param:")
            assert pair.first.outputs[0] in pair.add.inputs
            assert pair.base.id in pairs.deferred and pairs.firsts[pair.first.id] is pair
    assert not any(p.adds for name, p in found.items() if not name.endswith(".backward"))
    excluded = lora_dx_pairs(next(graph.function(n) for n in backward),
                             frozenset(pair.base.id for p in backward.values()
                                       for pair in p.adds.values()))
    assert not excluded.adds  # an FP8-covered base GEMM stays as written


def test_add_kernel_gives_the_references_bits_without_the_fp32_round_trip():
    add = Add(KERNELS["add"])
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(6, 33, generator=g).to(BF16) for _ in range(2))
    (ref,) = KERNELS["add"].forward([a, b], {})
    assert torch.equal(add.forward([a, b], {})[0], ref)
    raw = torch.empty(a.nbytes + 64, dtype=torch.uint8)  # planned bytes: written there
    (y,) = add.forward([a, b], {"out": [raw]})
    assert torch.equal(y, ref) and y.data_ptr() == raw.data_ptr()
    mixed = [a, b.double()]  # operands of two dtypes: the reference's cast rules
    assert torch.equal(add.forward(mixed, {})[0], KERNELS["add"].forward(mixed, {})[0])
    d_y = torch.randn(6, 33, generator=g).to(BF16)
    same = {"input_shapes": {"a": (6, 33), "b": (6, 33)}}
    assert all(d is d_y for d in add.backward([d_y], same))  # the identity, no copies
    for b_shape in ((33,), ()):  # broadcast: summed as the reference does
        attrs = {"input_shapes": {"a": (6, 33), "b": b_shape}}
        got = add.backward([d_y], dict(attrs))
        want = KERNELS["add"].backward([d_y], dict(attrs))
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        assert tuple(got[1].shape) == b_shape


def test_each_update_hands_its_kernel_the_norms_sum(monkeypatch):
    """TrainStep._update (no global clipping): the update's AdamW kernel gets the step's
    fp64 squares sum (`norm`), the LM head's gradient in the activations' bytes as any
    other (the kernel reads it at once, before the backward reuses those bytes): the
    norm costs no pass of its own over the gradients (csrc/kernels/adamw.cu)."""
    import types

    import runtime.train.param_groups as groups
    from runtime.cuda.step import AdamWConfig, TrainStep
    from runtime.cuda.step_optim import NormSquares

    monkeypatch.setattr(groups, "hyperparameters", lambda program, path, a: (1.0, 0.0, None))
    applied = []
    norms = NormSquares("cpu")
    step = types.SimpleNamespace(
        zero=None, program=None, adamw=AdamWConfig(), _norms=norms,
        _apply=lambda path, grad, scale, norm=None: applied.append((path, scale, norm)))
    TrainStep._update(step, "head", torch.full((16,), 3.0, dtype=BF16))
    TrainStep._update(step, "w", torch.full((25,), 1.0, dtype=BF16))
    assert [(p, s) for p, s, _ in applied] == [("head", None), ("w", None)]
    assert all(norm is norms.fused for _, _, norm in applied)
    norms.fused.fill_(16 * 9.0 + 25 * 1.0)  # what the two kernels would have added
    out = torch.zeros(1)
    norms.norm_into(out)
    assert float(out) == 13.0 and out.dtype == torch.float32
    norms.zero()
    assert float(norms.fused) == 0.0


def test_random_params_make_adapters_as_peft_does():
    """The GPU step's first weights (TrainStep.init_random) for a LoRA'd model: B = 0 (the
    model starts as the base model, as Model.init_random and PEFT do), A ~ U(+-1/sqrt(in));
    the base weights are the draws without LoRA."""
    from runtime.cuda.step import random_params

    path, settings = TINY["llama"]
    lora = Model.from_module(path, settings=settings, lora=dict(rank=4, alpha=8))
    plain = Model.from_module(path, settings=settings)
    params = random_params(lora.parameter_shapes(), seed=3, on="cpu")
    base = random_params(plain.parameter_shapes(), seed=3, on="cpu")
    adapters = {p: t for p, t in params.items() if p not in base}
    assert adapters and all(p.endswith(("lora_A", "lora_B")) for p in adapters)
    for p, t in adapters.items():
        if p.endswith("lora_B"):
            assert torch.count_nonzero(t) == 0, p
        else:
            bound = 1 / t.shape[1] ** 0.5
            assert 0 < float(t.abs().max()) <= bound and float(t.std()) > bound / 4, p
    assert all(torch.equal(params[p], base[p]) for p in base)


def test_lora_matmul_into_writes_the_delta_then_adds_base_in_the_gemm():
    """y = x W^T + s t B^T in given bytes (the delta's GEMM writes them, base's adds into
    them with beta = 1); a matmul's alpha is the GEMM's (product_into: no second pass)."""
    from runtime.cuda.train_kernels import lora_matmul_into, product_into

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 12, generator=g), torch.randn(7, 12, generator=g)
    t, b = torch.randn(2, 5, 3, generator=g), torch.randn(7, 3, generator=g)
    raw = torch.full((2 * 5 * 7 * 4 + 16,), 255, dtype=torch.uint8)  # NaN bytes: not read
    y = lora_matmul_into(x, w, {"transpose": "NT", "alpha": 0.5}, t, b, 2.0, raw)
    assert y.shape == (2, 5, 7) and y.data_ptr() == raw.data_ptr()
    torch.testing.assert_close(y, 0.5 * x @ w.T + 2.0 * t @ b.T)
    assert lora_matmul_into(x, w, {"transpose": "NT"}, t, b.T, 2.0, raw) is None  # misfit
    assert lora_matmul_into(x, w, {"transpose": "NT"}, t.double(), b, 2.0, raw) is None
    raw[:] = 255
    c = product_into(x[0], w, "NT", 3.0, raw)
    torch.testing.assert_close(c, 3.0 * x[0] @ w.T)


def test_lora_dx_is_not_redirected_into_bytes_a_later_node_still_reads(monkeypatch):
    """The add's planned bytes made to hold the adapter path's own input (d_t, read by the
    node that would write there): no redirection, the nodes run as written, same values."""
    import runtime.cuda.lora_backward as lora_backward

    refused = []
    check = lora_backward.target_bytes

    def tampered(run, pair, frame, forward):
        victim = frame.env[pair.first.inputs[0]].contiguous()
        frame.env[pair.first.inputs[0]] = victim
        out_bytes = run.arena.out_bytes
        run.arena.out_bytes = lambda f, node, value: (
            victim.reshape(-1).view(torch.uint8) if node is pair.add
            else out_bytes(f, node, value))
        try:
            refused.append(check(run, pair, frame, forward) is None)
        finally:
            run.arena.out_bytes = out_bytes
        return None if refused[-1] else check(run, pair, frame, forward)

    model = _lora_model()
    with monkeypatch.context() as patch:
        patch.setattr(step_module, "target_bytes", tampered)
        outputs, grads, run, _ = _arena_step(model, patch, True)
    ref_outputs, ref, _, _ = _arena_step(model, monkeypatch, True)
    assert refused == [True] * 8 and run.lora_dx_fused == 0
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))  # the same forward
    assert all(_error(grads[p], ref[p]) < 2e-2 for p in ref)


def test_small_adamw_updates_are_run_sixteen_a_launch(monkeypatch):
    """step_optim.AdamWBatch (the extension faked: its calls recorded): lists of up to 16
    of one gradient dtype, scale and norms' sum, each tensor with its own rate factor and
    decay; a
    gradient in the activation arena (the LM head's, before the backward) flushes at once;
    `flush` runs what is left."""
    import types

    import runtime.cuda.kernels as cuda_kernels
    import runtime.train.param_groups as groups
    from runtime.cuda.step import AdamWConfig
    from runtime.cuda.step_optim import AdamWBatch

    calls = []
    fake = types.SimpleNamespace(adamw_split_list=lambda *a: calls.append(a))
    monkeypatch.setattr(cuda_kernels, "_extension", lambda: fake)
    monkeypatch.setattr(groups, "lr_scale", lambda program, path: 2.0 if path == "p3" else 1.0)
    monkeypatch.setattr(groups, "decay_scale", lambda program, path, a: 0.0 if path == "p4"
                        else 1.0)
    paths = [f"p{k}" for k in range(40)]
    tensors = {p: torch.zeros(4) for p in paths}
    arena_bytes = torch.zeros(64, dtype=BF16)

    class Arena:
        def _in_arena(self, tensor):
            return tensor.untyped_storage().data_ptr() == arena_bytes.untyped_storage().data_ptr()

    step = types.SimpleNamespace(
        compute=tensors, lows=tensors, exp_avg=tensors, exp_avg_sq=tensors, program=None,
        adamw=AdamWConfig(weight_decay=0.1), step_count=torch.ones(1), lr_now=torch.ones(1),
        activations=Arena())
    batch, scale = AdamWBatch(), torch.ones(1)
    grads = {p: torch.full((4,), float(k), dtype=BF16) for k, p in enumerate(paths)}
    for p in paths[:20]:
        batch.add(step, p, grads[p], None)
    batch.add(step, paths[20], grads[paths[20]].float(), None)  # another dtype: a new list
    for p in paths[21:25]:
        batch.add(step, p, grads[p], scale)  # another scale: a new list
    batch.add(step, paths[25], arena_bytes[:4], scale)  # in the arena: run at once
    batch.add(step, paths[26], grads[paths[26]], scale)
    assert [len(c[2]) for c in calls] == [16, 4, 1, 5]
    norm = torch.zeros(1, dtype=torch.float64)
    batch.add(step, paths[27], grads[paths[27]], scale, norm)  # the norms' sum: a new list
    batch.flush(step)
    batch.flush(step)  # nothing left: no call
    assert [len(c[2]) for c in calls] == [16, 4, 1, 5, 1, 1]
    assert all(c[13] is None for c in calls[:5]) and calls[5][13] is norm
    first = calls[0]
    assert [float(g[0]) for g in first[2]] == list(range(16))
    assert first[6][3] == 2.0 and first[6][0] == 1.0  # rate factors: lr_scale
    assert first[7][4] == 0.0 and first[7][0] == pytest.approx(0.1)  # decay: wd x scale
    assert all(c[12] is None for c in calls[:3]) and all(c[12] is scale for c in calls[3:])
    assert calls[3][2][-1].data_ptr() == arena_bytes.data_ptr()  # the arena's, run at once
    assert batch.pending == [] and batch.held == 0


def test_a_step_that_fails_midway_leaves_no_queued_update():
    """A step whose backward raises (a notebook may go on with the step) drops the updates
    and norm terms it queued: the next step must not run them on gradients whose bytes
    it has reused."""
    import types

    from runtime.cuda.step import TrainStep
    from runtime.cuda.step_optim import AdamWBatch, NormSquares

    batch, norms = AdamWBatch(), NormSquares("cpu")
    batch.pending, batch.held = [("queued",)], 4

    def fails(*args):
        raise RuntimeError("out of memory in the backward")

    step = types.SimpleNamespace(
        step_count=torch.zeros(1), _norms=norms, zero=None, update_in_backward=False,
        accumulation=1, _holds=lambda: False, _gradient_handler=lambda micro: None,
        loss_and_gradients=fails, _adamw_batch=batch)
    with pytest.raises(RuntimeError, match="out of memory"):
        TrainStep._fused_step(step)
    assert batch.pending == [] and batch.held == 0


def test_frozen_norm_weights_gradient_is_not_asked_for():
    """The GPU step's interpreter tells an RMSNorm backward whose d_weight is unwanted (the
    frozen norms of a LoRA'd model) `weight_grad=False` (its kernel then skips the weight's
    partial sums); a trained norm weight's backward is asked for it as before."""
    path, settings = TINY["llama"]
    for lora in (dict(rank=4, alpha=8), None):
        model = Model.from_module(path, settings=settings, dtype=BF16, lora=lora)
        graph = model.source.program_for(token_inputs(model)).graph
        run = step_module._StepInterpreter(graph, model.params, BF16, check_finite=False,
                                           kernels=train_kernels("cpu"))
        norms = [n for f in graph.functions for n in f.nodes
                 if n.target in ("rmsnorm_backward", "fused_residual_rmsnorm_backward")]
        assert len(norms) == 3  # two in the (repeated) block, the final one
        asked = [run._attrs(n).get("weight_grad", True) for n in norms]
        assert asked == [lora is None] * len(norms)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_wide_projections_take_one_gemm_over_x_and_h_side_by_side(monkeypatch, device):
    """Where the step lays a frozen weight at least twice as wide out as in with k r spare
    columns a row (runtime/cuda/lora_kcat.py; here each layer's gate/up: 2 x 4 ranks), its
    adapted projection is one GEMM over [x | h] and [W | s B]: s B lands in the side
    slot, and the step computes what the two-GEMM path does, within bf16 (on the GPU too:
    cuBLAS over the strided W and the scratch). Which of the two lands nearer float64
    over a whole step is rounding luck (one H100: summed errors 0.79 against 0.68; the
    CPU the other way); the projection itself rounds once (the test below)."""
    import runtime.cuda.lora_kcat as kcat
    import runtime.cuda.train_kernels as train_module
    from runtime.cuda.state import region_of, stacked_order
    from modulec.lower.lora import is_adapter

    model = _lora_model()
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    sides = kcat.side_columns(shapes, frozen)
    assert sorted(sides) == ["blocks[0].mlp.up_weight", "blocks[1].mlp.up_weight"]
    assert set(sides.values()) == {8}
    order = stacked_order(model.source.program_for(token_inputs(model)).graph, sorted(shapes))
    _, (views,) = region_of(shapes, [(BF16, order)], device=device, sides=sides)
    for path, view in views.items():
        view.copy_(model.params[path])
    slots = kcat.lay_sides(views, sides)
    taken, kcat_into = [], train_module.kcat_into

    def counted(*args):
        out = kcat_into(*args)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(train_module, "kcat_into", counted)
    # gate/up through kcat_into + swiglu, not the gated GEMM that takes it where quack
    # imports (tests/test_gated_mlp.py, test_cuda_gated_mlp.py)
    monkeypatch.setenv("MODULEC_GATED_GEMM", "0")
    outputs, grads, run, _ = _arena_step(model, monkeypatch, True, device, params=views)
    assert taken.count(True) == 2 and len(taken) == run.lora_into_planned == 8
    B = model.params["blocks[1].mlp.up_weight.up.lora_B"]  # the up part's block, s = 2
    torch.testing.assert_close(slots["blocks[1].mlp.up_weight"][B.shape[0]:, 4:].cpu(),
                               2.0 * B)
    new, was, _ = _errors_beside_two_gemms(model, monkeypatch, device, outputs, grads)
    assert max(new) < 0.1 and max(was) < 0.1, (new, was)
    monkeypatch.setenv("MODULEC_LORA_KCAT", "0")  # read when a step lays its weights
    assert kcat.side_columns(shapes, frozen) == {}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_the_one_gemm_projection_rounds_once(device):
    """kcat_into's y = [x | t] [W | s B]^T is one fp32 accumulation rounded to bf16 once:
    over every element at least as near the float64 product as the two-GEMM path's
    (the delta s t B^T rounded into y first, base's GEMM then adding into it)."""
    import runtime.cuda.lora_kcat as kcat

    rows, inner, out, width, s = 256, 128, 512, 16, 2.0
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(  # noqa: E731
        BF16).to(device)
    laid = draw(out, inner + width)  # W with its side slot beside each row
    W = laid[:, :inner]
    slots = kcat.lay_sides({"w": W}, {"w": width})
    x, t, B = draw(rows, inner), draw(rows, width, scale=0.3), draw(out, width, scale=0.3)
    one = torch.empty(rows, out, dtype=BF16, device=device)
    assert kcat.kcat_into(x, W, t, B, s, one) is one
    torch.testing.assert_close(slots["w"], s * B)
    two = torch.addmm(torch.mm(t, (s * B).t()), x, W.t())
    exact = x.double() @ W.double().t() + s * (t.double() @ B.double().t())
    near = [float((y.double() - exact).abs().mean()) for y in (one, two)]
    assert near[0] <= near[1], near


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_down_projections_d_x_as_one_gemm_over_d_y_and_d_t(monkeypatch, device):
    """By default a frozen weight at least WIDE times as wide in as out (here each
    layer's down_weight, 48 against 32, WIDE lowered to 1.4) and a fused projection's
    (q/k/v, gate/up) are laid with their adapters' rows after them
    (runtime/cuda/lora_kcat.py `tail_rows`); the backward's d_x = d_y W + d_t A is one
    GEMM over [d_y | d_t] and [W ; A]: A lands in the tail slot, the adapter path's node
    computes d_A alone, down's d_y is copied beside d_t while the fused projections'
    d_y (a concat planned in place) is written there by its producers (swiglu's and
    attention's backward: runtime/arena.py `widen`), and the step computes what the
    two-GEMM path does, within bf16; MODULEC_LORA_KCAT_DX=0 lays no tail rows. (Here
    the norms' backward keeps the residual gradient in its planned bytes:
    MODULEC_LORA_RESIDUAL_ROWS=0; test_residual_rows.py has it written into the scratch.)"""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter

    monkeypatch.setenv("MODULEC_LORA_KCAT_MIN", "1.4")
    monkeypatch.setenv("MODULEC_LORA_RESIDUAL_ROWS", "0")
    model = _lora_model(rank=8)
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    monkeypatch.setenv("MODULEC_LORA_KCAT_DX", "0")
    assert kcat.tail_rows(shapes, frozen) == {}
    monkeypatch.delenv("MODULEC_LORA_KCAT_DX")
    tails = kcat.tail_rows(shapes, frozen)
    assert tails == {f"blocks[{i}].{path}": rank for i in (0, 1) for path, rank in (
        ("mlp.down_weight", 8), ("attention.qkv_weight", 24), ("mlp.up_weight", 16))}
    assert kcat.side_bytes(shapes, {}, tails={p: r for p, r in tails.items() if "down" in p}
                           ) == 2 * 8 * 48 * 2  # the fixed bytes'
    views, (sides, slots) = _laid_views(model, device, kcat.side_columns(shapes, frozen),
                                        tails)
    copied = _counting_copies(monkeypatch)
    outputs, grads, run, _ = _arena_step(model, monkeypatch, True, device, params=views)
    assert run.lora_dx_one_gemm == 6  # each layer's down, q/k/v and gate/up
    # d_y copied beside d_t for down alone: the fused projections' backward wrote theirs
    # into the scratch, d_t's maker wrote it beside d_y, and t's (forward) beside x
    assert sorted(set(copied)) == [(16, 32)], copied
    torch.testing.assert_close(slots["blocks[1].mlp.down_weight"].cpu(),
                               model.params["blocks[1].mlp.down_weight.lora_A"])
    new, was, two_run = _errors_beside_two_gemms(model, monkeypatch, device, outputs, grads)
    assert two_run.lora_dx_one_gemm == 0 and two_run.lora_dx_fused == run.lora_dx_fused
    assert max(new) < 0.1 and max(was) < 0.1, (new, was)


def _laid_views(model, device, sides, tails):
    """The model's weights laid as the GPU step lays them: with side columns (`sides`) and
    tail rows (`tails`) beside the frozen weights (runtime/cuda/lora_kcat.py); the views
    and the slots, ({path: side slot}, {path: tail slot}) (held by the caller: lora_kcat
    keeps weak references to them, the step holds them in `TrainStep.sides`)."""
    import runtime.cuda.lora_kcat as kcat
    from runtime.cuda.state import region_of, stacked_order

    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    order = stacked_order(model.source.program_for(token_inputs(model)).graph, sorted(shapes))
    _, (views,) = region_of(shapes, [(BF16, order)], device=device, sides=sides, tails=tails)
    for path, view in views.items():
        view.copy_(model.params[path])
    return views, (kcat.lay_sides(views, sides), kcat.lay_tails(views, tails))


def _counting_copies(monkeypatch) -> list:
    """The shapes lora_kcat's `_copy_rows` moves from here on (not rows already in place)."""
    import runtime.cuda.lora_kcat as kcat

    copied, copy_rows = [], kcat._copy_rows

    def counted(into, rows):
        if (into.data_ptr(), into.stride()) != (rows.data_ptr(), rows.stride()):
            copied.append(tuple(into.shape))
        copy_rows(into, rows)
    monkeypatch.setattr(kcat, "_copy_rows", counted)
    return copied


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_t_is_written_beside_x_where_the_one_gemm_reads_it(monkeypatch, device):
    """Where the plan laid an adapted projection's input x wider (its k r spare columns)
    and the weight has a side slot, t = x A^T is written straight into x's spare columns
    (the step interpreter's `_t_beside_x`): the one GEMM over [x | t] reads it there and
    nothing is copied; the backward reads t where it lies. The same outputs and gradients,
    bit for bit, as with t copied there (MODULEC_LORA_T_BESIDE_X=0)."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter

    model = _lora_model(rank=8)
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    runs, held = {}, []  # the side slots: lora_kcat keeps weak references to them
    for beside in ("1", "0"):
        views, slots = _laid_views(model, device, kcat.side_columns(shapes, frozen), {})
        held.append(slots)
        monkeypatch.setenv("MODULEC_LORA_T_BESIDE_X", beside)
        copied = _counting_copies(monkeypatch)
        runs[beside] = (*_arena_step(model, monkeypatch, True, device, params=views)[:3],
                        copied)
    outputs, grads, run, copied = runs["1"]
    was_outputs, was_grads, was_run, was_copied = runs["0"]
    assert run.lora_into_planned == was_run.lora_into_planned == 8  # q/k/v, o, gate/up, down
    assert run.lora_t_beside_x == 6 and was_run.lora_t_beside_x == 0  # o: its x not wide
    assert copied == [] and sorted(set(was_copied)) == [(16, 8), (16, 16), (16, 24)]
    for got, want in zip(outputs, was_outputs):
        assert torch.equal(got, want)
    assert grads.keys() == was_grads.keys()
    for path in grads:
        assert torch.equal(grads[path], was_grads[path]), path


def test_under_the_planners_decisions_t_goes_beside_x_made_in_its_own_function(
        monkeypatch):
    """With the planner's decisions (a memory budget), x's bytes may be dropped, swapped or
    re-applied after the forward, and t would go with them: t is written beside x only
    where x is made in the function itself (down_proj's, SwiGLU's output), not where it
    is the function's input (q/k/v's and gate/up's: the caller's norm output), and the
    step computes the same."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter
    from runtime.decisions import Decisions

    model = _lora_model(rank=8)
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    runs, held = [], []  # the side slots: lora_kcat keeps weak references to them
    for decisions in (None, Decisions()):  # no decision made: every value kept
        views, slots = _laid_views(model, "cpu", kcat.side_columns(shapes, frozen), {})
        held.append(slots)
        runs.append(_arena_step(model, monkeypatch, True, params=views,
                                decisions=decisions)[:3])
    (outputs, grads, free), (kept_outputs, kept_grads, decided) = runs
    assert free.lora_t_beside_x == 6 and decided.lora_t_beside_x == 2  # down's, each layer
    assert all(torch.equal(a, b) for a, b in zip(outputs, kept_outputs))
    assert all(torch.equal(grads[p], kept_grads[p]) for p in grads)


def test_only_single_process_bf16_programs_lay_side_columns():
    """`one_gemm_sides` reads the program: a data-, tensor- or pipeline-parallel schedule
    or an FP8 recipe lays none (the step and its fixed bytes agree on it); the
    block-diagonal B's slots (stacked_blocks.block_slot) follow the same rule."""
    from modulec.lower.lora import is_adapter
    from runtime.cuda.lora_kcat import one_gemm_sides, side_bytes, single_process_bf16
    from runtime.cuda.stacked_blocks import block_slot_bytes

    model = _lora_model()
    program = model.source.program_for(token_inputs(model))
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    sides = one_gemm_sides(program, shapes, frozen)
    assert set(sides) == {"blocks[0].mlp.up_weight", "blocks[1].mlp.up_weight"}
    assert side_bytes(shapes, sides) == 2 * 8 * 2 * shapes["blocks[0].mlp.up_weight"][0]

    class Variant:  # the program with one more schedule section or metadata entry
        def __init__(self, schedule=None, metadata=None):
            self.document = {"schedule": {**program.document["schedule"], **(schedule or {})}}
            self.metadata = {**program.metadata, **(metadata or {})}
            self.graph = program.graph
    assert single_process_bf16(program) and block_slot_bytes(program, shapes) > 0
    for section in ("distributed", "tensor_parallel", "pipeline"):
        assert one_gemm_sides(Variant(schedule={section: {}}), shapes, frozen) == {}
        assert not single_process_bf16(Variant(schedule={section: {}}))
        assert block_slot_bytes(Variant(schedule={section: {}}), shapes) == 0
    fp8 = {"precision": {"matmuls": {"f": ["n1"]}}}
    assert one_gemm_sides(Variant(metadata=fp8), shapes, frozen) == {}
    assert not single_process_bf16(Variant(metadata=fp8))
    assert one_gemm_sides(Variant(metadata={"precision": {"matmuls": {}}}), shapes,
                          frozen) == sides


def test_a_frozen_lm_head_is_cut_off_and_its_loss_fused():
    """A LoRA model's head is frozen: the backward's first node (the head's matmul
    backward) has no weight gradient (""), and an empty input elsewhere (the final norm's
    absent residual gradient) is not that gradient: the head is split off all the same,
    so the GPU step takes the fused head's loss (no [rows, vocab] copies). Float32: the
    split graph with the fused loss gives the whole graph's loss and gradients."""
    from runtime.cuda.lm_head import lm_head_cross_entropy, logits_cross_entropy, split_head
    from runtime.cuda.step import next_token_labels
    from runtime.interpreter import Interpreter

    model = _lora_model()
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    split = split_head(program.graph)
    assert split is not None
    params = {p: t.float() for p, t in model.params.items()}
    ids = model._input(inputs["token_ids"])
    labels = next_token_labels(ids)
    whole = Interpreter(program.graph, params, torch.float32, check_finite=False)
    (logits, *_), frame = whole.forward([ids])
    loss, d_logits = logits_cross_entropy(logits, labels)
    _, want = whole.backward(frame, [d_logits])
    cut = Interpreter(split.graph, params, torch.float32, check_finite=False)
    (x_f, *_), frame = cut.forward([ids])
    fused, d_x, d_head = lm_head_cross_entropy(x_f, params[split.head_param], labels,
                                               chunk_rows=5, head_grad=False)
    _, got = cut.backward(frame, [d_x])
    assert d_head is None and split.head_param not in got
    assert float(fused) == pytest.approx(float(loss), rel=1e-5)
    assert set(got) == set(want) and got
    for path in want:
        torch.testing.assert_close(got[path], want[path], rtol=1e-4, atol=1e-6)


def test_the_heads_scratch_leaves_out_the_forwards_output():
    """Under a frozen head the forward's output xF is transient (no backward reads it):
    the logits chunk goes to the larger side of the transient region around it, on a
    256-byte boundary, never over it; a trained head's scratch needs `on_gradient`."""
    import types

    from modulec.plan.memory import TRANSIENT
    from runtime.cuda.step import TrainStep

    region = torch.zeros(4096, dtype=torch.uint8)
    arena = types.SimpleNamespace(regions={TRANSIENT: region})
    arena.in_transient = lambda t: region.data_ptr() <= t.data_ptr() < \
        region.data_ptr() + region.numel()
    step = types.SimpleNamespace(activations=arena, _head_tied=lambda: False)
    out = region[1000:1000 + 600].view(torch.bfloat16)  # bytes 1000..1600
    scratch = TrainStep._head_scratch(step, None, False, out)
    assert scratch.data_ptr() - region.data_ptr() == 1792 and scratch.numel() == 4096 - 1792
    out = region[3000:3400].view(torch.bfloat16)
    scratch = TrainStep._head_scratch(step, None, False, out)
    assert scratch.data_ptr() == region.data_ptr() and scratch.numel() == 2816
    elsewhere = torch.zeros(8, dtype=torch.bfloat16)
    assert TrainStep._head_scratch(step, None, False, elsewhere) is region
    assert TrainStep._head_scratch(step, None, True, out) is None
    assert TrainStep._head_scratch(step, print, True, elsewhere) is region
