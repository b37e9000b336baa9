"""The loss `modulec train` reports under data parallel on two GPUs (NCCL; `-m cuda`,
skipped with fewer than two): an unpacked ZeRO-2 run through CUDATrainer reports, on
every rank and at every step (eager, captured, replayed), the mean of the two ranks' own
losses, as the CPU trainer does (one all_reduce after the step), not rank 0's own. The
packed case: tests/test_cuda_dist_packed_eval.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

STEPS, ROWS, SEQ, WORLD = 3, 2, 64, 2


def test_unpacked_data_parallel_reports_the_ranks_mean_loss(tmp_path):
    out = tmp_path / "unpacked"
    mp.spawn(dist_workers.gpu_unpacked_loss, nprocs=WORLD,
             args=(WORLD, free_port(), 2, STEPS, ROWS, SEQ, str(out)))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    for step in range(STEPS):
        own = [got["own"][step] for got in ranks]
        # other rows, other losses (at initialization they lie within 1e-3 of log V)
        assert own[0] != own[1]
        for got in ranks:
            assert got["reported"][step] == pytest.approx(sum(own) / WORLD, rel=1e-6)
