"""Data parallel on two GPUs (NCCL; `-m cuda`, skipped with fewer than two): each ZeRO
stage's step, eager and then replayed from one CUDA graph with its collectives, trains as
one GPU does on the whole batch (bf16: losses within 1e-2, the masters' updates pointing
the same way), holding the bytes the compiler predicts (rank_fixed_bytes); tensor (and
sequence) parallel on two, DP 2 x TP 2 on four (skipped with fewer)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import assert_moved_alike, free_port, needs_gpus  # noqa: E402
from tests.kernel_testing import relative_error  # noqa: E402

pytestmark = needs_gpus(2)

STEPS, ROWS, SEQ = 4, 4, 128


@pytest.fixture(scope="module")
def reference():
    return dist_workers.gpu_reference(STEPS, ROWS, SEQ)


@pytest.fixture(scope="module")
def initial():
    from runtime.cuda.step import TrainStep

    step = TrainStep.from_module(dist_workers.GPU_LLAMA[0], dist_workers.GPU_LLAMA[1],
                                 batch=ROWS, seq=SEQ).init_random(0)
    return {p: step.masters[p].cpu() for p in step.names}


def sharded(zero: int, tmp_path) -> dict:
    out = tmp_path / f"zero{zero}.pt"
    mp.spawn(dist_workers.gpu_sharded, nprocs=2,
             args=(2, free_port(), zero, STEPS, ROWS, SEQ, str(out)))
    return torch.load(out)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_zero_stage_trains_as_one_gpu(zero, reference, initial, tmp_path):
    want_losses, want = reference
    got = sharded(zero, tmp_path)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)
    assert_moved_alike(got["masters"], want, initial)
    assert got["fixed_bytes"] == got["predicted_bytes"]  # what `modulec plan --dp` says
    # ZeRO-3's entry weights: gathered into buffers within the step, none held after it
    assert got["buffer_numel_after"] == 0
    assert got["peak_buffer_numel"] == (got["predicted_buffer_numel"] if zero == 3 else 0)


def test_zero2_gathers_on_copy_engines_as_on_sms(initial, tmp_path, monkeypatch):
    """The weights' all-gathers on the copy engines (NCCL's zero-CTA policy, the weights
    in a symmetric window: runtime/dist/ce_gather.py) train as the SM all-gathers do:
    a gather copies, so the same losses and masters up to the backward's own run-to-run
    rounding."""
    on = sharded(2, tmp_path)
    monkeypatch.setenv("MODULEC_ZERO_CE_GATHER", "0")
    (tmp_path / "sm").mkdir()
    off = sharded(2, tmp_path / "sm")
    assert (on["gather_transport"], off["gather_transport"]) == \
        ("copy engines", "SMs: MODULEC_ZERO_CE_GATHER=0")
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-3)
    assert_moved_alike(on["masters"], off["masters"], initial, least=0.999)


def test_tensor_parallel_trains_as_one_gpu(reference, tmp_path):
    """TP 2 from the same whole weights (sliced per rank) and the same batches as the
    one-GPU reference: the losses within bf16 rounding."""
    out = tmp_path / "tp.pt"
    mp.spawn(dist_workers.gpu_tensor_parallel, nprocs=2,
             args=(2, free_port(), STEPS, ROWS, SEQ, str(out)))
    want_losses, _ = reference
    assert torch.load(out)["losses"] == pytest.approx(want_losses, rel=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
@pytest.mark.parametrize("zero", [1, 3])
def test_dp_x_tp_trains_as_one_gpu(zero, reference, tmp_path):
    """DP 2 x TP 2 on four GPUs (issue 20's Llama-3-8B layout): ZeRO across the two TP
    pairs, each pair on its own half of the rows, eager and captured (two NCCL groups in
    one CUDA graph): the losses, averaged over the pairs, within bf16 rounding of one
    GPU's on the whole batch."""
    out = tmp_path / f"dp_tp_zero{zero}.pt"
    mp.spawn(dist_workers.gpu_dp_tp, nprocs=4,
             args=(4, free_port(), zero, STEPS, ROWS, SEQ, str(out)))
    want_losses, _ = reference
    got = torch.load(out)
    assert got["dp"] == 2
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)


CLIP = 0.05  # below the random model's gradient norm: every step clips


@pytest.mark.parametrize("gpus", [2, pytest.param(4, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs four GPUs"))])
def test_tensor_parallel_clips_as_one_gpu(gpus, tmp_path):
    """--clip-grad under TP 2 (two GPUs: the held gradients' norm, the slices' squares
    all-reduced over the pair in the CUDA graph; four: DP 2 x TP 2 under ZeRO-1, the
    ZeRO run's sums reduced over DP, then the slices' over TP): the losses and the last
    step's norm within bf16 rounding of one GPU's with the same clip, which clips."""
    out = tmp_path / f"tp_clip{gpus}.pt"
    mp.spawn(dist_workers.gpu_dp_tp, nprocs=gpus,
             args=(gpus, free_port(), 1, STEPS, ROWS, SEQ, str(out), 2, CLIP))
    want_losses, want = dist_workers.gpu_reference(STEPS, ROWS, SEQ, clip=CLIP)
    got = torch.load(out)
    assert float(want["grad_norm"]) > CLIP
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)
    assert float(got["grad_norm"]) == pytest.approx(float(want["grad_norm"]), rel=2e-2)


def test_sequence_parallel_trains_as_one_gpu(reference, tmp_path):
    """TP 2 with sequence parallel (`--sp`: the norms on T / 2 rows a GPU, all-gather /
    reduce-scatter on NCCL around each sharded region), eager and captured: the losses
    within bf16 rounding of one GPU's."""
    out = tmp_path / "sp.pt"
    mp.spawn(dist_workers.gpu_tensor_parallel, nprocs=2,
             args=(2, free_port(), STEPS, ROWS, SEQ, str(out), True))
    want_losses, _ = reference
    got = torch.load(out)
    # std Llama's vocab-parallel embedding: its partial sums reduce-scattered into the
    # blocks (no sp_scatter), the head's input all-gathered (no sp_gather)
    assert {"vocab_parallel_embedding", "sp_all_gather", "sp_reduce_scatter"} <= got["ops"]
    assert not {"sp_scatter", "sp_gather"} & got["ops"]
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_head_and_loss_train_as_one_gpu(tied, reference, tmp_path):
    """TP 2 with std Llama's embedding and LM head split over the vocabulary
    (`@shard(vocab)`; tied: one table for both): the step takes the vocab-parallel loss
    (torch ops, a MAX and a SUM all-reduce on NCCL inside the CUDA graph) instead of the
    fused head, eager and replayed: the losses within bf16 rounding of one GPU's (whole
    table, fused head + cross-entropy)."""
    more = {"tie_word_embeddings": "true"} if tied else {}
    out = tmp_path / "vocab.pt"
    mp.spawn(dist_workers.gpu_tensor_parallel, nprocs=2,
             args=(2, free_port(), STEPS, ROWS, SEQ, str(out), False, more))
    want_losses, _ = dist_workers.gpu_reference(STEPS, ROWS, SEQ, more=more) if tied \
        else reference
    got = torch.load(out)
    assert got["vocab_sharded"] and not got["split"]
    assert "vocab_parallel_embedding" in got["ops"]
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_overlap_trains_as_in_order(sp, tmp_path):
    """TP 2 (and with --sp) built with the tp_overlap pass (each backward all-reduce /
    reduce-scatter of an input gradient on the comm stream beside the weight gradient's
    GEMM, joined at its wait) and with --no-tp-overlap, from the same weights and
    batches: the first loss and every gradient (eager) agree to bf16 rounding (the same
    kernels on the same bytes: in practice bitwise), and so do the losses and masters of
    eager, captured and replayed steps (the overlap inside the CUDA graph)."""
    out = tmp_path / f"overlap{int(sp)}.pt"
    mp.spawn(dist_workers.gpu_tp_overlap, nprocs=2,
             args=(2, free_port(), STEPS, ROWS, SEQ, str(out), sp))
    got = torch.load(out)
    on, off = got[True], got[False]
    assert on["waits"] > 0 and on["issued"] > 0  # the overlapped program ran async ops
    assert off["waits"] == 0 and off["issued"] == 0
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-3)
    assert set(on["grads"]) == set(off["grads"])
    for path, grad in off["grads"].items():
        assert relative_error(on["grads"][path], grad) < 1e-2, path
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-2)
    for path, master in off["masters"].items():
        assert relative_error(on["masters"][path], master) < 1e-2, path
