"""Pipeline parallel on two GPUs (NCCL; `-m cuda`, skipped with fewer than two; DP x PP
and TP x PP on four):
`torchrun --nproc-per-node 2 -m modulec train --pp 2 --device cuda` runs the IR's pipeline
section (each stage through the GPU step's kernels on bf16 copies of fp32 masters,
runtime/train/pipeline_precision.py; send/recv over NCCL; from step 3 one captured CUDA
graph a step, runtime/train/pipeline_graph.py) and trains as one CPU
process accumulating the same micro-batches in float32, within bf16 rounding (`BF16`),
and as one GPU accumulating them (`modulec train --device cuda --grad-accum M`). The
exact equalities are the CPU tests' (tests/test_pipeline_run.py, float64;
tests/test_pipeline_precision.py, the mixed-precision bookkeeping bit for bit)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_cuda_dist_shards import LLAMA, gpu_ckpt  # noqa: E402,F401
from tests.dist_testing import free_port, needs_gpus, train_records  # noqa: E402

pytestmark = needs_gpus(2)

ARGS = ("--seq", "64", "--batch", "2", "--lr", "1e-3", "--format", "json", "--steps", "3")
BF16 = 1e-2  # relative: a bf16 step's loss against float32's over three steps


def _pipeline(processes: int, *args: str) -> list[dict]:
    """`modulec train LLAMA ARGS` on `processes` GPUs as pipeline stages (--device cuda)."""
    return train_records(processes, LLAMA, *args, "--device", "cuda")


def _one(*args: str) -> list[dict]:
    """`modulec train LLAMA ARGS` on one process."""
    return train_records(1, LLAMA, *args)


def test_two_gpu_stages_train_as_one_process_accumulating(gpu_ckpt):
    data = ("--data", str(gpu_ckpt / "tokens.bin"), "--hf-weights", str(gpu_ckpt / "hf"))
    pipeline = _pipeline(2, *data, *ARGS, "--pp", "2", "--microbatches", "4")
    one = _one(*data, *ARGS, "--device", "cpu", "--grad-accum", "4")
    one_gpu = _one(*data, *ARGS, "--device", "cuda", "--grad-accum", "4")
    done = next(r for r in pipeline if r["event"] == "done")
    assert done["memory"] == "GPU"
    notes = [r.get("text", "") for r in pipeline if r["event"] == "note"]
    assert "--pp on the GPU: bf16 stages with fp32 masters; from step 3 each rank replays " \
        "its whole step as one CUDA graph" in notes
    got = [r["loss"] for r in pipeline if r["event"] == "step"]
    want = [r["loss"] for r in one if r["event"] == "step"]
    assert len(got) == 3 and got == pytest.approx(want, rel=BF16)
    assert got == pytest.approx([r["loss"] for r in one_gpu if r["event"] == "step"],
                                rel=BF16)


def test_a_captured_pipeline_step_trains_as_the_eager_one(tmp_path):
    """From step 3 each rank replays one CUDA graph of its whole step (runtime/train/
    pipeline_graph.py): its losses and masters follow the eager run's (within the
    attention backward's nondeterminism), reading each step's learning rate."""
    from tests import pipeline_precision_workers as workers
    from tests.bf16_parity import cosine

    out = tmp_path / "graph"
    torch.multiprocessing.spawn(workers.graph_and_eager, nprocs=2,
                                args=(2, free_port(), str(out)))
    start = workers.tiny_model("llama").params
    for rank in (0, 1):
        runs = torch.load(f"{out}.{rank}")
        graphed, eager = runs[True], runs[False]
        assert graphed["captured"] and graphed["eager_because"] is None
        assert not eager["captured"] and graphed["step"] == eager["step"] == 5
        assert graphed["losses"] == pytest.approx(eager["losses"], rel=2e-3)
        assert set(graphed["masters"]) == set(eager["masters"])
        for path, master in eager["masters"].items():
            moved = graphed["masters"][path] - start[path].float()
            assert cosine(moved, master - start[path].float()) > 0.99, path


def test_a_captured_pipeline_evaluates_between_replays_and_loads_a_state(tmp_path):
    """Evaluating after every step (eager forwards between replays) leaves the captured
    run's losses as they were; a state loaded after the graph was captured goes into the
    tensors its replays update: steps 4 and 5 taken again from step 3's state repeat
    their losses and move the loaded moments (a new tensor would stay as loaded)."""
    from tests import pipeline_precision_workers as workers
    from tests.bf16_parity import cosine

    out = tmp_path / "reload"
    torch.multiprocessing.spawn(workers.graph_eval_reload, nprocs=2,
                                args=(2, free_port(), str(out)))
    start = workers.tiny_model("llama").params
    for rank in (0, 1):
        plain, evaluated = (torch.load(f"{out}.{rank}")[e] for e in (False, True))
        assert plain["captured"] and evaluated["captured"]
        assert evaluated["losses"] == pytest.approx(plain["losses"], rel=2e-3)
        assert len(evaluated["evals"]) == 5 and all(map(math.isfinite, evaluated["evals"]))
        assert evaluated["again"] == pytest.approx(evaluated["losses"][3:], rel=2e-3)
        assert evaluated["step"] == 5 and evaluated["moments"].keys() == \
            evaluated["loaded"].keys()
        for path, moment in evaluated["moments"].items():
            assert not torch.equal(moment, evaluated["loaded"][path]), path
        for path, master in evaluated["masters"].items():
            moved = evaluated["again_masters"][path] - start[path].float()
            assert cosine(moved, master - start[path].float()) > 0.99, path


def test_two_gpu_stages_resume_from_their_shards(gpu_ckpt, tmp_path):
    """`--pp 2 --save` on two GPUs writes each rank's shard (its stage's fp32 masters and
    moments, runtime/train/pipeline_shards.py) and no optimizer.safetensors; a --pp 2
    resume from step 1 reads the shards (its note) and takes the uninterrupted run's
    steps (within the attention backward's nondeterminism)."""
    from safetensors.torch import load_file

    data = ("--data", str(gpu_ckpt / "tokens.bin"), "--hf-weights", str(gpu_ckpt / "hf"))

    def launch(*more):
        return _pipeline(2, *data, *ARGS, "--pp", "2", "--microbatches", "4", *more)

    whole = launch("--save", str(tmp_path / "pp"), "--save-every", "1")
    saved = tmp_path / "pp" / "checkpoint-1"
    assert not (saved / "optimizer.safetensors").exists()
    assert (saved / "model.safetensors").is_file()
    for rank in (0, 1):
        held = load_file(str(saved / f"shard-rank0000{rank}.safetensors"))
        assert any(k.startswith("masters.") for k in held)
        assert all(t.dtype == torch.float32 for k, t in held.items()
                   if not k.startswith("rng."))  # the fp32 masters, not the bf16 copies
    resumed = launch("--resume", str(saved), "--save", str(tmp_path / "again"))
    assert "resumed at step 1 from the per-rank shards (2 ranks, --pp 2)" in \
        [r.get("text") for r in resumed if r["event"] == "note"]
    want = [r["loss"] for r in whole if r["event"] == "step"]
    assert [r["loss"] for r in resumed if r["event"] == "step"] == \
        pytest.approx(want[1:], rel=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_two_gpu_pipelines_of_two_stages_train_as_one_process_accumulating(gpu_ckpt, tmp_path):
    """DP 2 x PP 2 on four GPUs (NCCL: a PP group per pipeline, a DP group per stage):
    `torchrun --nproc-per-node 4 -m modulec train --pp 2 --device cuda` trains as one CPU
    process with --grad-accum 4 over the same rows, and its checkpoint resumes on the same
    launch with --zero 1 (each bucket's optimizer state on its owner, its weights
    broadcast over NCCL) as the one process continues."""
    data = ("--data", str(gpu_ckpt / "tokens.bin"), "--hf-weights", str(gpu_ckpt / "hf"))
    args = (*ARGS, "--batch", "1")  # one row a micro-batch (click keeps the last)

    def launch(*more):
        return _pipeline(4, *data, *args, "--pp", "2", "--microbatches", "2", *more)

    pipeline = launch("--save", str(tmp_path / "pp"), "--save-every", "2")
    one = _one(*data, *args, "--device", "cpu", "--grad-accum", "4")
    got = [r["loss"] for r in pipeline if r["event"] == "step"]
    want = [r["loss"] for r in one if r["event"] == "step"]
    assert len(got) == 3 and got == pytest.approx(want, rel=BF16)
    resumed = launch("--resume", str(tmp_path / "pp" / "checkpoint-2"), "--zero", "1",
                     "--save", str(tmp_path / "zero1"))
    notes = [r.get("text", "") for r in resumed if r["event"] == "note"]
    assert any(n.startswith("resumed at step 2 from the consolidated checkpoint (its shards "
                            "are for 4 ranks, --pp 2, ZeRO 0 (layout differs: zero, layout)")
               for n in notes), notes  # ZeRO-0 shards, a ZeRO-1 run: joined from them
    assert [r["loss"] for r in resumed if r["event"] == "step"] == \
        pytest.approx(want[2:], rel=BF16)
    assert (tmp_path / "zero1" / "checkpoint-3" / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_pp2_tp2_on_four_gpus_trains_as_one_process_accumulating(gpu_ckpt, tmp_path):
    """PP 2 x TP 2 on four GPUs (NCCL: ranks 0, 1 stage 0's TP group, 2, 3 stage 1's; a PP
    group per tp_index): `torchrun --nproc-per-node 4 -m modulec train --pp 2 --tp 2
    --device cuda` runs each stage's TP rank program eagerly (tp_copy / tp_all_reduce in
    the stage's TP group, each TP rank sending its copy of the boundary to the same
    tp_index) and trains as one CPU process with --grad-accum 2 over the same rows; its
    consolidated checkpoint (the slices joined) resumes on one CPU process as that process
    continues (mirrors tests/test_pipeline_tp.py's gloo run)."""
    data = ("--data", str(gpu_ckpt / "tokens.bin"), "--hf-weights", str(gpu_ckpt / "hf"))
    args = (*ARGS, "--batch", "1")  # one row a micro-batch (click keeps the last)
    pipeline = _pipeline(4, *data, *args, "--pp", "2", "--tp", "2", "--microbatches", "2",
                         "--save", str(tmp_path / "tpp"), "--save-every", "2")

    def one(*more, start=data):
        return _one(*start, *args, "--device", "cpu", "--grad-accum", "2", *more)

    done = next(r for r in pipeline if r["event"] == "done")
    assert done["memory"] == "GPU"
    got = [r["loss"] for r in pipeline if r["event"] == "step"]
    want = [r["loss"] for r in one() if r["event"] == "step"]
    assert len(got) == 3 and got == pytest.approx(want, rel=BF16)
    resumed = one("--resume", str(tmp_path / "tpp" / "checkpoint-2"), start=data[:2])
    assert [r["loss"] for r in resumed if r["event"] == "step"] == \
        pytest.approx(want[2:], rel=BF16)
