"""Auxiliary losses under pipeline parallel on two GPUs (NCCL; `-m cuda`, skipped with
fewer than two): the router statistics and an early `aux_loss` cross over NCCL as on
gloo. The CPU test's
runs (tests/test_pipeline_aux.py: std Mixtral cut inside its stack, Qwen3-MoE, an
`@partition` Mixtral whose aux loss is made on stage 0) in float64 on two GPUs (the
reference interpreter on CUDA tensors, `mixed=False`) equal one CPU process with
--grad-accum 2; and `torchrun --nproc-per-node 2 -m modulec train --pp 2 --device cuda`
of a tiny std Mixtral with its load-balancing loss (bf16 stages:
runtime/train/pipeline_precision.py) reports one CPU process's --grad-accum 4 losses
(float32) within bf16 rounding, the aux term included."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import pipeline_aux_workers as workers  # noqa: E402
from tests.dist_testing import free_port, needs_gpus, train_records  # noqa: E402
from tests.test_pipeline_aux import RUNS, write_eval_file  # noqa: E402

pytestmark = needs_gpus(2)


def test_two_gpu_stages_train_the_aux_loss_as_one_cpu_process(tmp_path):
    eval_path = str(write_eval_file(tmp_path))
    mp.spawn(workers.train_pipelined, nprocs=2,
             args=(2, free_port(), RUNS, eval_path, str(tmp_path / "stage"), "cuda"))
    stages = [torch.load(tmp_path / f"stage.{r}") for r in (0, 1)]
    for index, (name, *sizes) in enumerate(RUNS):
        want = workers.reference(name, *sizes, eval_path)
        first, second = (s[index] for s in stages)
        assert first["losses"] == second["losses"] == pytest.approx(want["losses"],
                                                                    rel=1e-10), name
        assert first["eval"] == pytest.approx(want["eval"], rel=1e-10), name
        for part in ("masters", "exp_avg", "exp_avg_sq"):
            got = first["state"][part] | second["state"][part]
            assert set(got) == set(want["state"][part]), (name, part)
            for path, value in want["state"][part].items():
                torch.testing.assert_close(got[path], value, rtol=1e-8, atol=1e-10,
                                           msg=f"{name} {part} {path}")


MIXTRAL = dict(n_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=128,
               max_seq=64, num_experts=4, top_k=2, output_router_logits="true",
               aux_loss_coef=0.5)


def test_modulec_train_pp2_on_gpus_reports_the_aux_loss_as_one_process(tmp_path):
    data = tmp_path / "tokens.bin"
    np.random.default_rng(5).integers(0, 128, 20_000).astype("<u2").tofile(data)
    sets = [a for k, v in MIXTRAL.items() for a in ("--set", f"{k}={v}")]
    args = ["std/models/mixtral.module", "--init", "random", "--seed", "3", *sets,
            "--data", str(data), "--seq", "32", "--batch", "1", "--steps", "3",
            "--lr", "1e-3", "--format", "json"]

    def losses(processes, *more):
        rows = train_records(processes, *args, *more)
        return [r["loss"] for r in rows if r["event"] == "step"]

    got = losses(2, "--device", "cuda", "--pp", "2", "--microbatches", "4")
    want = losses(1, "--device", "cpu", "--grad-accum", "4")
    # bf16 stages (runtime/train/pipeline_precision.py) against float32: bf16 rounding
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-2)
    without = losses(1, "--device", "cpu", "--grad-accum", "4", "--set", "aux_loss_coef=0")
    assert min(a - b for a, b in zip(want, without)) > 0.1  # the aux term is in the loss
