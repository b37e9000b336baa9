"""Global gradient-norm clipping under ZeRO on two GPUs (NCCL; `-m cuda`, skipped with
fewer than two): the norm is one all_reduce of the ranks' shard square sums and the shard
updates wait for it (runtime/dist/zero.py); with weight decay and its default exclusions
(per-run decay inside a shard), eager and replayed from one CUDA graph, the run trains as
one GPU with the same clipping on the whole batch; so does std Llama with its head tied to
the embedding under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.test_cuda_dist import ROWS, SEQ, STEPS, initial  # noqa: E402,F401
from tests.dist_testing import assert_moved_alike, free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

CLIP = 0.05  # below the random model's gradient norm: every step clips


@pytest.fixture(scope="module")
def clipped_reference():
    return dist_workers.gpu_reference(STEPS, ROWS, SEQ, CLIP)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_clipping_trains_as_one_gpu(zero, clipped_reference, initial, tmp_path):
    _clipped_as_one_gpu(zero, STEPS, clipped_reference, initial, tmp_path / f"zero{zero}.pt")


def _clipped_as_one_gpu(zero: int, steps: int, reference, initial, out, more=None) -> None:
    """Two GPUs under ZeRO `zero`, clipped, train as one GPU: the losses and the last
    step's norm (which clips) within bf16 rounding, every master moved the same way."""
    want_losses, want = reference
    mp.spawn(dist_workers.gpu_sharded, nprocs=2,
             args=(2, free_port(), zero, steps, ROWS, SEQ, str(out), CLIP, more))
    got = torch.load(out)
    assert len(want_losses) == steps
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)
    norm, want_norm = float(got["masters"]["grad_norm"]), float(want["grad_norm"])
    assert want_norm > CLIP and norm == pytest.approx(want_norm, rel=2e-2)
    assert_moved_alike(got["masters"], want, initial, skip=("grad_norm",))


TIED, TIED_STEPS = {"tie_word_embeddings": "true"}, 3  # eager, captured, replayed


@pytest.fixture(scope="module")
def tied_reference():
    """One GPU, std Llama with its head tied to the embedding, clipped: (losses, masters
    and the last step's norm) and the first weights."""
    from runtime.cuda.step import TrainStep

    first = TrainStep.from_module(dist_workers.GPU_LLAMA[0], dist_workers.GPU_LLAMA[1] | TIED,
                                  batch=ROWS, seq=SEQ).init_random(0)
    initial = {p: first.masters[p].cpu() for p in first.names}
    del first
    return dist_workers.gpu_reference(TIED_STEPS, ROWS, SEQ, CLIP, more=TIED), initial


@pytest.mark.parametrize("zero", [2, 3])
def test_a_tied_head_with_clipping_trains_as_one_gpu(zero, tied_reference, tmp_path):
    """The GPU side of tests/test_dist_zero.py's tied, clipped runs (gloo, float64): the
    head reads the embedding's table and its gradient joins the embedding's, reduced over
    two GPUs under ZeRO-2 and ZeRO-3 (there the table is gathered for both uses) with
    global clipping, eager, captured and replayed: the losses and the last step's norm
    within bf16 rounding of one GPU's on the whole batch, which clips, and every master
    moved the same way."""
    reference, initial = tied_reference
    _clipped_as_one_gpu(zero, TIED_STEPS, reference, initial,
                        tmp_path / f"tied_zero{zero}.pt", TIED)
