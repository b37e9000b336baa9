"""Packed sequences (--doc-sep) and evaluation (--eval-data) under data parallel, on two
CPU processes (gloo), float64: two packed optimizer steps with gradient accumulation,
whose ranks count very different numbers of targets, equal one process's packed steps on
every rank's rows (losses and state), at ZeRO-2 and ZeRO-3, and the evaluation split over
the ranks (an odd number of batches) equals one process's on every rank. Under --pp:
tests/test_pipeline_packed_eval.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.test_dist_zero import assert_same_state  # noqa: E402

STEPS, ROWS, SEQ, ACCUMULATION, WORLD = 2, 2, 8, 2, 2
EVAL_BATCHES = 3  # odd: rank 0 evaluates two of them, rank 1 one


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    """EVAL_BATCHES whole batches of ROWS x SEQ (+1) tokens, separators among them."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(2, 64, EVAL_BATCHES * ROWS * SEQ + 1)
    tokens[rng.random(tokens.size) < 0.2] = dist_workers.SEP
    path = tmp_path_factory.mktemp("eval") / "eval.bin"
    tokens.astype("<u2").tofile(path)
    return path


def test_packed_steps_and_evaluation_under_zero2_and_3_equal_one_process(eval_file,
                                                                        tmp_path):
    """The steps and the evaluation after each (ZeRO-3's forward gathering its weights
    and holding no entry buffer after it: the next step's state is still one
    process's). One spawn of two processes runs both stages."""
    out = tmp_path / "packed"
    spawn(dist_workers.packed_sharded, nprocs=WORLD,
             args=(WORLD, free_port(), "llama", (2, 3), STEPS, ROWS, SEQ, ACCUMULATION,
                   str(eval_file), str(out)))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    want = dist_workers.packed_reference("llama", STEPS, ROWS, SEQ, ACCUMULATION, WORLD,
                                         str(eval_file))
    for zero in (2, 3):
        for got in ranks:  # every rank has the step's loss and the eval loss
            assert got[zero]["losses"] == pytest.approx(want["losses"], rel=1e-9)
            assert got[zero]["evals"] == pytest.approx(want["evals"], rel=1e-9)
            assert got[zero]["held"][:STEPS] == [0] * STEPS
        assert_same_state(ranks[0][zero]["state"], want["state"])
    for got in ranks:  # the GPU evaluation's pass (runtime/cuda/evaluate.py) under ZeRO-3
        gpu_pass, cpu, held = got[3]["held"][STEPS]
        assert gpu_pass == pytest.approx(cpu, rel=1e-6) and held == 0  # fp32 head chunks
    assert len(want["evals"]) == STEPS


def test_the_ranks_count_different_targets_in_the_test_windows():
    """What makes the test above one: a rank's own mean would differ (its rows hold a
    different number of counted targets than the other rank's)."""
    from runtime.train.packing import Packing, denominators

    window = dist_workers.packed_windows(1, ROWS * ACCUMULATION * WORLD, SEQ)[0]
    counted = (window[:, :-1] != dist_workers.SEP).reshape(WORLD, ACCUMULATION, -1).sum(-1)
    assert counted[0].tolist() != counted[1].tolist()
    assert denominators(window, Packing(dist_workers.SEP), ROWS, WORLD) == \
        [float(n) / WORLD for n in counted.sum(0)]


def _request(**options):
    from runtime.train.run import Request

    return Request(file="std/models/llama.module", data="x.bin", seq=8, batch=2, steps=1,
                   device="cpu", **options)


def test_doc_sep_and_eval_data_are_taken_with_every_parallelism():
    """--doc-sep and --eval-data in one process, data, tensor and pipeline parallel
    (tests/test_tp_packed.py, tests/test_tp_eval.py, tests/test_pipeline_packed_eval.py):
    neither check refuses a layout."""
    from runtime.train.evaluate import check_eval_options
    from runtime.train.packing import check_options

    for option in (dict(zero=2), dict(tp=2), dict(tp=2, zero=3), dict(pp=2),
                   dict(pp=2, tp=2)):
        check_options(_request(doc_sep=1, **option))
    check_eval_options("e.bin", 2, None)


def test_torchrun_packs_and_evaluates_as_one_process(eval_file, tmp_path):
    """`torchrun --nproc-per-node 2 -m modulec train --zero 3 --doc-sep --eval-data`
    end to end (the run's wiring: each rank's rows, the denominators, the evaluation
    split unevenly, 5 batches, rank 0 alone reporting): the packed losses are one
    process's on `--batch 2` (float32 CPU runs: to rounding), and each evaluation is
    reported once."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_cli import run

    data = tmp_path / "train.bin"
    rng = np.random.default_rng(5)
    tokens = rng.integers(2, 64, 2000)
    tokens[rng.random(tokens.size) < 0.15] = dist_workers.SEP
    tokens.astype("<u2").tofile(data)
    sizes = dict(vocab_size=64, d_model=32, n_layers=2, num_heads=4, num_kv_heads=2,
                 d_ff=48, max_seq=64)
    args = ["std/models/llama.module", "--init", "random",
            *[a for k, v in sizes.items() for a in ("--set", f"{k}={v}")],
            "--data", str(data), "--seq", str(SEQ), "--device", "cpu", "--lr", "1e-2",
            "--format", "json", "--steps", "2", "--doc-sep", str(dist_workers.SEP)]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "modulec", "train", *args, "--batch", "1",
         "--zero", "3", "--eval-data", str(eval_file), "--eval-every", "1",
         "--eval-batches", "5"],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]  # rank 0 alone reports
    assert all(isinstance(r["eval_loss"], float) for r in steps)
    assert any("split over the 2 data-parallel ranks" in r.get("text", "") for r in rows)
    one = run("train", *args, "--batch", "2")
    assert one.exit_code == 0, one.output
    want = [json.loads(line)["loss"] for line in one.stdout.splitlines()
            if line.startswith('{"event": "step"')]
    assert [r["loss"] for r in steps] == pytest.approx(want, rel=1e-5)
