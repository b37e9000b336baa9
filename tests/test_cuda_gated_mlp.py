"""SwiGLU in the GEMMs' epilogues on the GPU (`-m cuda`): the LoRA step with quack's gated
GEMMs (runtime/cuda/gated_mlp.py) against the fp32 CPU reference and against the step's
usual path (cuBLAS + our swiglu kernels), eager and captured. Skipped without CUDA, and
where quack-kernels does not import (an optional dependency: the reason is shown). The
wiring's CPU test: tests/test_gated_mlp.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)


def _quack_or_skip():
    from runtime.cuda.gated_gemm import quack_gated

    found = quack_gated()
    if isinstance(found, str):
        pytest.skip(found)


def _recording(step, monkeypatch) -> list:
    """The interpreters the step makes from here on."""
    made, make = [], step.interpreter

    def recorded(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(step, "interpreter", recorded)
    return made


def test_the_gated_lora_step_matches_the_reference_and_the_usual_step(tmp_path,
                                                                     monkeypatch):
    """Each layer's MLP runs its two gated GEMMs; the loss and every adapter gradient match
    the fp32 CPU reference as the usual step's do, and the eager and captured steps'
    losses are the usual step's within bf16's rounding."""
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.interpreter import Interpreter
    from tests.test_cuda_train import SMALL, _cos, _lora_step, _tokens

    _quack_or_skip()
    tokens = _tokens()
    losses, grads, runs = {}, {}, {}
    for switch in ("1", "0"):
        monkeypatch.setenv("MODULEC_GATED_GEMM", switch)
        step, model = _lora_step(tmp_path)
        made = _recording(step, monkeypatch)
        step.set_batch(tokens.cuda())
        loss, found = step.loss_and_gradients()
        runs[switch] = made[-1]
        grads[switch] = {p: g.float().cpu() for p, g in found.items()}
        step.adamw.lr = 1e-3
        losses[switch] = [float(loss)] + [float(step(tokens.cuda())) for _ in range(2)]
        step.capture(warmup=1)
        losses[switch] += [float(step(tokens.cuda())) for _ in range(3)]
    layers = SMALL["n_layers"]
    assert (runs["1"].gated_forward, runs["1"].gated_backward) == (layers, layers)
    assert (runs["0"].gated_forward, runs["0"].gated_backward) == (0, 0)
    run = Interpreter(step.program.graph, model.params, torch.float32)
    (logits,), frame = run.forward([tokens])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    _, ref = run.backward(frame, [d_logits])
    assert abs(losses["1"][0] - float(ref_loss)) / float(ref_loss) < 1e-2
    assert set(grads["1"]) == set(ref)
    worst = {s: min((_cos(grads[s][p], ref[p]), p) for p in ref) for s in grads}
    assert worst["1"][0] >= 0.999, worst
    for a, b in zip(losses["1"], losses["0"]):
        assert abs(a - b) / abs(b) < 2e-3, losses
