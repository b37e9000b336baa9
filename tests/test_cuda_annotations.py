"""Annotations on the GPU step. LoRA dropout (runtime/cuda/dropout.py: masks from a device
counter): the hash, the kernel and the step's interpreter run on the CPU here; the tests
marked `cuda` run the captured LoRA step with `dropout=p`, an `@adapter(ia3)` step against
the CPU reference, and a `@kernel("reference")` choice in the step, on a GPU (skipped
without CUDA)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.dropout import DeviceDropout, DeviceSeed, fmix32, mul32, uniform  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

F64 = torch.float64


def _seed(step: int, key: int = 7, device: str = "cpu") -> DeviceSeed:
    return DeviceSeed(torch.tensor(step, dtype=torch.int64, device=device), key)


def _fmix_reference(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_hash_is_exact_32_bit_arithmetic():
    """mul32 and fmix32 in int64 torch ops equal Python's unbounded integers mod 2^32."""
    rng = random.Random(0)
    words = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    c = 0xC2B2AE35
    got = mul32(torch.tensor(words, dtype=torch.int64), c).tolist()
    assert got == [(w * c) & 0xFFFFFFFF for w in words]
    assert fmix32(torch.tensor(words, dtype=torch.int64)).tolist() == \
        [_fmix_reference(w) for w in words]


def test_uniform_is_deterministic_per_seed_and_new_per_step_and_key():
    a = uniform((64, 1000), _seed(3))
    assert torch.equal(a, uniform((64, 1000), _seed(3)))  # a recompute: the same mask
    assert a.min() >= 0 and a.max() < 1 and a.dtype == torch.float32
    for other in (uniform((64, 1000), _seed(4)), uniform((64, 1000), _seed(3, key=8))):
        assert (other == a).float().mean() < 1e-3
        # another step or op: uncorrelated
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), other.flatten()]))[0, 1])) < 0.02


def test_uniform_is_uniform():
    u = uniform((200_000,), _seed(1))
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45, chi2  # 19 degrees of freedom: p < 1e-3 above 43.8
    # neighbouring elements are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_device_dropout_keeps_1_minus_p_scaled_by_its_inverse(p):
    kernel = DeviceDropout(KERNELS["dropout"])
    x = torch.randn(400, 500, dtype=F64, generator=torch.Generator().manual_seed(0))
    y, mask = kernel.forward([x], {"p": p, "seed": _seed(5)})
    kept = mask != 0
    assert abs(float(kept.double().mean()) - (1 - p)) < 0.005
    assert torch.allclose(mask[kept], torch.full_like(mask[kept], 1 / (1 - p)))
    assert abs(float(mask.mean()) - 1) < 0.01  # the expected value is kept
    assert torch.equal(y, x * mask)
    (d_x,) = kernel.backward([torch.ones_like(x), mask], {"p": p})
    assert torch.equal(d_x, mask)
    none = kernel.forward([x], {"p": p, "seed": None})  # evaluation: no dropout
    assert torch.equal(none[0], x) and torch.equal(none[1], torch.ones_like(x))
    zero = kernel.forward([x], {"p": 0.0, "seed": _seed(5)})
    assert torch.equal(zero[0], x)
    seeded = kernel.forward([x], {"p": p, "seed": 3})  # an int seed: the reference's mask
    assert all(torch.equal(a, b) for a, b in
               zip(seeded, KERNELS["dropout"].forward([x], {"p": p, "seed": 3})))
    assert not torch.equal(seeded[0], x)


def _lora_program(dropout: float):
    from runtime.model import Model
    from runtime_models import TINY, token_inputs

    path, settings = TINY["llama"]
    lora = dict(rank=4, alpha=8, targets=["q", "v", "up"], dropout=dropout)
    model = Model.from_module(path, settings=settings, dtype=F64, lora=lora).init_random(1)
    g = torch.Generator().manual_seed(2)
    for p, t in model.params.items():  # B != 0: the adapters change the output
        if p.endswith("lora_B"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g, dtype=F64))
    inputs = token_inputs(model)
    return model, model.source.program_for(inputs), model._input(inputs["token_ids"])


def _step_run(model, program, tokens, rng):
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.cuda.train_kernels import train_kernels

    run = _StepInterpreter(program.graph, model.params, F64, check_finite=False,
                           kernels=train_kernels("cpu"), keep_only_saved=True, decisions=None)
    run.rng = rng
    (out, *_), frame = run.forward([tokens])
    _, grads = run.backward(frame, [torch.ones_like(out)])
    return out, grads


def test_the_step_interpreter_draws_a_mask_per_step_and_micro_batch():
    """The GPU step's interpreter with LoRA dropout (CPU, float64): the same counter and
    salt give the same outputs, another counter or micro-batch other ones; without a
    counter (evaluation) the adapters read x as it is."""
    model, program, tokens = _lora_program(0.3)
    assert any(n.target == "dropout" for f in program.graph.functions for n in f.nodes)
    counter = torch.tensor(1, dtype=torch.int64)
    first, grads = _step_run(model, program, tokens, (counter, "0/0"))
    again, grads_again = _step_run(model, program, tokens, (counter, "0/0"))
    assert torch.equal(first, again)
    assert all(torch.equal(grads[p], grads_again[p]) for p in grads)
    other_micro, _ = _step_run(model, program, tokens, (counter, "0/1"))
    counter.add_(1)  # the next step: the counter is read when the op runs
    next_step, _ = _step_run(model, program, tokens, (counter, "0/0"))
    for other in (other_micro, next_step):
        assert not torch.allclose(first, other)
    plain, plain_program, _ = _lora_program(0.0)
    evaluation, _ = _step_run(model, program, tokens, None)
    no_dropout, _ = _step_run(plain, plain_program, tokens, None)
    assert torch.allclose(evaluation, no_dropout, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ on a GPU
LLAMA = "std/models/llama.module"
SMALL = dict(vocab_size=512, d_model=256, n_layers=2, num_heads=8, num_kv_heads=2, d_ff=512,
             max_seq=128, eps=1e-5)
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


@needs_gpus(1)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gpu_masks_equal_the_cpu_hash_and_scale(p):
    kernel = DeviceDropout(KERNELS["dropout"])
    x = torch.ones(1024, 2048, dtype=torch.bfloat16, device="cuda")
    y, mask = kernel.forward([x], {"p": p, "seed": _seed(9, device="cuda")})
    assert torch.equal(uniform(x.shape, _seed(9, device="cuda")).cpu(),
                       uniform(x.shape, _seed(9)))  # the same hash on both devices
    kept = mask != 0
    assert abs(float(kept.float().mean()) - (1 - p)) < 0.003
    scale = torch.tensor(1 / (1 - p), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(mask[kept], scale.expand(int(kept.sum())))
    assert torch.equal(y, x * mask)
    assert abs(float(mask.float().mean()) - 1) < 0.01


def _step(dropout: float):
    from runtime.cuda.step import TrainStep

    lora = dict(rank=8, alpha=16, targets=TARGETS, dropout=dropout)
    return _adapted(TrainStep.from_module(LLAMA, SMALL, batch=2, seq=128, lora=lora))


def _adapted(step):
    """Random weights with B != 0: PEFT's B = 0 (init_random's) makes every adapter's
    delta, and so the dropout mask's effect and A's gradient, zero."""
    from runtime.cuda.step import random_params

    params = random_params(step.shapes(), 0, on="cpu")
    g = torch.Generator().manual_seed(3)
    for path, value in params.items():
        if path.endswith("lora_B"):
            params[path] = 0.05 * torch.randn(value.shape, generator=g)
    return step.load(params)


def _tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (2, 128), generator=g, dtype=torch.int32).cuda()


@needs_gpus(1)
def test_gpu_lora_step_with_dropout_0_is_the_step_without():
    from runtime.cuda.step import TrainStep

    tokens = _tokens()
    plain = _adapted(TrainStep.from_module(LLAMA, SMALL, batch=2, seq=128,
                                           lora=dict(rank=8, alpha=16, targets=TARGETS)))
    results = []
    for step in (_step(0.0), plain):
        step.set_batch(tokens)
        loss, grads = step.loss_and_gradients()
        results.append((loss, grads))
    (loss, grads), (ref_loss, ref) = results
    assert torch.equal(loss, ref_loss) and set(grads) == set(ref)  # the same forward
    for p in ref:  # attention backwards may add in another order: near, not equal
        a, b = grads[p].double().flatten(), ref[p].double().flatten()
        assert float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30)) > 0.9999, p


@needs_gpus(1)
def test_gpu_lora_step_draws_a_new_mask_each_replay():
    """dropout=0.5 with lr 0 (the weights stay): each replay of the captured step gives
    another loss (another mask); setting the device counter back replays a step's mask
    exactly; losses are near the no-dropout loss (the expected value is kept)."""
    step = _step(0.5)
    tokens = _tokens()
    step.set_lr(0.0)
    step.capture(warmup=1)
    start = int(step.rng_step.item())
    losses = [float(step(tokens)) for _ in range(6)]
    assert len(set(losses)) == 6, losses
    assert int(step.rng_step.item()) == start + 6
    step.rng_step.fill_(start + 2)  # the third replay's counter value, less one
    assert float(step(tokens)) == losses[2]
    plain = _step(0.0)
    plain.set_batch(tokens)
    reference = float(plain.loss_and_gradients()[0])
    assert all(abs(x - reference) / reference < 0.05 for x in losses), (losses, reference)


# a tiny language model whose middle matmul carries the annotation under test
TINY_LM = """\
model Tiny(vocab_size: int = 64, d: int = 32):
  params:
    emb: [vocab_size, d]
    w: [d, d]
    head: [vocab_size, d]
  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, vocab_size]
    graph:
      token_ids -> embedding(emb) -> h
      h -> {middle}
      k -> matmul(head, transpose=NT) -> logits
"""
IA3_LM = TINY_LM.format(middle="matmul(w, transpose=NT) -> k @adapter(ia3)")


@needs_gpus(1)
def test_gpu_ia3_step_matches_the_cpu_reference_and_trains_the_vector_alone(tmp_path):
    """`@adapter(ia3)` on the GPU step (adapters on: `lora={}`): the vector `w.ia3_l` is
    the one trained parameter; loss and gradient match the fp32 CPU reference; captured
    steps change it and leave the frozen weights bit-identical."""
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import TrainStep, next_token_labels
    from runtime.interpreter import Interpreter
    from runtime.model import Model

    path = tmp_path / "ia3.module"
    path.write_text(IA3_LM, encoding="utf-8")
    model = Model.from_module(path, dtype=torch.float32, lora={}).init_random(0, std=0.2)
    g = torch.Generator().manual_seed(1)
    model.params["w.ia3_l"] = 1 + 0.1 * torch.randn(32, generator=g)
    step = TrainStep.from_module(path, batch=2, seq=16, lora={}).load(model.params)
    assert step.names == ["w.ia3_l"] and step.frozen() == {"emb", "w", "head"}
    tokens = torch.randint(0, 64, (2, 16), generator=g, dtype=torch.int32)
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    run = Interpreter(step.program.graph, model.params, torch.float32)
    (logits,), frame = run.forward([tokens])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    _, ref = run.backward(frame, [d_logits])
    assert set(grads) == set(ref) == {"w.ia3_l"}
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-2
    got, want = grads["w.ia3_l"].double().cpu(), ref["w.ia3_l"].double()
    assert float(got @ want / (got.norm() * want.norm())) >= 0.999
    frozen = {p: step.compute[p].clone() for p in step.frozen()}
    before = step.masters["w.ia3_l"].clone()
    step.set_lr(1e-2)
    losses = [float(step(tokens.cuda())) for _ in range(2)]
    step.capture(warmup=1)
    losses += [float(step(tokens.cuda())) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert not torch.equal(step.masters["w.ia3_l"], before)
    assert all(torch.equal(step.compute[p], frozen[p]) for p in frozen)


KERNEL_LM = TINY_LM.format(middle="matmul(w, transpose=NT) {choice} -> k")


@needs_gpus(1)
def test_gpu_step_runs_the_kernel_named_by_kernel(tmp_path, monkeypatch):
    """`@kernel("reference")` on a matmul: the GPU step runs the reference kernel for it,
    forward and derived backward (not the train registry's cuBLAS Matmul), eagerly and in
    the captured graph's warm-up; loss and gradients agree with the unannotated step."""
    from runtime.cuda.step import TrainStep, random_params

    calls = []
    reference = KERNELS["matmul"]

    class Counting:
        def __getattr__(self, attr):
            return getattr(reference, attr)

        def forward(self, inputs, attrs):
            calls.append("forward")
            return reference.forward(inputs, attrs)

        def backward(self, inputs, attrs):
            calls.append("backward")
            return reference.backward(inputs, attrs)

    monkeypatch.setitem(KERNELS, "matmul", Counting())  # what `reference` selects
    results = []
    for choice in ('@kernel("reference")', ""):
        path = tmp_path / f"choice{len(results)}.module"
        path.write_text(KERNEL_LM.format(choice=choice), encoding="utf-8")
        step = TrainStep.from_module(path, batch=2, seq=16)
        step.load(random_params(step.shapes(), seed=0, std=0.2))
        step.set_batch(_tokens()[:, :16] % 64)
        results.append(step.loss_and_gradients())
        if choice:
            assert calls == ["forward", "backward"], calls
    assert calls == ["forward", "backward"]  # the unannotated step: the train registry's
    (loss, grads), (ref_loss, ref) = results
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-2
    assert set(grads) == set(ref)
    for p in ref:
        a, b = grads[p].double().flatten(), ref[p].double().flatten()
        assert float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30)) > 0.999, p


# ------------------------------------------------------------------ @dtype on a parameter
DTYPE_LM = """\
model TinyNormed(vocab_size: int = 64, d: int = 32):
  params:
    emb: [vocab_size, d]
    norm: [d] @dtype(fp32)
    w: [d, d] {w}
    head: [vocab_size, d]
  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, vocab_size]
    graph:
      token_ids -> embedding(emb) -> h
      h -> rmsnorm(norm, eps=1e-5) -> (n, _)
      n -> matmul(w, transpose=NT) -> k
      k -> matmul(head, transpose=NT) -> logits
"""


def _dtype_program(tmp_path, w: str = ""):
    from runtime.model import Model

    path = tmp_path / "normed.module"
    path.write_text(DTYPE_LM.format(w=w), encoding="utf-8")
    model = Model.from_module(path, dtype=torch.bfloat16)
    return path, model.source.program_for({"token_ids": torch.zeros(2, 16, dtype=torch.int32)})


class _FakeStep:
    """What param_dtypes reads of a TrainStep (one needs CUDA to be made)."""

    def __init__(self, program, dist=None):
        from runtime.model import parameter_shapes

        self.program, self.dtype, self.dist = program, torch.bfloat16, dist
        self._shapes = parameter_shapes(program.graph)

    def shapes(self):
        return self._shapes

    def ties(self):
        return {}


def test_own_dtypes_are_the_1d_fp32_parameters_and_the_rest_is_refused(tmp_path):
    from runtime.cuda.param_dtypes import own_dtypes
    from runtime.errors import RuntimeUserError

    _, program = _dtype_program(tmp_path)
    assert own_dtypes(_FakeStep(program)) == {"norm": torch.float32}
    with pytest.raises(RuntimeUserError, match="data or tensor parallel"):
        own_dtypes(_FakeStep(program, dist=object()))
    _, matrix = _dtype_program(tmp_path, w="@dtype(fp32)")
    with pytest.raises(RuntimeUserError, match="`w` is 2-d") as error:
        own_dtypes(_FakeStep(matrix))
    assert "--device cpu" in error.value.help[0]
    _, half = _dtype_program(tmp_path, w="@dtype(fp16)")
    with pytest.raises(RuntimeUserError, match="`w` is 2-d; `w` is float16"):
        own_dtypes(_FakeStep(half))


def test_fixed_bytes_count_an_fp32_parameter_at_4_bytes(tmp_path):
    from runtime.cuda.step import runtime_fixed_bytes

    _, program = _dtype_program(tmp_path)
    trained = 64 * 32 * 2 + 32 * 32 + 32
    assert runtime_fixed_bytes(program) == 12 * trained
    path = tmp_path / "frozen.module"
    path.write_text(DTYPE_LM.format(w="").replace("@dtype(fp32)", "@dtype(fp32) @frozen"),
                    encoding="utf-8")
    from runtime.model import Model

    frozen = Model.from_module(path, dtype=torch.bfloat16).source.program_for(
        {"token_ids": torch.zeros(2, 16, dtype=torch.int32)})
    assert runtime_fixed_bytes(frozen) == 12 * (trained - 32) + 4 * 32


def test_split_masters_hold_fp32_parameters_whole():
    from runtime.cuda.state import SplitMasters, region_of, split_master

    shapes = {"a": (3, 4), "n": (4,)}
    buffer, (bf16, fp32) = region_of(shapes, [(torch.bfloat16, ["a"]), (torch.float32, ["n"])],
                                     device="cpu")
    _, (lows,) = region_of(shapes, [(torch.int16, ["a"])], device="cpu")
    assert bf16["a"].dtype == torch.bfloat16 and fp32["n"].dtype == torch.float32
    assert fp32["n"].data_ptr() - buffer.data_ptr() >= 3 * 4 * 2  # its own bytes
    a = torch.randn(3, 4)
    split_master(a, bf16["a"], lows["a"])
    fp32["n"].copy_(torch.arange(4.0))
    masters = SplitMasters({**bf16, **fp32}, lows, whole={"n": fp32["n"]})
    assert sorted(masters) == ["a", "n"] and len(masters) == 2
    assert torch.equal(masters["a"], a) and torch.equal(masters["n"], torch.arange(4.0))
    copy = masters.on("cpu")["n"]
    assert copy.data_ptr() != fp32["n"].data_ptr()  # a copy, as a joined master is


@needs_gpus(1)
def test_gpu_step_holds_an_fp32_norm_weight_in_fp32(tmp_path):
    """`norm: [d] @dtype(fp32)` on the GPU step: its compute copy is fp32 and is its
    master; loss and gradients match the fp32 CPU reference; captured steps update it in
    fp32 (changes below bf16's resolution stay)."""
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import TrainStep, next_token_labels
    from runtime.interpreter import Interpreter
    from runtime.model import Model

    path, _ = _dtype_program(tmp_path)
    model = Model.from_module(path, dtype=torch.float32).init_random(0, std=0.2)
    step = TrainStep.from_module(path, batch=2, seq=16).load(model.params)
    assert step.compute["norm"].dtype == torch.float32
    assert step.compute["w"].dtype == torch.bfloat16
    assert "norm" not in step.lows and torch.equal(step.masters["norm"], step.compute["norm"])
    assert torch.equal(step.compute["norm"].cpu(), model.params["norm"])  # not rounded
    tokens = _tokens()[:, :16] % 64
    step.set_batch(tokens)
    loss, grads = step.loss_and_gradients()
    assert grads["norm"].dtype == torch.float32
    run = Interpreter(step.program.graph, model.params, torch.float32)
    (logits,), frame = run.forward([tokens.cpu()])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens.cpu()))
    _, ref = run.backward(frame, [d_logits])
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-2
    for p in ref:
        a, b = grads[p].double().flatten().cpu(), ref[p].double().flatten()
        assert float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30)) > 0.999, p
    before = step.compute["norm"].clone()
    step.set_lr(1e-6)  # steps below bf16's resolution at the weight's size: kept in fp32
    step(tokens)
    step.capture(warmup=1)
    step(tokens)
    moved = step.compute["norm"] - before
    assert step.compute["norm"].dtype == torch.float32 and bool((moved != 0).all())
    assert float(moved.abs().max()) < 1e-4


@needs_gpus(1)
def test_gpu_step_refuses_an_fp32_matrix(tmp_path):
    from runtime.cuda.step import TrainStep
    from runtime.errors import RuntimeUserError

    path, _ = _dtype_program(tmp_path, w="@dtype(fp32)")
    step = TrainStep.from_module(path, batch=2, seq=16)
    with pytest.raises(RuntimeUserError, match="`w` is 2-d"):
        step.init_random(0)
