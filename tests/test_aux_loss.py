"""Auxiliary losses in training (issue 18 item 4): a model's 0-d floating outputs besides
the logits join the loss with gradient seed 1, in every trainer (the CPU trainer's and
the GPU step's are checked against transformers in test_hf_parity_moe.py /
test_cuda_std_moe.py; here the rule itself and the pipeline's last stage)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.train.aux_loss import auxiliary_losses, auxiliary_seeds  # noqa: E402


def test_only_0d_floating_outputs_are_auxiliary_losses():
    outputs = {"logits": torch.zeros(2, 3, 5), "aux_loss": torch.tensor(0.25),
               "count": torch.tensor(3), "hidden": torch.zeros(2, 3)}
    assert list(auxiliary_losses(outputs, "logits")) == ["aux_loss"]
    seeds, total = auxiliary_seeds([outputs["hidden"], outputs["aux_loss"], outputs["count"]])
    assert seeds[0] is None and seeds[2] is None and float(seeds[1]) == 1.0
    assert float(total) == 0.25
    assert auxiliary_seeds([outputs["hidden"]]) == ([None], None)


def test_the_pipelines_last_stage_adds_them():
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.train.pipeline import _loss

    logits = torch.randn(1, 4, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (1, 4))
    aux = torch.tensor(0.5, dtype=torch.float64)
    loss, seeds = _loss([logits, aux], labels)
    plain, d_logits = logits_cross_entropy(logits, labels)
    assert loss == pytest.approx(float(plain) + 0.5)
    assert len(seeds) == 2 and float(seeds[1]) == 1.0
    torch.testing.assert_close(seeds[0], d_logits.to(logits.dtype))
