"""`@frozen` and `@trainable` on the GPU step (`-m cuda`): a frozen parameter holds no
master or moments and does not move; `lr_scale` scales its first AdamW step (Adam's step
is linear in the learning rate); the step with them still captures in one CUDA graph."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

LLAMA = "std/models/llama.module"
SMALL = dict(vocab_size=256, d_model=128, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=256,
             max_seq=64, eps=1e-5)
FROZEN, HALVED = "final_norm.weight", "blocks[1].attention.qkv_weight"


def _step(training: dict | None):
    from runtime.cuda.step import TrainStep

    base = TrainStep.from_module(LLAMA, SMALL, batch=2, seq=64)
    program = base.program
    if training is not None:
        document = copy.deepcopy(program.document)
        document["metadata"]["training"] = training
        program = type(program)(program.graph, document)
    return TrainStep(program, 2, 64).init_random(0)


def _one_step(step) -> dict:
    before = {p: step.masters[p].clone() for p in step.names}
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 64), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(3),
                           dtype=torch.int32)
    step(tokens)
    return {p: step.masters[p] - before[p] for p in step.names}


def test_frozen_and_lr_scale_on_the_gpu():
    plain = _one_step(_step(None))
    step = _step({"frozen": [FROZEN], "parameters": {HALVED: {"lr_scale": 0.5}}})
    frozen_before = step.compute[FROZEN].clone()
    moved = _one_step(step)
    assert FROZEN not in step.names and FROZEN not in step.lows
    assert torch.equal(step.compute[FROZEN], frozen_before)
    ratio = moved[HALVED].double().norm() / plain[HALVED].double().norm()
    assert abs(float(ratio) - 0.5) < 0.02
    other = "blocks[0].mlp.up_weight"
    assert torch.allclose(moved[other], plain[other], rtol=0, atol=1e-6)
    step.capture(warmup=1)  # the per-parameter settings run inside the graph too
    step.cuda_graph.replay()
    assert torch.isfinite(step.loss)
