"""`torchrun --nproc-per-node 2 -m modulec train --device cpu --zero S` (gloo): the two
processes train as one process on the same total batch, rank 0 writes one consolidated
checkpoint, and that checkpoint resumes on another number of processes (2 -> 1, 1 -> 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_dist_zero import free_port  # noqa: E402
from tests.test_train import LLAMA, _tensors, ckpt, events, losses, train  # noqa: E402,F401


def torchrun(ckpt, *args, weights=True, file=LLAMA):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "modulec", "train", str(file),
               "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--lr", "1e-2", "--format", "json",
               *(["--hf-weights", str(ckpt / "hf")] if weights else []), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_two_processes_train_as_one_and_resume_on_either(ckpt, tmp_path):
    one = losses(train(ckpt, "--steps", "4", "--save", tmp_path / "one"))
    two = torchrun(ckpt, "--steps", "2", "--zero", "3", "--save", tmp_path / "two")
    assert len(two) == 2 and two == pytest.approx(one[:2], rel=1e-5)
    # 2 -> 1: one process continues the two-process checkpoint
    rest = losses(train(ckpt, "--steps", "4", "--resume", tmp_path / "two", "--save",
                        tmp_path / "two", weights=False))
    assert rest == pytest.approx(one[2:], rel=1e-4)
    a, b = _tensors(tmp_path / "one" / "checkpoint-4"), _tensors(tmp_path / "two" / "checkpoint-4")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)
    # 1 -> 2: two processes continue the one-process checkpoint of step 2
    losses(train(ckpt, "--steps", "2", "--save", tmp_path / "first"))
    more = torchrun(ckpt, "--steps", "4", "--zero", "2", "--resume", tmp_path / "first",
                    weights=False)
    assert more == pytest.approx(one[2:], rel=1e-4)


def test_zero_without_processes_is_an_error(ckpt):
    result = train(ckpt, "--steps", "1", "--zero", "2")
    assert result.exit_code == 1
    assert "--zero 2" in result.output and "torchrun --nproc-per-node" in result.output


def test_an_ir_document_trains_as_its_module(ckpt, tmp_path):
    """The IR is the contract: `modulec train x.ir` (one process, and two with the IR's
    distributed section) gives the steps the .module gives, bit for bit on one process."""
    from tests.test_cli import run

    config = ckpt / "hf" / "config.json"
    plain, sharded = tmp_path / "llama.ir", tmp_path / "llama-dp2.ir"
    shapes = ["--shape", "B=2", "--shape", "T=16", "--config", config]
    assert run("build", LLAMA, *shapes, "-o", plain).exit_code == 0
    assert run("build", LLAMA, "--shape", "B=1", "--shape", "T=16", "--config", config,
               "--dp", "2", "--zero", "3", "-o", sharded).exit_code == 0
    want = losses(train(ckpt, "--steps", "3", "--save", tmp_path / "module"))
    got = losses(run("train", plain, "--data", ckpt / "tokens.bin", "--seq", "16",
                     "--batch", "2", "--device", "cpu", "--lr", "1e-2", "--format", "json",
                     "--hf-weights", ckpt / "hf", "--steps", "3", "--save", tmp_path / "ir"))
    assert got == want
    a, b = _tensors(tmp_path / "module" / "checkpoint-3"), _tensors(tmp_path / "ir" / "checkpoint-3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    two = torchrun(ckpt, "--steps", "3", file=sharded)
    assert two == pytest.approx(want, rel=1e-5)
    refused = run("train", sharded, "--data", ckpt / "tokens.bin", "--seq", "16", "--batch",
                  "1", "--device", "cpu", "--hf-weights", ckpt / "hf", "--steps", "1",
                  "--set", "d_model=64")
    assert refused.exit_code == 1 and "--set" in refused.output

