"""Every std model and example trains on the GPU (`-m cuda`; skipped without CUDA): one
fp32 step's loss and gradients against the CPU reference on the same weights and batch.
The ops without a custom kernel run through the torch fallbacks (runtime/cuda/kernels.py);
Mixtral's routing runs the MoE gathers (its aux_loss output, an auxiliary loss, is added
and seeded with 1 as in `modulec train`), GPT-2 gets position ids 0 .. T-1 and its head
tied to the embedding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_models import GPU_ONLY, TINY, token_inputs  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

B, T = 2, 16


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _reference(step, params: dict, tokens):
    """Loss and gradients of the CPU interpreter on the step's program."""
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.inputs import fed_inputs
    from runtime.interpreter import Interpreter
    from runtime.train.aux_loss import auxiliary_seeds

    run = Interpreter(step.program.graph, params, torch.float32)
    inputs = fed_inputs(step.input_names, tokens)
    (logits, *others), frame = run.forward([inputs[n] for n in step.input_names])
    loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    seeds, aux = auxiliary_seeds(others)
    loss = loss if aux is None else loss + aux
    return loss, run.backward(frame, [d_logits] + seeds)[1]


@pytest.mark.parametrize("name", sorted(TINY | GPU_ONLY))
def test_fp32_step_matches_the_cpu_reference(name):
    from runtime.cuda.step import TrainStep
    from runtime.model import Model

    path, settings = (TINY | GPU_ONLY)[name]
    model = Model.from_module(path, settings=settings, dtype=torch.float32).init_random(seed=1)
    tokens = token_inputs(model, batch=B, seq=T)["token_ids"]
    step = TrainStep.from_module(path, settings, batch=B, seq=T, dtype=torch.float32)
    for tied, target in step.ties().items():  # GPT-2's head: one tensor, as HF loads it
        model.params[tied] = model.params[target]
    step.load(model.params)
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    ref_loss, ref_grads = _reference(step, dict(model.params), tokens)
    for tied, target in step.ties().items():  # the step adds a tied gradient to its target's
        ref_grads[target] = ref_grads[target] + ref_grads.pop(tied)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-4
    assert grads.keys() == ref_grads.keys()
    worst = max((_rel(grads[p].float().cpu(), g), p) for p, g in ref_grads.items())
    assert worst[0] < 1e-4, worst
