"""Data parallel with ZeRO 0-3 on two CPU processes (gloo), executed from the IR's
`distributed` section by the same code the GPU step runs: after two AdamW steps the
parameters and moments equal one process training on the whole batch (float64)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import dist_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

STEPS, ROWS, SEQ = 2, 4, 8


# every (model, stage) the tests below compare, trained by one spawn of two processes
RUNS = [("llama", 0), ("llama", 1), ("llama", 2), ("llama", 3), ("qwen3", 3), ("mixtral", 3),
        ("llama_tied", 3)]


def sharded(runs: list, folder) -> dict:
    ports = [free_port() for _ in runs]
    spawn(dist_workers.train_sharded_runs, nprocs=2,
             args=(2, ports, runs, STEPS, ROWS, SEQ, str(folder)))
    return {(name, zero): torch.load(folder / f"{name}-{zero}.pt") for name, zero in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes' training of a tiny model at a ZeRO stage: all of RUNS, trained once
    when a test first asks for one."""
    cache = {}

    def get(name: str, zero: int) -> dict:
        if not cache:
            cache.update(sharded(RUNS, tmp_path_factory.mktemp("zero")))
        return cache[name, zero]
    return get


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
def test_llama_sharded_steps_equal_one_process(zero, reference, runs):
    want_losses, want = reference("llama")
    got = runs("llama", zero)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-6)  # fp32 cross-entropy
    assert_same_state(got["state"], want)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "llama_tied"])
def test_other_models_with_zero3(name, reference, runs):
    want_losses, want = reference(name)
    got = runs(name, 3)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-6)  # fp32 cross-entropy
    assert_same_state(got["state"], want)


def test_a_head_tied_to_the_embedding_trains_under_zero3_as_under_zero0():
    """GPT-2's `lm_head: tied_to(wte)`, a path of its own bound to its target's weights:
    ZeRO-3 binds both to the gathered buffer in each of the embedding's windows. One
    process on a world-1 gloo group (the windows, buffers and ties do not depend on the
    rank count; llama_tied runs on two above); the reference is ZeRO-0 (one process's
    CPUTrainer does not bind the tie of a random init)."""
    import torch.distributed as dist

    from modulec.plan.distributed import DataParallel
    from runtime.dist.context import DataParallelRun, DistContext
    from runtime.train.data_parallel import CPUDataParallelTrainer
    from runtime.train.optim import AdamW

    class OneRank(DataParallelRun):
        def options(self):
            return DataParallel(1, self.zero)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        context, got = DistContext(0, 1, 0, "cpu", "gloo"), {}
        for zero in (0, 3):
            trainer = CPUDataParallelTrainer(dist_workers.tiny_model("example_gpt2"), ROWS,
                                             SEQ, AdamW(lr=1e-2, weight_decay=0.1),
                                             OneRank(context, zero))
            got[zero] = [trainer.train_step(w) for w in dist_workers.windows(STEPS, ROWS,
                                                                              SEQ)]
            got[zero, "state"] = trainer.state()
            assert trainer.zero.buffer_numel() == 0
    finally:
        dist.destroy_process_group()
    assert [b["windows"] for b in trainer.zero.section["buckets"] if b["name"] == "wte"] \
        == [["start", "end"]]
    assert got[3] == pytest.approx(got[0], rel=1e-12)
    assert_same_state(got[3, "state"], got[0, "state"])


@pytest.mark.parametrize("zero", [0, 2])
def test_a_shared_gradient_slot_reduces_no_stale_padding(zero):
    """llama_tied: the final norm (32 of 128 elements, the rest padding) shares its
    gradient slot with the embedding, whose gradients filled the whole slot before: the
    padding is zeroed at each copy in, so the clipped steps' gradient norms and losses are
    one process's (the stale padding counted in the norm: 1.5816 for 1.5642 at step 1)."""
    import torch.distributed as dist

    from modulec.plan.distributed import DataParallel
    from runtime.dist.context import DataParallelRun, DistContext
    from runtime.train.backends import CPUTrainer
    from runtime.train.data_parallel import CPUDataParallelTrainer
    from runtime.train.optim import AdamW

    class OneRank(DataParallelRun):
        def options(self):
            return DataParallel(1, self.zero)

    def adamw():
        return AdamW(lr=1e-2, weight_decay=0.1, clip_grad=1e-3)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        trainer = CPUDataParallelTrainer(dist_workers.tiny_model("llama_tied"), ROWS, SEQ,
                                         adamw(), OneRank(DistContext(0, 1, 0, "cpu",
                                                                      "gloo"), zero))
        slots = {b["name"]: b.get("gradient_slot") for b in trainer.zero.section["buckets"]}
        assert slots["final_norm.weight"] == slots["embedding"] is not None
        reference = CPUTrainer(dist_workers.tiny_model("llama_tied"), ROWS, SEQ, adamw())
        for window in dist_workers.windows(STEPS + 1, ROWS, SEQ):
            assert trainer.train_step(window) == pytest.approx(
                reference.train_step(window), rel=1e-12)
            assert trainer.step_metrics()["grad_norm"] == pytest.approx(
                reference.step_metrics()["grad_norm"], rel=1e-12)
    finally:
        dist.destroy_process_group()


def test_zero3_holds_half_of_zero0_beside_the_buffers(runs):
    """The runs above (ZeRO-3's steps equal one process's): a rank's state (compute
    weights, masters, moments) is half of ZeRO-0's, the entry parameters' included; the
    gradient slots are ZeRO-0's (no shard buffer beside them); the whole weights of the
    entry buckets are held only within a step (dropped after it, at most the predicted
    elements at once)."""
    zero0, zero3 = runs("llama", 0)["held"], runs("llama", 3)["held"]
    assert zero3["parts"]["state"] * 2 == zero0["parts"]["state"]
    assert zero3["parts"]["gradient_slots"] == zero0["parts"]["gradient_slots"]
    total0, total3 = sum(zero0["parts"].values()), sum(zero3["parts"].values())
    buffers = zero3["parts"]["gather_slots"] + zero0["parts"]["gradient_slots"] / 2
    assert total3 <= 0.5 * total0 + buffers
    assert zero3["buffer_numel_after"] == 0
    assert 0 < zero3["peak_buffer_numel"] <= zero3["predicted_buffer_numel"]



@pytest.mark.parametrize("zero", [0, 3])
def test_the_head_and_embedding_reduce_through_one_gradient_slot(zero, runs):
    """The LM head's gradients are reduced at the backward's start, the embedding's at its
    end: they share one slot (the runs above equal one process's), and the rank holds the
    slot bytes the compiler predicts (two layers' slots, the final norm's, one shared)."""
    held = runs("llama", zero)["held"]
    slots = held["gradient_slots"]
    assert slots["lm_head"] == slots["embedding"] is not None
    assert slots["final_norm.weight"] is None
    assert held["parts"]["gradient_slots"] == held["predicted_slot_numel"] * \
        held["slot_itemsize"]


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
