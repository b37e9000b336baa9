"""Packed sequences (`--doc-sep`) under tensor parallel on two GPUs (NCCL; `-m cuda`,
skipped with fewer than two), through `modulec train`'s CUDATrainer: TP 2 (and TP 2 with
--sp) packed steps with accumulation (each rank's FlashAttention-2 varlen attention on
its heads, RoPE on the restarting positions, the vocab-parallel loss leaving the target
after a separator out; eager, captured and replayed) train as one GPU packed on the same
rows (bf16: losses within 1e-2, the masters' updates pointing the same way), and the
vocab-parallel loss divides by packed data parallel's denominator from the step's static
buffer (the loss and gradients scale by count / denominator: DP x TP's loss). The exact
(float64) equalities are the CPU test's: tests/test_tp_packed.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import assert_moved_alike, free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

STEPS, ROWS, SEQ, ACCUMULATION, WORLD = 4, 2, 128, 2, 2


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_packed_tensor_parallel_steps_on_two_gpus(sp, tmp_path):
    from runtime.tensor_parallel import unshard_params

    out = tmp_path / "packed"
    mp.spawn(dist_workers.gpu_packed_tp, nprocs=WORLD,
             args=(WORLD, free_port(), sp, STEPS, ROWS, SEQ, ACCUMULATION, str(out)))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    want = dist_workers.gpu_packed_tp_reference(STEPS, ROWS, SEQ, ACCUMULATION)
    for got in ranks:
        assert got["vocab_sharded"]  # the vocab-parallel loss, not the fused head's
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-2)
        scaling = got["scaling"]  # the denominator: loss and gradients x count / it
        assert scaling["loss"] == pytest.approx(scaling["mean"] * scaling["ratio"],
                                                rel=1e-5)
        assert scaling["worst"] < 2e-2
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"], rel=1e-6)
    program = dist_workers._gpu_tp_model(WORLD, 0, sp).source.program(planned=False)
    masters = unshard_params([r["masters"] for r in ranks], program)
    initial = want["initial"]
    assert_moved_alike(masters, want["masters"], initial)


# DP 2 x TP 2 (four GPUs): a rank a row (--batch 1), one micro-batch a step (with
# accumulation one process's micro-batch j would hold other rows than the ranks')
LAUNCHES = {"tp2": (2, ["--tp", "2"], []),
            "dp2-tp2": (4, ["--tp", "2", "--zero", "3", "--batch", "1", "--grad-accum", "1"],
                        ["--grad-accum", "1"])}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_torchrun_doc_sep_with_tp_trains_as_one_gpu(launch, tmp_path):
    """`torchrun -m modulec train --device cuda --tp 2 --doc-sep` end to end (the run's
    wiring: the model's slices drawn from --seed, the same rows on a TP group's ranks,
    under DP x TP each data-parallel rank its rows and the denominators, rank 0
    reporting): the packed losses are one GPU's packed run's (bf16)."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    processes, parallel, alone = LAUNCHES[launch]
    if torch.cuda.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs")
    data = tmp_path / "train.bin"
    rng = np.random.default_rng(5)
    tokens = rng.integers(2, dist_workers.GPU_LLAMA[1]["vocab_size"], 20_000)
    tokens[rng.random(tokens.size) < 0.05] = dist_workers.SEP
    tokens.astype("<u2").tofile(data)
    args = ["std/models/llama.module", "--init", "random", "--seed", "3",
            *[a for k, v in dist_workers.GPU_LLAMA[1].items() for a in ("--set", f"{k}={v}")],
            "--data", str(data), "--seq", str(SEQ), "--batch", "2", "--grad-accum", "2",
            "--steps", "3", "--device", "cuda", "--lr", "1e-3", "--format", "json",
            "--doc-sep", str(dist_workers.SEP)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")

    def losses(launcher, more):  # click keeps an option's last value
        done = subprocess.run([*launcher, "-m", "modulec", "train", *args, *more], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr  # whole: the failing rank's error is not last
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return [r["loss"] for r in rows if r["event"] == "step"]
    got = losses([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                  str(processes), "--master-port", str(free_port())], parallel)
    want = losses([sys.executable], alone)
    assert len(got) == 3 and got == pytest.approx(want, rel=2e-2)
