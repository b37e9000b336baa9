"""Stages sharing a parameter on two GPUs (NCCL; `-m cuda`, skipped with fewer than two):
each stage's copy of a tied embedding lives on its GPU and the copies' gradients are
summed over NCCL in the entry's group (docs/pipeline.md "Shared and tied parameters").
The CPU test's runs (tests/test_pipeline_shared.py: the tied Llama with and without
clipping, GPT-2's `tied_to` head) in float64 on two GPUs equal one CPU process with
--grad-accum 2; and `torchrun --nproc-per-node 2 -m modulec train --pp 2 --device cuda`
of the tiny std GPT-2 reports one CPU process's --grad-accum 4 losses (float32), its
checkpoint holding `wte` once, which one CPU process resumes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import pipeline_shared_workers as workers  # noqa: E402
from tests.dist_testing import free_port, needs_gpus, train_records  # noqa: E402
from tests.runtime_models import GPU_ONLY  # noqa: E402
from tests.test_pipeline_shared import RUNS, SHARED, reference  # noqa: E402

pytestmark = needs_gpus(2)


def test_two_gpu_stages_sharing_a_parameter_train_as_one_cpu_process(tmp_path):
    mp.spawn(workers.train_shared, nprocs=2,
             args=(2, free_port(), RUNS, str(tmp_path / "stage"), None, "cuda"))
    stages = [torch.load(tmp_path / f"stage.{r}") for r in (0, 1)]
    for index, (name, clip, *sizes) in enumerate(RUNS):
        want_losses, want_norms, want = reference(name, clip, *sizes)
        first, second = (s[index] for s in stages)
        for stage in (first, second):
            assert stage["losses"] == pytest.approx(want_losses, rel=1e-10), name
            assert stage["norms"] == pytest.approx(want_norms, rel=1e-10), name
        param = SHARED[name][0]
        assert torch.equal(first["params"][param], second["params"][param])  # the copies
        for part in ("masters", "exp_avg", "exp_avg_sq"):
            got = first["whole"][part]
            assert set(got) == set(want[part]), (name, part)
            for path, value in want[part].items():
                torch.testing.assert_close(got[path], value, rtol=1e-8, atol=1e-10,
                                           msg=f"{name} {part} {path}")


def test_modulec_train_pp2_on_gpus_trains_a_tied_gpt2_as_one_process(tmp_path):
    from safetensors.torch import load_file

    data = tmp_path / "tokens.bin"
    np.random.default_rng(5).integers(0, 64, 20_000).astype("<u2").tofile(data)
    path, settings = GPU_ONLY["gpt2"]
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    args = [path, *sets, "--data", str(data), "--seq", "32", "--batch", "1", "--steps",
            "3", "--lr", "1e-3", "--format", "json"]

    def losses(processes, *more):
        rows = train_records(processes, *args, *more)
        return [r["loss"] for r in rows if r["event"] == "step"]

    got = losses(2, "--init", "random", "--device", "cuda", "--pp", "2", "--microbatches",
                 "4", "--save", str(tmp_path / "pp"), "--save-every", "2")
    want = losses(1, "--init", "random", "--device", "cpu", "--grad-accum", "4")
    # bf16 stages (runtime/train/pipeline_precision.py) against float32: bf16 rounding
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-2)
    saved = load_file(str(tmp_path / "pp" / "checkpoint-2" / "model.safetensors"))
    assert "transformer.wte.weight" in saved and not [k for k in saved if "lm_head" in k]
    resumed = losses(1, "--resume", str(tmp_path / "pp" / "checkpoint-2"), "--device",
                     "cpu", "--grad-accum", "4")
    assert resumed == pytest.approx(want[2:], rel=1e-2)
