"""Packed sequences (`--doc-sep`) under tensor parallel on two CPU processes (gloo),
float64: the ranks of a TP group hold the same rows, so the same documents; each runs
the per-document attention on its heads (and RoPE on the restarting positions), and the
vocab-parallel loss leaves the target after a separator out. Two packed AdamW steps on
the tiny Llama, Qwen3 (q/k norms) and Llama with --sp equal one process's packed steps
(losses and state, and the evaluation's packed loss after them); and packed data parallel x tensor parallel's loss (each data-parallel
rank's summed loss over its denominator, runtime.train.packing.denominators, averaged
over the data-parallel ranks as ZeRO averages their gradients) is one process's mean
over their rows, gradients too. The CLI's wiring (--tp with --doc-sep accepted):
tests/test_train_packing.py; with --pp: tests/test_pipeline_packed_eval.py; on two GPUs: tests/test_cuda_tp_packed.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from runtime.tensor_parallel import unshard_params  # noqa: E402
from tests import tp_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

STEPS, ROWS, SEQ, ACCUMULATION = 2, 2, 8, 1
RUNS = [("llama", False, True), ("qwen3", False, False), ("llama", True, False)]


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for path, value in want.items():
        torch.testing.assert_close(got[path], value, rtol=1e-9, atol=1e-12,
                                   msg=f"{what} {path}")


def test_packed_tensor_parallel_steps_equal_one_process(tmp_path):
    out = str(tmp_path / "rank")
    spawn(tp_workers.packed_rank, nprocs=2,
             args=(2, free_port(), RUNS, (STEPS, ROWS, SEQ, ACCUMULATION), out))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    wanted = {}
    for name, sp, shares in RUNS:
        program = tp_workers.tiny_model(name, 2, 0, sp).source.program(planned=False)
        if name not in wanted:  # --sp changes nothing of one process's
            model = tp_workers.tiny_model(name)
            mean = tp_workers.packed_shares(model, 2 * ROWS, SEQ, 1) if shares else None
            wanted[name] = mean, tp_workers.packed_train(model, STEPS, ROWS, SEQ,
                                                         ACCUMULATION)
        mean, want = wanted[name]
        got = [r[name, sp]["train"] for r in ranks]
        for rank in got:
            assert rank["losses"] == pytest.approx(want["losses"], rel=1e-10), (name, sp)
            assert rank["eval"] == pytest.approx(want["eval"], rel=1e-10), (name, sp)
        for key in ("masters", "exp_avg", "exp_avg_sq"):
            _close(unshard_params([r[key] for r in got], program), want[key],
                   f"{name} sp={sp} {key}")
        if shares:  # data parallel x tensor parallel: the ranks' shares average to the mean
            parts = [r[name, sp]["shares"] for r in ranks]
            for rank in parts:
                assert float(rank["loss"]) == pytest.approx(float(mean["loss"]), rel=1e-10)
            _close(unshard_params([r["grads"] for r in parts], program), mean["grads"],
                   f"{name} sp={sp} shares")


def test_the_test_windows_pack_and_the_data_parallel_ranks_count_differently():
    """What makes the test above one: the windows hold separators (their losses differ
    from unpacked ones), and the two data-parallel ranks' rows count different numbers
    of targets (a rank's own mean would not average to the whole mean)."""
    from tests.dist_workers import SEP, packed_windows

    window = packed_windows(1, 2 * ROWS, SEQ)[0]
    counted = (window[:, :-1] != SEP).reshape(2, -1).sum(1)
    assert counted[0] != counted[1]
    assert bool((packed_windows(STEPS, ROWS, SEQ)[0][:, :-1] == SEP).any())
