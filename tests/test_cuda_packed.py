"""Packed sequences on the GPU step (runtime/cuda/packed.py, TrainStep(packed=True)).

On the CPU: the host-side pieces (cu_seqlens padded to a fixed capacity, the capacity's
growth, the static buffers per micro-batch, the rope nodes' position slot, what a packed
step refuses). On a GPU (`-m cuda`): a packed bf16 step equals its documents' steps run
one by one, matches the CPU reference's packed step (float32), and a captured packed step
replays batches of other documents (and drops its graph for one with more documents than
its buffer holds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.packed import (PackedBuffers, capacity_for, check_packed,  # noqa: E402
                                 document_counts, padded_cu_seqlens, set_documents)
from runtime.kernels.documents import Documents, packed  # noqa: E402
from runtime.train.packing import Packing, split_batch  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

SEP = 1
LLAMA = "std/models/llama.module"
# head dim 16: FlashAttention's varlen kernel covers it (a multiple of 8)
SIZES = dict(vocab_size=64, d_model=64, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=96,
             max_seq=64)

WINDOW = [[5, 6, SEP, 7, SEP, 8, 9, 10, SEP],
          [SEP, 3, 4, 5, 6, 7, 8, 9, 2]]


def _documents(window) -> Documents:
    return split_batch(torch.tensor(window), Packing(SEP))[2]


def test_cu_seqlens_are_padded_with_empty_documents_to_the_capacity():
    positions = _documents(WINDOW).positions  # documents of 3, 2, 3 | 1, 7 tokens
    assert document_counts(positions, 2) == [5] and document_counts(positions, 1) == [3, 2]
    cu = padded_cu_seqlens(positions, 8)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 8, 9, 16, 16, 16, 16]
    assert padded_cu_seqlens(positions, 5).tolist() == [0, 3, 5, 8, 9, 16]
    with pytest.raises(ValueError, match="5 documents, room for 4"):
        padded_cu_seqlens(positions, 4)
    with pytest.raises(ValueError, match="start each row at 0"):
        padded_cu_seqlens(positions[:, 1:], 8)


def test_the_capacity_is_a_power_of_two_within_bounds():
    assert [capacity_for(n, 8192) for n in (0, 1, 8, 9, 20, 33, 8000)] == \
        [8, 8, 8, 16, 32, 64, 8192]
    assert capacity_for(5, 6) == 6 and capacity_for(3, 4) == 4  # never past B*T


def test_buffers_hold_each_micro_batch_and_grow_only_when_they_must():
    buffers = PackedBuffers(accumulation=2, batch=1, seq=8, device="cpu")
    with pytest.raises(ValueError, match="give them to set_batch"):
        buffers.micro(0)  # nothing to attend by yet
    documents = _documents(WINDOW)
    assert buffers.set(documents) and buffers.capacity == 8  # the first batch sizes it
    assert buffers.cu_seqlens.tolist() == [[0, 3, 5, 8, 8, 8, 8, 8, 8],
                                           [0, 1, 8, 8, 8, 8, 8, 8, 8]]
    assert torch.equal(buffers.positions, documents.positions)
    assert torch.equal(buffers.segments, documents.segments)
    second = buffers.micro(1)
    assert second.max_seqlen == 8 and second.positions.data_ptr() == \
        buffers.positions[1].data_ptr() and second.cu_seqlens.tolist()[:3] == [0, 1, 8]
    cu = buffers.cu_seqlens
    assert not buffers.set(_documents([[2] * 9, [SEP] * 9]))  # 1 and 8 documents: room
    assert buffers.cu_seqlens is cu and buffers.cu_seqlens[1].tolist() == list(range(9))
    grown = PackedBuffers(accumulation=1, batch=2, seq=8, device="cpu")
    grown.set(_documents([[2] * 9, [2] * 9]))
    assert grown.capacity == 8
    assert grown.set(_documents([[2, SEP] * 4 + [2], [SEP] * 9]))  # 4 + 8 documents
    assert grown.capacity == 16 and grown.cu_seqlens.shape == (1, 17)
    with pytest.raises(ValueError, match=r"the documents are \(2, 8\), the step's batch"):
        PackedBuffers(1, 1, 8, device="cpu").set(documents)


def test_data_parallel_denominators_live_in_one_static_buffer():
    """Packed data parallel: each micro-batch's denominator in a [accumulation] buffer
    made once (a graph captured without it is dropped), then copied into in place; none
    given: each micro-batch divides by its own count again (the buffer dropped)."""
    buffers = PackedBuffers(accumulation=2, batch=1, seq=8, device="cpu")
    documents = _documents(WINDOW)
    assert buffers.denominator(0) is None
    assert buffers.set(documents, [3.5, 4.0])
    held = buffers.denominators
    assert held.dtype == torch.float32 and held.tolist() == [3.5, 4.0]
    assert buffers.denominator(1).shape == () and float(buffers.denominator(1)) == 4.0
    assert not buffers.set(documents, [6, 2.5])  # the same buffer: a graph replays
    assert buffers.denominators is held and held.tolist() == [6.0, 2.5]
    with pytest.raises(ValueError, match="1 denominators for 2 micro-batches"):
        buffers.set(documents, [1.0])
    assert buffers.set(documents) and buffers.denominator(0) is None
    step = SimpleNamespace(packing=None)
    with pytest.raises(ValueError, match="built unpacked"):
        set_documents(step, None, [1.0])


def test_a_denominator_divides_the_summed_loss_instead_of_the_count():
    """The cross-entropy's `denominator` (runtime/cuda/lm_head.py): loss and gradient
    are the summed ones over it, a rank's share of the whole micro-batch's mean."""
    from runtime.cuda.lm_head import lm_head_cross_entropy, logits_cross_entropy

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(16, 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 16, (2, 5), generator=generator)
    labels[0, 1] = labels[1, 3] = -100  # 8 counted targets
    loss, d_x, d_w = lm_head_cross_entropy(x, weight, labels)
    shared, d_x2, d_w2 = lm_head_cross_entropy(x, weight, labels,
                                               denominator=torch.tensor(2.0))
    torch.testing.assert_close(shared, loss * 8 / 2)
    torch.testing.assert_close(d_x2, d_x * 4)
    torch.testing.assert_close(d_w2, d_w * 4)
    logits = x @ weight.t()
    loss, d_logits = logits_cross_entropy(logits, labels)
    shared, d_shared = logits_cross_entropy(logits, labels, denominator=16)
    torch.testing.assert_close(shared, loss / 2)
    torch.testing.assert_close(d_shared, d_logits / 2)


def test_a_packed_step_takes_documents_and_an_unpacked_one_refuses_them():
    unpacked = SimpleNamespace(packing=None)
    set_documents(unpacked, None)
    with pytest.raises(ValueError, match="built unpacked"):
        set_documents(unpacked, _documents(WINDOW))
    step = SimpleNamespace(packing=PackedBuffers(1, 2, 8, device="cpu"), cuda_graph="graph")
    with pytest.raises(ValueError, match="needs each batch's documents"):
        set_documents(step, None)
    set_documents(step, _documents(WINDOW))  # the first batch: nothing captured yet matters
    step.cuda_graph = "graph"
    set_documents(step, _documents(WINDOW))
    assert step.cuda_graph == "graph"  # the same room: the graph replays
    set_documents(step, _documents([[SEP] * 9, [SEP] * 9]))
    assert step.cuda_graph is None and step.packing.capacity == 16  # captured too small


def test_what_a_packed_step_does_not_run_is_refused():
    from runtime.errors import RuntimeUserError
    from runtime.model import Model

    program = Model.from_module(LLAMA, settings=SIZES, dtype=torch.float32).source.program(
        planned=False)
    check_packed(SimpleNamespace(dist=None, program=program))
    check_packed(SimpleNamespace(dist=SimpleNamespace(tp=1), program=program))  # --zero
    check_packed(SimpleNamespace(dist=SimpleNamespace(tp=2), program=program))  # --tp packs
    from modulec.ir.graph import Node

    def attention(*kernel):
        node = Node("n0", "op", "flash_attention", (), (), (), (("kernel", kernel),))
        graph = SimpleNamespace(functions=[SimpleNamespace(nodes=[node])])
        return SimpleNamespace(dist=None, program=SimpleNamespace(graph=graph))

    check_packed(attention('"cudnn"'))  # a preference: falls back to the varlen kernel
    check_packed(attention('"flash"', "fallback=false"))
    for name in ("cudnn", "fa4_bwd"):
        with pytest.raises(RuntimeUserError, match=f"{name} takes no packed"):
            check_packed(attention(f'"{name}"', "fallback=false"))


def test_rope_nodes_get_the_documents_positions_where_they_have_none():
    """The step interpreter fills rope's / qk_norm_rope's empty position_ids slot (forward
    and backward nodes) with the packed batch's positions, which the CUDA kernels take."""
    from runtime.cuda.step_interpreter import POSITION_SLOTS, _StepInterpreter
    from runtime.kernels import KERNELS
    from runtime.model import Model

    for target, slot in POSITION_SLOTS.items():
        kernel = KERNELS[target.removesuffix("_backward")]
        names = kernel.backward_inputs if target.endswith("_backward") else \
            kernel.forward_inputs
        assert names[slot] == "position_ids", target
    model = Model.from_module("std/models/qwen3.module", settings=dict(SIZES, head_dim=16),
                              dtype=torch.float32)
    program = model.source.program_for({"token_ids": torch.zeros(2, 8, dtype=torch.int32)})
    nodes = [n for f in program.graph.functions for n in f.nodes if n.target in POSITION_SLOTS]
    assert {n.target for n in nodes} == {"qk_norm_rope", "qk_norm_rope_backward"}
    run = object.__new__(_StepInterpreter)
    run._read = lambda value, frame, forward: value  # the value's name stands for it
    documents = _documents(WINDOW)
    for node in nodes:
        assert run._inputs(node, None, None)[POSITION_SLOTS[node.target]] is None
        with packed(documents):
            inputs = run._inputs(node, None, None)
        assert inputs[POSITION_SLOTS[node.target]] is documents.positions
        assert inputs[:2] == list(node.inputs[:2])


# ---------------------------------------------------------------------------- on a GPU
def _window(lengths, generator):
    """Documents of the given token counts, each followed by SEP, as one row."""
    ids = [torch.randint(2, SIZES["vocab_size"], (n,), generator=generator).tolist() + [SEP]
           for n in lengths]
    return ids


def _step(seq, batch=1, **options):
    from runtime.cuda.step import TrainStep

    return TrainStep.from_module(LLAMA, SIZES, batch=batch, seq=seq, **options)


def _params(seed=0):
    from runtime.cuda.step import random_params

    shapes = _step(8).shapes()
    return random_params(shapes, seed, std=0.1, on="cpu")


def _loss_and_grads(step, params, tokens, labels, documents=None):
    step.load(params)
    step.set_batch(tokens.cuda(), labels.cuda(), documents)
    loss, grads = step.loss_and_gradients()
    return float(loss), {p: g.float() for p, g in grads.items()}


def _cosine(a, b) -> float:
    a, b = a.double().flatten().cpu(), b.double().flatten().cpu()  # GPU step vs CPU reference
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def _close(loss, grads, want_loss, want_grads):
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss), (loss, want_loss)
    assert grads.keys() == want_grads.keys()
    far = {p: round(_cosine(grads[p], want_grads[p]), 5) for p in grads
           if _cosine(grads[p], want_grads[p]) < 0.999}
    assert not far, far


@pytest.fixture
def varlen_calls(monkeypatch):
    """How often the step ran FlashAttention's varlen kernel (forward, backward)."""
    import runtime.cuda.varlen as varlen

    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(varlen, f"varlen_{name}")

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(varlen, f"varlen_{name}", counted)
    return calls


@needs_gpus(1)
def test_a_packed_gpu_step_equals_its_documents_steps(varlen_calls):
    """bf16: the packed mean loss and gradients against the documents' own steps (each
    unpacked, its own T), weighted by their kept targets."""
    g = torch.Generator().manual_seed(0)
    docs = _window((9, 14, 6), g)
    window = torch.tensor([sum(docs, [])])
    tokens, labels, documents = split_batch(window, Packing(SEP))
    params = _params()
    loss, grads = _loss_and_grads(_step(tokens.shape[1], packed=True), params, tokens,
                                  labels, documents)
    assert varlen_calls["forward"] >= 2 and varlen_calls["backward"] == 2  # each layer
    total, want = 0.0, {}
    kept = sum(len(d) - 1 for d in docs)
    for doc in docs:
        one = torch.tensor([doc])
        part_loss, part = _loss_and_grads(_step(len(doc) - 1), params,
                                          one[:, :-1].to(torch.int32), one[:, 1:])
        n = len(doc) - 1
        total += part_loss * n / kept
        for p, grad in part.items():
            want[p] = want.get(p, 0) + grad * (n / kept)
    _close(loss, grads, total, want)


@needs_gpus(1)
def test_the_gpu_packed_step_matches_the_cpu_reference():
    """Two rows of documents of random lengths, a non-default ignore index: the bf16 GPU
    step's loss and gradients against the CPU trainer's float32 packed step."""
    from runtime.model import Model
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    g = torch.Generator().manual_seed(1)
    T = 40
    lengths = torch.randint(1, 12, (2, 20), generator=g).tolist()  # > T + 1 tokens a row
    window = torch.tensor([sum(_window(row, g), [])[:T + 1] for row in lengths])
    packing = Packing(SEP, ignore_index=-5)
    model = Model.from_module(LLAMA, settings=SIZES, dtype=torch.float32).init_random(0)
    with torch.no_grad():
        for path, value in _params(2).items():
            model.params[path].copy_(value)
    trainer = CPUTrainer(model, 2, T, AdamW(lr=0.0), packing=packing)
    want_loss, want = trainer._loss_and_gradients(window)
    tokens, labels, documents = split_batch(window, packing)
    step = _step(T, batch=2, packed=True, ignore_index=-5)
    loss, grads = _loss_and_grads(step, _params(2), tokens, labels, documents)
    _close(loss, grads, float(want_loss), want)


@needs_gpus(1)
def test_a_captured_packed_step_replays_other_documents():
    """lr 0 (the weights stay): a captured packed step replayed on a batch of other
    documents gives the eager step's loss on it; a batch with more documents than the
    buffer holds drops the graph, runs eagerly and still gives that loss."""
    from runtime.cuda.step import AdamWConfig

    g = torch.Generator().manual_seed(2)
    T = 48

    def batch(lengths):
        rows = [sum(_window(ls, g), [])[:T + 1] for ls in lengths]
        return split_batch(torch.tensor(rows), Packing(SEP))

    few = [batch([(20, 30), (10, 12, 30)]) for _ in range(3)]
    many = batch([(2,) * 17, (3,) * 13])  # 16 + 12 documents: past the 8 sized for `few`
    params = _params(3)
    captured = _step(T, batch=2, packed=True, adamw=AdamWConfig(lr=0.0)).load(params)
    eager = _step(T, batch=2, packed=True, adamw=AdamWConfig(lr=0.0)).load(params)
    tokens, labels, documents = few[0]
    captured.set_batch(tokens.cuda(), labels.cuda(), documents)
    captured.capture(warmup=1)
    for tokens, labels, documents in few[1:] + [many]:
        got = float(captured(tokens.cuda(), labels.cuda(), documents))
        want = float(eager(tokens.cuda(), labels.cuda(), documents))
        assert abs(got - want) <= 1e-3 * abs(want), (got, want)
    assert captured.cuda_graph is None and captured.packing.capacity == 32


@needs_gpus(1)
def test_modulec_train_packs_on_cuda(tmp_path):
    """`modulec train --device cuda --doc-sep`: three packed steps and a packed
    evaluation; its first loss (before any update) is the CPU run's within bf16."""
    import json

    import numpy as np

    from tests.test_cli import run

    rng = np.random.default_rng(1)
    docs = [list(rng.integers(2, 64, int(n))) + [SEP] for n in rng.integers(3, 12, 120)]
    np.asarray(sum(docs, []), dtype="<u2").tofile(tmp_path / "tokens.bin")

    def losses(device):
        result = run("train", LLAMA, "--init", "random", *sum(
            (["--set", f"{k}={v}"] for k, v in SIZES.items()), []), "--data",
            tmp_path / "tokens.bin", "--seq", "16", "--batch", "2", "--steps", "3",
            "--device", device, "--doc-sep", str(SEP), "--eval-data",
            tmp_path / "tokens.bin", "--eval-every", "3", "--eval-batches", "1",
            "--format", "json")
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.stdout.splitlines()
                if line.startswith("{")]
        return [r["loss"] for r in rows if r["event"] == "step"]

    gpu, cpu = losses("cuda"), losses("cpu")
    assert len(gpu) == 3 and abs(gpu[0] - cpu[0]) <= 1e-2 * abs(cpu[0]), (gpu, cpu)


def test_the_gpu_evaluation_forward_packs_like_the_cpu_one():
    """runtime/cuda/evaluate.py's packed forward on CPU tensors (every kernel falls back to
    the reference, FlashAttention to its document mask): the CPU trainer's packed loss,
    with a non-default ignore index; without the documents (attention across them,
    positions not restarting), the same targets' loss differs."""
    from runtime.cuda.evaluate import eval_loss
    from runtime.cuda.lm_head import split_head
    from runtime.cuda.train_kernels import train_kernels
    from runtime.model import Model
    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import cpu_loss
    from runtime.train.optim import AdamW

    packing = Packing(SEP, ignore_index=-5)
    model = Model.from_module(LLAMA, settings=SIZES, dtype=torch.float32).init_random(
        0, std=0.3)
    program = model.source.program_for({"token_ids": torch.zeros(2, 8, dtype=torch.int32)})
    split = split_head(program.graph)
    step = SimpleNamespace(graph=split.graph, compute=model.params, dtype=torch.float32,
                           kernels=train_kernels("cpu", ("cudnn", "flash")),
                           input_names=program.input_names(),
                           split=split, chunk_rows=2048, ignore_index=-5, zero=None)
    window = torch.tensor(WINDOW)
    tokens, labels, documents = split_batch(window, packing)
    got = float(eval_loss(step, tokens, labels, documents))
    want = cpu_loss(CPUTrainer(model, 2, 8, AdamW(lr=0.0), packing=packing), window)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    plain = float(eval_loss(step, tokens, labels))  # the same targets, attention unmasked
    assert abs(plain - want) > 1e-4
