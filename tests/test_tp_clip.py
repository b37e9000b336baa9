"""--clip-grad under tensor parallel (issue 17): the global gradient norm sums the TP
slices' squares over the TP group and counts the replicated parameters once
(runtime/dist/tp_norm.py), on the CPU trainer and on the ZeRO run (docs/distributed.md,
"Tensor parallel")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import tp_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.test_pipeline_tp import DP_TP_RUNS  # noqa: E402

PARTS = ("masters", "exp_avg", "exp_avg_sq")
CLIP, STEPS, ROWS, SEQ = 1e-3, 2, 2, 8


def _reference(clip: float, rows: int) -> tuple[list, list, dict]:
    """One process, float64, the whole batch: losses, norms and the state."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW
    from tests.dist_workers import windows

    trainer = CPUTrainer(tp_workers.tiny_model("llama"), rows, SEQ,
                         AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip))
    losses, norms = [], []
    for window in windows(STEPS, rows, SEQ):
        losses.append(trainer.train_step(window))
        norms.append(float(trainer.grad_norm))
    return losses, norms, trainer.state()


def _check(results: list, runs: list) -> None:
    for index, (zero, clip, _, rows, _) in enumerate(runs):
        want_losses, want_norms, want = _reference(clip, rows)
        assert min(want_norms) > clip  # the clipping really happens
        for rank in results:
            got = rank[index]
            # the loss is a float32 mean (logits_cross_entropy): two ranks' means of two
            # rows each are the four rows' to its last bits; the norms are float64
            assert got["losses"] == pytest.approx(want_losses, rel=1e-6), zero
            assert got["norms"] == pytest.approx(want_norms, rel=1e-10), zero
        got = results[0][index]["whole"]
        for part in PARTS:
            for path, value in want[part].items():
                torch.testing.assert_close(got[part][path], value, rtol=1e-10, atol=1e-12,
                                           msg=f"zero {zero} {part} {path}")


def test_tp2_clips_as_one_process(tmp_path):
    """--tp 2 on two gloo processes, the tiny Llama in float64, clipping at 1e-3 (below
    every norm here): the CPU trainer on the TP pair, and ZeRO 0 and 1 on it, equal one
    process with the same clip (losses, norms, and the joined weights and moments after
    two steps, to 1e-10); the moments hold the clipped gradients, so they match only if
    the norm sums the slices over the pair and the replicated parameters once."""
    runs = [(zero, CLIP, STEPS, ROWS, SEQ) for zero in (None, 0, 1)]
    out = tmp_path / "tp"
    spawn(tp_workers.train_clipped, nprocs=2, args=(2, free_port(), runs, str(out)))
    _check([torch.load(f"{out}.{r}") for r in range(2)], runs)


def test_dp2_tp2_clips_as_one_process(four_ranks):
    """DP 2 x TP 2 on four gloo processes (ZeRO 1: both sums in one DP all_reduce, then
    the slices' over the TP pair) equals one process on the four rows (run in the four
    processes tests/test_pipeline_tp.py starts)."""
    assert DP_TP_RUNS == [(1, CLIP, STEPS, 2 * ROWS, SEQ)]
    _check(four_ranks["dptp."], DP_TP_RUNS)
