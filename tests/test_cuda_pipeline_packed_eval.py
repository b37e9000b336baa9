"""Packed sequences (--doc-sep) and evaluation (--eval-data) under pipeline parallel on
GPUs (NCCL; `-m cuda`; two GPUs, DP x PP and TP x PP on four, skipped with fewer): the
stages run eagerly (the GPU step's kernels on bf16 copies of fp32 masters:
runtime/train/pipeline_precision.py), each holding the micro-batch's documents on its GPU,
and the evaluation sends each batch forward through the stages. `torchrun -m modulec train
--pp 2 --device cuda --doc-sep --eval-data` trains and evaluates as the same run on the CPU
(one process with --grad-accum M; pipelines x data parallel: ZeRO-2 data parallel, whose
packed denominators they share) within bf16 rounding. The exact (float64) equalities are the CPU test's:
tests/test_pipeline_packed_eval.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.dist_testing import needs_gpus, train_records  # noqa: E402
from tests.test_cuda_dist_shards import LLAMA, gpu_ckpt  # noqa: E402,F401

pytestmark = needs_gpus(2)

SEP = 1
BF16 = 1e-2  # relative: a bf16 step's loss against float32's over three steps
ARGS = ("--seq", "64", "--lr", "1e-3", "--format", "json", "--steps", "3",
        "--doc-sep", str(SEP), "--eval-every", "2")


@pytest.fixture(scope="module")
def packed(gpu_ckpt, tmp_path_factory):
    """The data and eval files (ids of gpu_ckpt's vocabulary, 5% separators), and the
    arguments that give them and the weights."""
    folder = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(6)
    for name, size in (("train.bin", 20000), ("eval.bin", 5 * 64 + 1)):
        tokens = rng.integers(2, 512, size)
        tokens[rng.random(size) < 0.05] = SEP
        tokens.astype("<u2").tofile(folder / name)
    return ("--data", str(folder / "train.bin"), "--eval-data", str(folder / "eval.bin"),
            "--hf-weights", str(gpu_ckpt / "hf"))


def _launch(processes: int, *args) -> list[dict]:
    """The step records (loss, eval_loss) of `modulec train` on `processes` (1: no
    torchrun)."""
    return [r for r in train_records(processes, LLAMA, *args) if r["event"] == "step"]


def _same(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=BF16)
    evals = [r.get("eval_loss") for r in want]
    assert evals[0] is None and None not in evals[1:]  # steps 2 and 3 (the last)
    assert [r.get("eval_loss") for r in got][1:] == pytest.approx(evals[1:], rel=BF16)


def test_two_gpu_stages_pack_and_evaluate_as_one_process(packed):
    got = _launch(2, *packed, *ARGS, "--batch", "2", "--device", "cuda", "--pp", "2",
                  "--microbatches", "4")
    want = _launch(1, *packed, *ARGS, "--batch", "2", "--device", "cpu", "--grad-accum", "4")
    _same(got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_two_gpu_pipelines_pack_and_evaluate_as_zero2_data_parallel(packed):
    """DP 2 x PP 2: each pipeline's micro-batch m divided by the denominator of every
    pipeline's micro-batch m together, as two data-parallel ranks (gloo, CPU) do; the
    evaluation's five batches split unevenly over the pipelines."""
    got = _launch(4, *packed, *ARGS, "--batch", "1", "--device", "cuda", "--pp", "2",
                  "--microbatches", "2")
    want = _launch(2, *packed, *ARGS, "--batch", "1", "--device", "cpu", "--zero", "2",
                   "--grad-accum", "2")
    _same(got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_pp2_tp2_on_four_gpus_packs_and_evaluates_as_one_process(packed):
    """PP 2 x TP 2: each stage's TP ranks hold the same documents; the last stage's
    vocab-parallel loss leaves the ignored targets out."""
    got = _launch(4, *packed, *ARGS, "--batch", "1", "--device", "cuda", "--pp", "2",
                  "--tp", "2", "--microbatches", "2")
    want = _launch(1, *packed, *ARGS, "--batch", "1", "--device", "cpu", "--grad-accum", "2")
    _same(got, want)
