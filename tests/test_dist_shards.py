"""Per-rank shard checkpoints (issue 17, item 5): under ZeRO >= 1 every rank writes what it
holds beside the consolidated checkpoint; a resume on the same layout loads the shards
(bit for bit the uninterrupted run on gloo), one on another layout the consolidated files
(2 -> 1 and 1 -> 2 are in test_train_dist.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_dist_zero import free_port  # noqa: E402
from tests.test_train import LLAMA, ckpt, losses, train  # noqa: E402,F401


def torchrun_rows(ckpt, *args, processes=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes), "--master-port", str(free_port()), "-m", "modulec", "train",
               str(LLAMA), "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--lr", "1e-2", "--format", "json", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _files(folder) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


def test_a_resume_on_the_same_layout_reads_the_shards_bit_for_bit(ckpt, tmp_path):
    whole = torchrun_rows(ckpt, "--hf-weights", ckpt / "hf", "--steps", "4", "--zero", "3",
                          "--save", tmp_path / "a", "--save-every", "2")
    saved = tmp_path / "a" / "checkpoint-2"
    index = json.loads((saved / "shard-rank00001.json").read_text())
    assert (index["world"], index["rank"], index["zero"], index["tp"], index["step"]) == \
        (2, 1, 3, 1, 2) and index["data"]["samples"] == 4
    resumed = torchrun_rows(ckpt, "--steps", "4", "--zero", "3", "--resume", saved,
                            "--save", tmp_path / "b")
    notes = [r["text"] for r in resumed if r["event"] == "note"]
    assert "resumed at step 2 from the per-rank shards (2 ranks, ZeRO 3)" in notes
    loss = [r["loss"] for r in whole if r["event"] == "step"]
    assert [r["loss"] for r in resumed if r["event"] == "step"] == loss[2:]
    a, b = _files(tmp_path / "a" / "checkpoint-4"), _files(tmp_path / "b" / "checkpoint-4")
    assert a.keys() == b.keys() and "shard-rank00000.safetensors" in a
    for name in a:  # shards, moments, masters: the same bits
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    # one process (2 -> 1): the consolidated files, and the run says so
    one = train(ckpt, "--steps", "3", "--resume", saved, weights=False)
    notes = [json.loads(line)["text"] for line in one.stdout.splitlines()
             if '"note"' in line]
    assert "resumed at step 2 from the consolidated checkpoint (this run is one process)" \
        in notes
    assert losses(one) == pytest.approx(loss[2:3], rel=1e-5)


def test_a_whole_rank_state_round_trips_through_its_shard(tmp_path):
    """Tensor parallel alone keeps no ZeRO buckets: a rank's shard is its (sliced)
    parameters' masters and moments by path, put back exactly by a resume."""
    from types import SimpleNamespace

    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW
    from runtime.train.shards import layout, load_rank_tensors, rank_tensors
    from tests.dist_workers import tiny_model, windows

    def trainer():
        return CPUTrainer(tiny_model("llama"), 2, 8, AdamW(lr=1e-2, weight_decay=0.1))

    first = trainer()
    first.train_step(windows(1, 2, 8)[0])
    tensors = rank_tensors(first)
    second = trainer()
    load_rank_tensors(second, tensors, 1)
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        a, b = first.state()[part], second.state()[part]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert second.adamw.step == 1
    run = SimpleNamespace(dp=1, dp_rank=0, zero=2, tp=2)
    shape = layout(second, run, SimpleNamespace(world=2, rank=1))
    assert (shape["tp"], shape["tp_rank"], shape["zero"]) == (2, 1, None)
    assert shape["layout"] == layout(first, run, SimpleNamespace(world=2, rank=1))["layout"]
