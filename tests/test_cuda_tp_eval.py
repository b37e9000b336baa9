"""Evaluation (`--eval-data`) under tensor parallel on two GPUs (NCCL; `-m cuda`, skipped
with fewer than two), through `modulec train`'s CUDATrainer: TP 2 (and TP 2 with --sp)
evaluated before the first step and after each (eager, captured, replayed: each
evaluation a forward-only pass between two graph replays, its collectives over the TP
pair, the loss the vocab-parallel loss's value) gives the same eval loss on both ranks,
one GPU's on the same weights (bf16: within 1e-2), and leaves the training as it was:
the steps' losses and the masters equal the same run's without evaluation; and
`torchrun -m modulec train --tp 2 --eval-data` end to end (DP 2 x TP 2 on four GPUs).
The exact (float64) equalities are the CPU test's: tests/test_tp_eval.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers, tp_eval_workers  # noqa: E402
from tests.dist_testing import free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

STEPS, ROWS, SEQ, WORLD, EVAL_BATCHES = 4, 2, 128, 2, 3


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    vocab = dist_workers.GPU_LLAMA[1]["vocab_size"]
    tokens = np.random.default_rng(4).integers(0, vocab, EVAL_BATCHES * ROWS * SEQ + 1)
    path = tmp_path_factory.mktemp("tp_eval") / "eval.bin"
    tokens.astype("<u2").tofile(path)
    return path


def relative_error(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_evaluation_on_two_gpus(sp, eval_file, tmp_path):
    out = tmp_path / "tp_eval"
    mp.spawn(tp_eval_workers.gpu_eval_rank, nprocs=WORLD,
             args=(WORLD, free_port(), sp, STEPS, ROWS, SEQ, str(eval_file), str(out)))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    want = tp_eval_workers.gpu_eval_reference(STEPS, ROWS, SEQ, str(eval_file))
    for got in ranks:
        on, off = got[True], got[False]
        assert on["vocab_sharded"] and on["captured"]  # the vocab-parallel loss; replays
        assert len(on["evals"]) == STEPS + 1 and off["evals"] == []
        assert on["evals"] == pytest.approx(want["evals"], rel=1e-2)
        assert on["losses"] == pytest.approx(want["losses"], rel=1e-2)
        # the evaluations left the training alone: the same kernels on the same bytes
        # (bit for bit but for the attention backward's atomics, if any)
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-4)
        assert set(on["masters"]) == set(off["masters"])
        for path, master in off["masters"].items():
            assert relative_error(on["masters"][path], master) < 1e-3, path
    # the vocab-parallel loss's value: the same on the TP pair's ranks
    assert ranks[0][True]["evals"] == pytest.approx(ranks[1][True]["evals"], rel=1e-6)
    assert ranks[0][True]["evals"][0] != ranks[0][True]["evals"][-1]  # it trained


# processes, the parallel run's options (click keeps an option's last value): DP 2 x TP 2
# takes --batch 1 a rank, two rows a step as one GPU's --batch 2, and evaluates 6 batches
# of one row, whose mean is the one GPU's 3 batches of two rows
LAUNCHES = {"tp2": (2, ["--tp", "2"]),
            "dp2-tp2-zero3": (4, ["--tp", "2", "--zero", "3", "--batch", "1"])}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_torchrun_tp_evaluates_as_one_gpu(launch, eval_file, tmp_path):
    """`torchrun -m modulec train --device cuda --tp 2 --eval-data --eval-every 1` end to
    end (the run's wiring: no refusal, the note, rank 0 reporting each eval loss once;
    DP 2 x TP 2 under ZeRO-3 on four GPUs, skipped with fewer: the batches split over the
    data-parallel groups): the eval losses are one GPU's run's (bf16), and the step
    losses the same parallel run's without evaluation."""
    import json
    import os
    import subprocess
    import sys

    processes, parallel = LAUNCHES[launch]
    if torch.cuda.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs")
    data = tmp_path / "train.bin"
    vocab = dist_workers.GPU_LLAMA[1]["vocab_size"]
    np.random.default_rng(5).integers(0, vocab, 20_000).astype("<u2").tofile(data)
    args = ["std/models/llama.module", "--init", "random", "--seed", "3",
            *[a for k, v in dist_workers.GPU_LLAMA[1].items() for a in ("--set", f"{k}={v}")],
            "--data", str(data), "--seq", str(SEQ), "--batch", str(ROWS), "--steps", "3",
            "--device", "cuda", "--lr", "1e-3", "--format", "json"]
    evaluated = ["--eval-data", str(eval_file), "--eval-every", "1"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")

    def steps(launcher, more) -> tuple[list, list, list]:
        done = subprocess.run([*launcher, "-m", "modulec", "train", *args, *more], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr  # whole: the failing rank's error is not last
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        got = [r for r in rows if r["event"] == "step"]
        notes = [r["text"] for r in rows if r["event"] == "note" and "eval:" in r["text"]]
        return [r["loss"] for r in got], [r.get("eval_loss") for r in got], notes

    def torchrun():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(processes), "--master-port", str(free_port())]
    losses, evals, notes = steps(torchrun(), [*evaluated, *parallel])
    plain, _, _ = steps(torchrun(), parallel)
    _, want, _ = steps([sys.executable], evaluated)
    assert len(notes) == 1 and "tensor-parallel group" in notes[0]
    assert ("split over the 2 data-parallel ranks" in notes[0]) == (processes == 4)
    assert len(evals) == 3 and all(isinstance(e, float) for e in evals)
    assert evals == pytest.approx(want, rel=2e-2)
    assert losses == pytest.approx(plain, rel=1e-4)
