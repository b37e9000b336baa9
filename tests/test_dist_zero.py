"""Data parallel with ZeRO 0-3 on two CPU processes (gloo), executed from the IR's
`distributed` section by the same code the GPU step runs: after two AdamW steps the
parameters and moments equal one process training on the whole batch (float64)."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402

STEPS, ROWS, SEQ = 2, 4, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded(name: str, zero: int, tmp_path) -> dict:
    out = tmp_path / f"{name}-{zero}.pt"
    mp.spawn(dist_workers.train_sharded, nprocs=2,
             args=(2, free_port(), name, zero, STEPS, ROWS, SEQ, str(out)))
    return torch.load(out)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = dist_workers.train_reference(name, STEPS, ROWS, SEQ)
        return cache[name]
    return get


def assert_same_state(got: dict, want: dict) -> None:
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        assert set(got[key]) == set(want[key]), key
        for path, value in want[key].items():
            torch.testing.assert_close(got[key][path], value.to(got[key][path].dtype),
                                       rtol=1e-9, atol=1e-12, msg=f"{key} {path}")
    assert got["step"] == want["step"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_llama_sharded_steps_equal_one_process(zero, reference, tmp_path):
    want_losses, want = reference("llama")
    got = sharded("llama", zero, tmp_path)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-6)  # fp32 cross-entropy
    assert_same_state(got["state"], want)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "llama_tied"])
def test_other_models_with_zero3(name, reference, tmp_path):
    want_losses, want = reference(name)
    got = sharded(name, 3, tmp_path)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-6)  # fp32 cross-entropy
    assert_same_state(got["state"], want)



def test_sliced_calls_of_one_stack_get_buckets_of_their_own(tmp_path):
    """`blocks[0:1]()` then `blocks[1:2]()`: two buckets with names and paths of their
    own (one bucket name for both mixed their gradients up)."""
    from pathlib import Path

    from modulec.plan.distributed import DataParallel, bucket_paths
    from runtime.program import ModuleSource
    from tests.runtime_models import TINY

    text = Path("std/models/llama.module").read_text()
    stacked = "(x0, residual0) -> StackedBlocks(blocks, n_layers) -> (xN, residualN)"
    assert stacked in text
    sliced = ("(x0, residual0) -> blocks[0:1]() -> (x1, r1)\n"
              "      (x1, r1) -> blocks[1:2]() -> (xN, residualN)")
    path = tmp_path / "sliced.module"
    path.write_text(text.replace(stacked, sliced))
    settings = {k: str(v) for k, v in TINY["llama"][1].items()}
    source = ModuleSource(path, settings, search_path=(Path.cwd(),),
                          distributed=DataParallel(2, 2))
    section = source.program({"B": 2, "T": 8}).document["schedule"]["distributed"]
    names = [b["name"] for b in section["buckets"]]
    assert len(names) == len(set(names)) and "blocks[1:2]" in names
    paths = [p for b in section["buckets"] for i in range(b["instances"])
             for p in bucket_paths(b, i)]
    assert len(paths) == len(set(paths)) and "blocks[1].ln1.weight" in paths
