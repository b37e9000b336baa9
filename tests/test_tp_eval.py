"""`modulec train --eval-data` under tensor parallel (--tp 2) and DP x TP, on gloo CPU
processes, the tiny Llama in float64 (runtime/train/evaluate.py): the ranks of a TP
group evaluate the same batches, forward only, and the eval loss is the vocab-parallel
loss's value, the batches split over the data-parallel groups (an odd number: unevenly;
ZeRO-3's forward gathering its weights and keeping no buffer after). Every rank's eval
loss is one process's on the same weights, and the steps after an evaluation are one
process's (and, --tp 2, the same run's without evaluation: losses and state bit for
bit)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import tp_eval_workers, tp_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

STEPS, ROWS, SEQ, EVAL_BATCHES = 2, 2, 8, 3
PARTS = ("masters", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    """EVAL_BATCHES whole batches of ROWS x SEQ (+1) tokens (6 of one row)."""
    tokens = np.random.default_rng(7).integers(0, 64, EVAL_BATCHES * ROWS * SEQ + 1)
    path = tmp_path_factory.mktemp("tp_eval") / "eval.bin"
    tokens.astype("<u2").tofile(path)
    return path


@pytest.fixture(scope="module")
def reference(eval_file) -> dict:
    """One process, the whole model and batch: the eval loss before the first step and
    after each, by the rows of an eval batch (2: a TP pair's; 1: a DP 2 x TP 2 rank's),
    and the steps' losses."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW

    model = tp_workers.tiny_model("llama")
    initial = {p: t.detach().clone() for p, t in model.params.items()}
    trainer = CPUTrainer(model, ROWS, SEQ, AdamW(lr=1e-2, weight_decay=0.1))
    data = {rows: EvalData(eval_file, "uint16", SEQ, rows, 64, EVAL_BATCHES)
            for rows in (1, 2)}
    evals = {rows: [evaluate(trainer, d)] for rows, d in data.items()}
    losses = []
    for window in tp_workers.windows(STEPS, ROWS, SEQ):
        losses.append(trainer.train_step(window))
        for rows, d in data.items():
            evals[rows].append(evaluate(trainer, d))
    return {rows: {"evals": evals[rows], "losses": losses} for rows in data} | \
        {"initial": initial}


def _check(ranks: list, want: dict, zero) -> None:
    for got in ranks:
        on = got[True]
        # float64 throughout: the TP pair's sums in another order than one process's
        assert on["evals"] == pytest.approx(want["evals"], rel=1e-12), zero
        assert on["losses"] == pytest.approx(want["losses"], rel=1e-12), zero
        assert on["held"] == [0] * (STEPS + 1)  # ZeRO-3: no entry buffer kept
    assert ranks[0][True]["evals"][0] != ranks[0][True]["evals"][-1]  # it trained


def _spawn(world: int, whole: dict, zero, eval_file, out, again: bool) -> list:
    spawn(tp_eval_workers.eval_rank, nprocs=world,
             args=(world, free_port(), whole, zero, STEPS, ROWS, SEQ, str(eval_file),
                   EVAL_BATCHES, str(out), again))
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


def test_tp2_evaluates_as_one_process_and_trains_on_unchanged(eval_file, reference,
                                                              tmp_path):
    """--tp 2 on two processes (the CPU trainer on the TP pair): both ranks evaluate
    every batch; the run without the evaluations has the same losses and state, bit
    for bit; the GPU's forward-only pass (on the CPU kernels) gives the same loss on a
    TP rank's slices."""
    ranks = _spawn(2, reference["initial"], None, eval_file, tmp_path / "tp", again=True)
    _check(ranks, reference[ROWS], None)
    for got in ranks:
        assert got[True]["losses"] == got[False]["losses"] and got[False]["evals"] == []
    for part in PARTS:  # the state after the evaluations: the run's without them
        for path, value in ranks[0][False]["whole"][part].items():
            assert torch.equal(ranks[0][True]["whole"][part][path], value), (part, path)
    for got in ranks:  # the GPU evaluation's pass (runtime/cuda/evaluate.py) on a TP rank
        gpu_pass, cpu = got["gpu_pass"]
        assert gpu_pass == pytest.approx(cpu, rel=1e-12)


def test_dp_x_tp_splits_the_evaluation_over_the_data_parallel_groups(eval_file, reference,
                                                                    tmp_path):
    """Four processes, --tp 2 --zero 3: two TP pairs, each one row of a step; the three
    eval batches of one row split 2 + 1 over the pairs (the pair without a third batch
    runs one it does not count: ZeRO-3 gathers with the other pair), the sum reduced over
    the data-parallel group only."""
    ranks = _spawn(4, reference["initial"], 3, eval_file, tmp_path / "dptp", again=False)
    _check(ranks, reference[1], 3)


def test_the_run_notes_a_tensor_parallel_evaluation(eval_file):
    """The note at the start says how the batches are split and that a TP group
    evaluates each together (DP 2 x TP 2; --tp 2 alone)."""
    from types import SimpleNamespace

    from runtime.train.observe import Observer

    request = SimpleNamespace(eval_data=eval_file, eval_every=2, eval_batches=None,
                              batch=1, seq=SEQ, lr=1e-3, log_dir=None)
    for dp, split in ((2, ", split over the 2 data-parallel ranks"), (1, "")):
        notes = Observer(request, None, "uint16", 64, 0,
                         parallel=SimpleNamespace(dp=dp, tp=2)).notes()
        assert notes == [f"eval: {2 * EVAL_BATCHES} batches of 1 x {SEQ} tokens from "
                         f"{eval_file} every 2 steps and after the last{split}, each batch "
                         "on the 2 ranks of a tensor-parallel group"]
