"""Packed sequences (--doc-sep) and evaluation (--eval-data) under pipeline parallel (the
1F1B trainer, runtime/train/pipeline.py), on four CPU processes (gloo), float64: two
data-parallel pipelines of two stages (DP 2 x PP 2) and one pipeline of two --tp 2 stages
(PP 2 x TP 2). Packed, each stage computes a micro-batch's documents from its rows, the
last stage leaves the ignored targets out: the steps equal one process's packed steps
with --grad-accum = the micro-batch count (data-parallel pipelines: the denominators of
packed data parallel, runtime.train.packing). The evaluation after each step (an odd
number of batches: split unevenly over the pipelines) runs forward only through the
stages and equals one process's on every rank, and leaves the next step unchanged. The
four processes are the session fixture `four_ranks`'s (tests/test_pipeline_tp.py
spawn_four runs PACKED_EVAL_RUNS in them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import dist_workers, pipeline_workers  # noqa: E402

STEPS, MICRO, ROWS, SEQ, WORLD = 2, 2, 2, 8, 4
EVAL_BATCHES = 3
# (model, tp, packed, steps, micro, rows, seq): DP 2 x PP 2 packed; PP 2 x TP 2 packed;
# DP 2 x PP 2 unpacked with dropout on both stages (off in the evaluation)
PACKED_EVAL_RUNS = [("llama", 1, True, STEPS, MICRO, ROWS, SEQ),
                    ("llama", 2, True, STEPS, MICRO, ROWS, SEQ),
                    ("pipelined", 1, False, STEPS, MICRO, 1, SEQ)]


def write_eval_file(folder):
    """folder/eval.bin: EVAL_BATCHES whole batches of ROWS x SEQ (+1) tokens, separators
    among them (the unpacked run reads them as ids)."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(2, 64, EVAL_BATCHES * ROWS * SEQ + 1)
    tokens[rng.random(tokens.size) < 0.2] = dist_workers.SEP
    path = folder / "eval.bin"
    tokens.astype("<u2").tofile(path)
    return path


def _unpacked_reference(name: str, steps: int, micro: int, rows: int, seq: int,
                        eval_path) -> dict:
    """One process, unpacked, --grad-accum micro: losses, evals after each step, state."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(pipeline_workers.tiny_model(name), rows, seq,
                         AdamW(lr=1e-2, weight_decay=0.1), accumulation=micro)
    data = EvalData(eval_path, "uint16", seq, rows, 64)
    losses, evals = [], []
    for window in dist_workers.windows(steps, rows * micro, seq):
        losses.append(trainer.train_step(window))
        evals.append(evaluate(trainer, data))
    return {"losses": losses, "evals": evals, "state": trainer.state()}


def test_packed_steps_and_evaluation_through_the_stages_equal_one_process(four_ranks):
    ranks, eval_file = four_ranks["pe."], four_ranks["eval_file"]
    for index, (name, tp, packed, steps, micro, rows, seq) in enumerate(PACKED_EVAL_RUNS):
        dp = WORLD // (2 * tp)
        want = dist_workers.packed_reference(name, steps, rows, seq, micro, dp,
                                             str(eval_file)) if packed else \
            _unpacked_reference(name, steps, dp * micro, rows, seq, eval_file)
        for rank in ranks:  # every rank has the step's loss and the eval loss
            got = rank[index]
            assert got["losses"] == pytest.approx(want["losses"], rel=1e-10), (index, rank)
            assert got["evals"] == pytest.approx(want["evals"], rel=1e-10), index
            assert got["kept"] == [0] * steps  # the evaluation keeps no frame
        whole = ranks[0][index]["whole"]
        for part in ("masters", "exp_avg", "exp_avg_sq"):
            assert set(whole[part]) == set(want["state"][part]), (index, part)
            for path, value in want["state"][part].items():
                torch.testing.assert_close(whole[part][path], value, rtol=1e-10,
                                           atol=1e-12, msg=f"run {index} {part} {path}")
    assert len(ranks[0][0]["evals"]) == STEPS


def test_the_pipelines_count_different_targets_in_the_test_windows():
    """What makes the packed data-parallel run above one: the pipelines' micro-batches
    count different numbers of targets, so a pipeline's own mean would differ."""
    window = dist_workers.packed_windows(1, ROWS * MICRO * 2, SEQ)[0]
    counted = (window[:, 1:] != -1) & (window[:, :-1] != dist_workers.SEP)
    per_micro = counted.reshape(2, MICRO, -1).sum(-1)
    assert per_micro[0].tolist() != per_micro[1].tolist()
