"""Per-rank shard checkpoints (issue 17, item 5): under ZeRO >= 1 every rank writes what it
holds into the checkpoint; a resume on the same layout loads its own shard (bit for bit
the uninterrupted run on gloo), one on another layout the whole state (2 -> 1 here and in
test_train_dist.py, 1 -> 2 there)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")
pytest.importorskip("transformers")

from tests import shard_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.test_train import LLAMA, ckpt, losses, train  # noqa: E402,F401


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.startswith("{")]


def _files(folder) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


def test_a_resume_on_the_same_layout_reads_the_shards_bit_for_bit(ckpt, tmp_path):
    """Two ranks, ZeRO-3 (`modulec train`'s entry in each, as under torchrun): 4 steps
    saving at 2 and 4; then a run resumed from step 2's shards."""
    from pathlib import Path

    saved = tmp_path / "a" / "checkpoint-2"
    common = dict(file=Path(LLAMA), data=ckpt / "tokens.bin", seq=16, batch=1, steps=4,
                  device="cpu", lr=1e-2, fmt="json", zero=3)
    runs = [common | dict(hf_weights=ckpt / "hf", save=tmp_path / "a", save_every=2),
            common | dict(resume=saved, save=tmp_path / "b")]
    out = tmp_path / "rank"
    spawn(shard_workers.train_runs, nprocs=2,
             args=(2, [free_port(), free_port()], runs, str(out)))
    whole, resumed = _rows(tmp_path / "rank.0.0"), _rows(tmp_path / "rank.1.0")
    index = json.loads((saved / "shard-rank00001.json").read_text())
    assert (index["world"], index["rank"], index["zero"], index["tp"], index["step"]) == \
        (2, 1, 3, 1, 2) and index["data"]["samples"] == 4
    notes = [r["text"] for r in resumed if r["event"] == "note"]
    assert "resumed at step 2 from the per-rank shards (2 ranks, ZeRO 3)" in notes
    loss = [r["loss"] for r in whole if r["event"] == "step"]
    assert [r["loss"] for r in resumed if r["event"] == "step"] == loss[2:]
    a, b = _files(tmp_path / "a" / "checkpoint-4"), _files(tmp_path / "b" / "checkpoint-4")
    assert a.keys() == b.keys() and "shard-rank00000.safetensors" in a
    for name in a:  # shards (masters, moments) and weights: the same bits
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    # one process (2 -> 1): the whole state, and the run says so
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
