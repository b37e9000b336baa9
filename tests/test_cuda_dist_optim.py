"""Global gradient-norm clipping under ZeRO on two GPUs (NCCL; `-m cuda`, skipped with
fewer than two): the norm is one all_reduce of the ranks' shard square sums and the shard
updates wait for it (runtime/dist/zero.py); with weight decay and its default exclusions
(per-run decay inside a shard), eager and replayed from one CUDA graph, the run trains as
one GPU with the same clipping on the whole batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.test_cuda_dist import ROWS, SEQ, STEPS, initial  # noqa: E402,F401
from tests.dist_testing import free_port  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or
                                 torch.cuda.device_count() < 2, reason="needs two GPUs")]

CLIP = 0.05  # below the random model's gradient norm: every step clips


@pytest.fixture(scope="module")
def clipped_reference():
    return dist_workers.gpu_reference(STEPS, ROWS, SEQ, CLIP)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_clipping_trains_as_one_gpu(zero, clipped_reference, initial, tmp_path):
    want_losses, want = clipped_reference
    out = tmp_path / f"zero{zero}.pt"
    mp.spawn(dist_workers.gpu_sharded, nprocs=2,
             args=(2, free_port(), zero, STEPS, ROWS, SEQ, str(out), CLIP))
    got = torch.load(out)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)
    norm, want_norm = float(got["masters"]["grad_norm"]), float(want["grad_norm"])
    assert want_norm > CLIP and norm == pytest.approx(want_norm, rel=2e-2)
    assert set(got["masters"]) == set(want)
    for path in [p for p in want if p != "grad_norm"]:
        moved = got["masters"][path] - initial[path]
        want_moved = want[path] - initial[path]
        cos = float((moved.flatten().double() @ want_moved.flatten().double()) /
                    (moved.norm() * want_moved.norm()).clamp(min=1e-30))
        assert cos > 0.95, (path, cos)
