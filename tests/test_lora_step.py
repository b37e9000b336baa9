"""The GPU step's LoRA paths that run anywhere (CPU, bf16 on the arena): nothing copied into
the arena for the adapted projections' adds or the zero blocks, the same bits as the
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

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
BF16 = torch.bfloat16


def _lora_model() -> Model:
    path, settings = TINY["llama"]
    model = Model.from_module(path, settings=settings, dtype=BF16,
                              lora=dict(rank=4, alpha=8, targets=ALL_TARGETS))
    model.init_random(1, std=0.3)
    g = torch.Generator().manual_seed(2)
    for p, t in model.params.items():  # B != 0: the deltas mean something
        if p.endswith("lora_B"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model


def _arena_step(model, monkeypatch, planned: bool, device: str = "cpu"):
    """One forward + backward of the step's interpreter on the arena (CPU, bf16): outputs,
    gradients, the interpreter, and the (function, value, op) of each copy into the arena.
    `planned=False`: the kernels and LoRA pairs as they were before (the reference add,
    zeros and concat made elsewhere and copied in, base's matmul not deferred)."""
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    kernels = train_kernels(device)
    if not planned:
        kernels["add"] = KERNELS["add"]
        for name in ("zeros", "concat"):
            kernels[name].takes_out = False
        found = step_module.lora_addmm_pairs

        def without_bases(*args):
            pairs = found(*args)
            pairs.deferred -= {source.id for source in pairs.bases.values()}
            pairs.bases = {}
            return pairs
        monkeypatch.setattr(step_module, "lora_addmm_pairs", without_bases)
    copies = collections.Counter()
    place = arena_module.Arena.place

    def counted(self, frame, node, value, tensor):
        placed = place(self, frame, node, value, tensor)
        if isinstance(tensor, torch.Tensor) and placed.data_ptr() != tensor.data_ptr():
            copies[(frame.function.name, value, node.target if node else None)] += 1
        return placed
    monkeypatch.setattr(arena_module.Arena, "place", counted)
    arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"], device)
    params = {p: t.to(device) for p, t in model.params.items()}
    run = step_module._StepInterpreter(program.graph, params, BF16, check_finite=False,
                                       kernels=kernels, keep_only_saved=True, decisions=None,
                                       arena=arena)
    outputs, frame = run.forward([model._input(inputs["token_ids"]).to(device)])
    _, grads = run.backward(frame, [torch.full_like(o, 0.01) for o in outputs])
    monkeypatch.undo()
    return outputs, grads, run, copies


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device")])])
def test_lora_step_on_the_arena_writes_the_adds_and_zero_blocks_where_planned(
        monkeypatch, device):
    """On the GPU too (its custom kernels, cuBLAS): the same bits as the old path."""
    model = _lora_model()
    outputs, grads, run, copies = _arena_step(model, monkeypatch, True, device)
    ref_outputs, ref, ref_run, ref_copies = _arena_step(model, monkeypatch, False, device)
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))
    assert set(grads) == set(ref) and all(torch.equal(grads[p], ref[p]) for p in ref)
    # qkv, out, up, down x 2 layers: base's matmul into y's bytes, the delta added there
    assert (run.lora_fused, run.lora_into_planned) == (8, 8)
    assert (ref_run.lora_fused, ref_run.lora_into_planned) == (8, 0)
    by_op = lambda counts, op: sum(n for (_, _, o), n in counts.items() if o == op)  # noqa
    assert by_op(ref_copies, "add") > 0 and by_op(ref_copies, "zeros") > 0
    assert by_op(copies, "add") == by_op(copies, "zeros") == 0, copies
    assert sum(copies.values()) < sum(ref_copies.values())


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


def test_small_gradients_norms_are_summed_in_batches():
    from runtime.cuda.step_optim import NormSquares

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g).to(BF16)
             for shape in [(48, 4), (4, 32)] * 40 + [(1100, 1000)]]
    norms = NormSquares(torch.zeros(1))
    for grad in grads:
        norms.add(grad)
    assert len(norms.pending) == 80 - NormSquares.BATCH  # the large one added at once
    want = sum(float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2 for t in grads)
    assert float(norms.flushed()) == pytest.approx(want, rel=1e-5)
    assert norms.pending == []


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
