"""runtime/prune.py: backward work nobody reads, left out of a run (`prune_dead`).

On a LoRA'd Llama (frozen embedding) the entry backward's `embedding_backward` makes
nothing, so the first layer's input gradients are unread: the layer's last repetition
runs without its input norm's backward, and its attention without the q/k/v projection's
d_x GEMM, its add, and the adapter path's d_x. Runs with and without pruning give the
same bits (float64 reference interpreter; the GPU step's interpreter on the arena in bf16)
with fewer matmul backwards; nothing is pruned where the graph has collectives, waits or
other-stream ops, nor under hooks."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

import runtime.arena as arena_module  # noqa: E402
import runtime.cuda.step_interpreter as step_module  # noqa: E402
from runtime.cuda.train_kernels import train_kernels  # noqa: E402
from runtime.interpreter import Interpreter  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime.prune import prunable, pruned  # noqa: E402
from runtime_models import TINY, token_inputs  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def _lora_model(dtype=torch.float64) -> Model:
    path, settings = TINY["llama"]
    model = Model.from_module(path, settings=settings, dtype=dtype,
                              lora=dict(rank=4, alpha=8, targets=TARGETS))
    model.init_random(1, std=0.3)
    g = torch.Generator().manual_seed(2)
    for p, t in model.params.items():  # B != 0: every adapter gradient means something
        if p.endswith("lora_B"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model


def _program(model):
    return model.source.program_for(token_inputs(model))


def _backward_of(graph, prefix: str):
    return next(f for f in graph.functions if f.name.startswith(prefix) and f.gradient_of)


def test_the_first_layers_input_gradient_is_left_out():
    graph = _program(_lora_model()).graph
    entry = graph.function(graph.backward)
    assert prunable(graph)
    kept, dead_calls = pruned(entry, frozenset())
    assert "embedding_backward" not in {n.target for n in kept.nodes}
    (stack,) = [n for n in kept.nodes if n.kind == "call"]
    assert dead_calls == {stack.id: frozenset(range(len(stack.outputs)))}

    block = _backward_of(graph, "DenseTransformerBlock")
    kept, dead_calls = pruned(block, dead_calls[stack.id])
    assert all(o == "" for o in kept.outputs)
    assert len(kept.nodes) == len(block.nodes) - 1  # the input norm's backward
    (attention,) = [n for n in kept.nodes if n.target.startswith("CausalSelfAttention")]
    assert dead_calls == {attention.id: frozenset({0})}

    full = _backward_of(graph, "CausalSelfAttention")
    kept, _ = pruned(full, frozenset({0}))
    gone = [n for n in full.nodes if n.id not in {k.id for k in kept.nodes}]
    assert sorted(n.target for n in gone) == ["add", "matmul_backward"]  # base d_x, the sum
    blanked = [n for n in kept.nodes if n.outputs != full.nodes[int(n.id[1:])].outputs]
    assert len(blanked) == 1 and blanked[0].outputs[0] == ""  # the adapter path's d_x
    assert dict(kept.param_grads) == dict(full.param_grads)
    assert pruned(full, frozenset()) == (full, {})


def _matmul_backwards(counts):
    kernels = dict(KERNELS)
    matmul = kernels["matmul"]

    class Counted:
        def __getattr__(self, name):
            return getattr(matmul, name)

        def backward(self, inputs, attrs):
            counts["matmul_backward"] += 1
            return matmul.backward(inputs, attrs)
    kernels["matmul"] = Counted()
    return kernels


def test_the_reference_interpreter_gives_the_same_bits_with_fewer_backwards():
    model = _lora_model()
    program = _program(model)
    ids = model._input(token_inputs(model)["token_ids"])
    results = {}
    for prune in (False, True):
        counts = collections.Counter()
        run = Interpreter(program.graph, model.params, torch.float64, check_finite=False,
                          kernels=_matmul_backwards(counts), prune_dead=prune)
        outputs, frame = run.forward([ids])
        _, grads = run.backward(frame, [torch.full_like(o, 0.01) for o in outputs])
        results[prune] = grads, counts["matmul_backward"]
    (plain, plain_count), (fewer, fewer_count) = results[False], results[True]
    assert set(fewer) == set(plain) and plain
    assert all(torch.equal(fewer[p], plain[p]) for p in plain)
    assert fewer_count == plain_count - 1  # layer 0's q/k/v base d_x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpus(1))])
def test_the_gpu_steps_interpreter_on_the_arena_gives_the_same_gradients(device):
    """bf16 on the arena, the step's kernels and LoRA paths: pruned or not, the same
    gradients, bit for bit on the CPU (on a GPU within the last bits: the one-pass adapter
    gradients meet through atomics)."""
    model = _lora_model(torch.bfloat16)
    program = _program(model)
    ids = model._input(token_inputs(model)["token_ids"]).to(device)
    params = {p: t.to(device) for p, t in model.params.items()}
    results = {}
    for prune in (False, True):
        arena = arena_module.Arena(program.graph, program.document["schedule"]["layout"],
                                   device, parameter_views=True)
        run = step_module._StepInterpreter(program.graph, dict(params), torch.bfloat16,
                                           check_finite=False, kernels=train_kernels(device),
                                           keep_only_saved=True, decisions=None, arena=arena)
        run.prune_dead = prune
        outputs, frame = run.forward([ids])
        _, grads = run.backward(frame, [torch.full_like(o, 0.01) for o in outputs])
        results[prune] = {p: g.float().cpu() for p, g in grads.items()}
    assert results[True].keys() == results[False].keys() and results[True]
    for path, want in results[False].items():
        got = results[True][path]
        if device == "cpu":
            assert torch.equal(got, want), path
        else:
            assert (got - want).abs().max() <= 1e-2 * want.abs().max().clamp(min=1e-6), path


def test_nothing_is_pruned_beside_collectives_waits_streams_or_hooks():
    graph = _program(_lora_model()).graph
    block = _backward_of(graph, "DenseTransformerBlock")
    op = next(n for n in block.nodes if n.kind == "op")

    def with_node(node):
        nodes = tuple(node if n.id == op.id else n for n in block.nodes)
        functions = tuple(replace(f, nodes=nodes) if f is block else f for f in graph.functions)
        return replace(graph, functions=functions)

    assert not prunable(with_node(replace(op, target="tp_all_reduce")))
    assert not prunable(with_node(replace(op, attrs=op.attrs + (("stream", "comm"),))))
    run = Interpreter(graph, {}, torch.float64, prune_dead=True)
    assert run._prunes()
    run.hooks = object()
    assert not run._prunes()
