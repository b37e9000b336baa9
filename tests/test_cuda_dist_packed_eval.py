"""Packed sequences and evaluation under data parallel on two GPUs (NCCL; `-m cuda`,
skipped with fewer than two), through `modulec train`'s CUDATrainer: packed ZeRO-2 and
ZeRO-3 steps with accumulation (the denominators in the step's static buffer, eager,
captured and replayed) train as one GPU packed on every rank's rows (bf16: losses within
1e-2, the masters' updates pointing the same way), every rank reports the global loss,
and the evaluation split over the ranks (3 batches: unevenly; ZeRO-3's forward gathering
its weights between graph replays and holding no buffer after) is one GPU's on every
rank (before any step: the same weights, so equal up to the sums' order). The exact
(float64) equalities are the CPU test's: tests/test_dist_packed_eval.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import assert_moved_alike, free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

STEPS, ROWS, SEQ, ACCUMULATION, WORLD = 4, 2, 128, 2, 2


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    rng = np.random.default_rng(4)
    tokens = rng.integers(2, dist_workers.GPU_LLAMA[1]["vocab_size"], 3 * ROWS * SEQ + 1)
    tokens[rng.random(tokens.size) < 0.05] = dist_workers.SEP
    path = tmp_path_factory.mktemp("eval") / "eval.bin"
    tokens.astype("<u2").tofile(path)
    return path


@pytest.mark.parametrize("zero", [2, 3])
def test_packed_data_parallel_steps_and_evaluation_on_two_gpus(zero, eval_file, tmp_path):
    out = tmp_path / f"packed{zero}"
    mp.spawn(dist_workers.gpu_packed_sharded, nprocs=WORLD,
             args=(WORLD, free_port(), zero, STEPS, ROWS, SEQ, ACCUMULATION, str(eval_file),
                   str(out)))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    want = dist_workers.gpu_packed_reference(STEPS, ROWS, SEQ, ACCUMULATION, WORLD,
                                             str(eval_file))
    for got in ranks:
        assert got["evals"][0] == pytest.approx(want["evals"][0], rel=1e-5)
        assert got["evals"] == pytest.approx(want["evals"], rel=1e-2)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-2)
        assert got["held"] == [0] * (STEPS + 1)  # ZeRO-3's evaluation drops its buffers
    # the ranks' mean (one all_reduce), on every rank
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"], rel=1e-6)
    masters, initial = ranks[0]["masters"], want["initial"]
    assert_moved_alike(masters, want["masters"], initial)
