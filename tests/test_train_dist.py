"""`torchrun --nproc-per-node 2 -m modulec train --device cpu --zero S` (gloo): the two
processes train as one process on the same total batch, rank 0 writes one consolidated
checkpoint, and that checkpoint resumes on another number of processes (2 -> 1, 1 -> 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.dist_testing import free_port  # noqa: E402
from tests.test_train import LLAMA, _tensors, ckpt, events, losses, train  # noqa: E402,F401


def torchrun(ckpt, *args, weights=True, file=LLAMA, processes=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes),
               "--master-port", str(free_port()), "-m", "modulec", "train", str(file),
               "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--lr", "1e-2", "--format", "json",
               *(["--hf-weights", str(ckpt / "hf")] if weights else []), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


@pytest.fixture(scope="module")
def one_process(ckpt, tmp_path_factory):
    """One process's four steps' losses, saved in `one` (what the launches below are held
    to), and its first two steps saved apart in `first` (what two processes resume); the
    tests only read both folders."""
    folder = tmp_path_factory.mktemp("one_process")
    steps = losses(train(ckpt, "--steps", "4", "--save", folder / "one"))
    losses(train(ckpt, "--steps", "2", "--save", folder / "first"))
    return steps, folder


def test_two_processes_train_as_one_and_resume_on_either(ckpt, one_process, tmp_path):
    one, reference = one_process
    two = torchrun(ckpt, "--steps", "2", "--zero", "3", "--save", tmp_path / "two")
    assert len(two) == 2 and two == pytest.approx(one[:2], rel=1e-5)
    # under ZeRO the ranks' shards hold the optimizer state: no consolidated copy of it
    saved = tmp_path / "two" / "checkpoint-2"
    assert not (saved / "optimizer.safetensors").exists()
    assert len(list(saved.glob("shard-rank*.safetensors"))) == 2
    # 2 -> 1: one process continues the two-process checkpoint (its shards joined)
    rest = losses(train(ckpt, "--steps", "4", "--resume", tmp_path / "two", "--save",
                        tmp_path / "two", weights=False))
    assert rest == pytest.approx(one[2:], rel=1e-4)
    a, b = _tensors(reference / "one" / "checkpoint-4"), _tensors(tmp_path / "two" / "checkpoint-4")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)
    # 1 -> 2: two processes continue the one-process checkpoint of step 2
    more = torchrun(ckpt, "--steps", "4", "--zero", "2", "--resume", reference / "first",
                    weights=False)
    assert more == pytest.approx(one[2:], rel=1e-4)


def test_zero_without_processes_is_an_error(ckpt):
    result = train(ckpt, "--steps", "1", "--zero", "2")
    assert result.exit_code == 1
    assert "--zero 2" in result.output and "torchrun --nproc-per-node" in result.output


def test_zero_over_one_tensor_parallel_group_is_an_error():
    """--tp 2 --zero 3 on two processes: one TP group, no data-parallel rank to shard
    across (the stage would be dropped); on four, two ranks: accepted."""
    from types import SimpleNamespace

    from runtime.errors import RuntimeUserError
    from runtime.train.run import check_zero

    request = SimpleNamespace(zero=3, tp=2)
    with pytest.raises(RuntimeUserError, match="one tensor-parallel group") as caught:
        check_zero(request, SimpleNamespace(distributed=True, world=2))
    assert "leave out --zero" in caught.value.help[0]
    check_zero(request, SimpleNamespace(distributed=True, world=4))
    check_zero(SimpleNamespace(zero=None, tp=2), SimpleNamespace(distributed=True, world=2))


def test_lora_with_tp_under_data_parallel_is_refused_on_the_gpu(monkeypatch):
    """--device cuda --lora --tp 2 on four processes (DP 2 x TP 2) is refused before any
    CUDA or NCCL work (it exited 101 on four H100s, D9); --tp alone, data parallel alone,
    the CPU, and no --lora are let through."""
    from types import SimpleNamespace

    from runtime.errors import RuntimeUserError
    from runtime.train.run import _context, check_lora_parallel

    def request(**given):
        return SimpleNamespace(**{"device": "cuda", "lora": object(), "built_lora": False,
                                  "tp": 2, "pp": 1, **given})

    with pytest.raises(RuntimeUserError, match="--lora with --tp under data parallel is "
                       "not supported on the GPU yet") as caught:
        check_lora_parallel(request(), 4)
    assert "--device cpu" in caught.value.help[0] and "--tp alone" in caught.value.help[0]
    with pytest.raises(RuntimeUserError, match="not supported on the GPU yet"):
        check_lora_parallel(request(lora=None, built_lora=True), 4)  # an IR built --lora
    for given, world in (({}, 2), ({"device": "cpu"}, 4), ({"lora": None}, 4),
                         ({"tp": 1}, 4), ({}, 3), ({"pp": 2}, 8)):
        check_lora_parallel(request(**given), world)
    monkeypatch.setenv("WORLD_SIZE", "4")  # no GPU here: from_env would refuse first
    with pytest.raises(RuntimeUserError, match="not supported on the GPU yet"):
        _context(request())


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



def _descendants(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return children + [d for c in children for d in _descendants(c)]


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    rank = env.get(b"RANK")
    return int(rank) if rank is not None and b"LOCAL_RANK" in env else None


def test_a_rank_that_dies_ends_the_run_and_the_last_checkpoint_resumes(ckpt, tmp_path):
    """kill -9 of rank 1 after a save: torchrun ends rank 0 and names rank 1; one process
    resumes from the checkpoint the two saved."""
    import signal
    import time

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "modulec", "train", LLAMA,
               "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--format", "json", "--hf-weights", str(ckpt / "hf"),
               "--steps", "100000", "--save", str(tmp_path / "run"), "--save-every", "2",
               "--dist-timeout", "20"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
    try:
        for line in launcher.stdout:  # rank 0's JSON lines
            if '"saved' in line:
                break
        victim = next(p for p in _descendants(launcher.pid) if _rank_of(p) == 1)
        os.kill(victim, signal.SIGKILL)
        began = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        assert time.monotonic() - began < 90
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    root = err.split("Root Cause")[-1]  # torchrun's report names the rank that failed
    assert re.search(r"rank\s*:\s*1\b", root) and "SIGKILL" in root, err[-2000:]
    resumed = losses(train(ckpt, "--steps", "3", "--resume", tmp_path / "run", weights=False))
    assert len(resumed) == 1  # the run saved step 2; step 3 runs


def test_tensor_parallel_trains_as_one_process_and_saves_whole(ckpt, one_process, tmp_path):
    """--tp 2: the two ranks hold halves of each layer and read the same rows; the losses
    are one process's, the checkpoint holds whole tensors (one process resumes it) and two
    ranks resume a one-process checkpoint."""
    one, reference = one_process
    two = torchrun(ckpt, "--steps", "2", "--tp", "2", "--batch", "2", "--save",
                   tmp_path / "tp")
    assert two == pytest.approx(one[:2], rel=1e-5)
    rest = losses(train(ckpt, "--steps", "4", "--resume", tmp_path / "tp", weights=False))
    assert rest == pytest.approx(one[2:], rel=1e-4)
    more = torchrun(ckpt, "--steps", "4", "--tp", "2", "--batch", "2", "--resume",
                    reference / "first", weights=False)
    assert more == pytest.approx(one[2:], rel=1e-4)


def test_tensor_parallel_from_scratch_trains_as_one_process(ckpt):
    """--init random --tp 2: each rank keeps its slices of the weights one process draws
    from the seed (it draws the whole model), so the losses are one process's."""
    sizes = ["--init", "random", "--seed", "4", "--config", ckpt / "hf" / "config.json"]
    one = losses(train(ckpt, "--steps", "2", *sizes, weights=False))
    two = torchrun(ckpt, "--steps", "2", "--tp", "2", "--batch", "2", *sizes, weights=False)
    assert two == pytest.approx(one, rel=1e-5)


def test_tensor_parallel_with_sequence_parallel_trains_as_one_process(ckpt, one_process):
    """--tp 2 --sp: the norms on half the rows a rank (docs/distributed.md, "Sequence
    parallel"); the losses are one process's (its first two steps: the same losses, bit
    for bit, as a two-step run)."""
    one = one_process[0][:2]
    two = torchrun(ckpt, "--steps", "2", "--tp", "2", "--sp", "--batch", "2")
    assert two == pytest.approx(one, rel=1e-5)


def test_data_parallel_over_tensor_parallel_slices(ckpt, one_process, tmp_path):
    """Four processes, --tp 2 --zero 3: two TP slices of two ranks, ZeRO-3 across the
    slices (each slice its row of the batch); the losses are one process's (its first
    three steps)."""
    one = one_process[0][:3]
    four = torchrun(ckpt, "--steps", "3", "--tp", "2", "--zero", "3", processes=4)
    assert four == pytest.approx(one, rel=1e-5)


def test_lora_data_parallel_trains_as_one_process(ckpt, tmp_path):
    """--lora under torchrun: the adapters are the buckets (the base weights frozen and
    whole on every rank); the losses and saved adapters are one process's."""
    from safetensors.torch import load_file

    args = ("--steps", "3", "--lora", "rank=4,alpha=8")
    one = losses(train(ckpt, *args, "--save", tmp_path / "one"))
    two = torchrun(ckpt, *args, "--zero", "2", "--save", tmp_path / "two")
    assert two == pytest.approx(one, rel=1e-5)
    a, b = (load_file(str(tmp_path / d / "checkpoint-3" / "adapter_model.safetensors"))
            for d in ("one", "two"))
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)


def test_an_ir_built_with_lora_counts_as_lora_for_the_gpu_refusal(tmp_path):
    """document_parallel records that an IR document was built with --lora, so
    check_lora_parallel refuses `modulec train x.ir` under DP x TP on the GPU as it refuses
    --lora (an IR built --lora trains LoRA without the flag)."""
    from runtime.train.run import Request, document_parallel
    from tests.test_cli import run

    built = tmp_path / "lora-tp2.ir"
    sizes = [a for k, v in {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_heads": 4,
                            "num_kv_heads": 2, "d_ff": 48}.items() for a in ("--set", f"{k}={v}")]
    assert run("build", LLAMA, *sizes, "--shape", "B=1", "--shape", "T=8", "--tp", "2",
               "--lora", "rank=2,alpha=4,targets=[q,v]", "-o", built).exit_code == 0
    request = Request(file=built, data=tmp_path / "none.bin", seq=8, batch=1, steps=1,
                      device="cuda", tp=None)
    document_parallel(request)
    assert request.tp == 2 and request.built_lora


def test_a_rank_process_ends_with_its_status_and_its_outputs_flushed():
    """The command line ends a process that joined a torchrun group at once, its buffered
    output written and its exit status kept (runtime.dist.context.end_joined_process:
    torch's teardown at the interpreter's exit aborted ~1 in 50 finished gloo runs); a
    process that joined no group goes on."""
    script = ("import sys, runtime.dist.context as c\n"
              "c.end_joined_process(5)\n"
              "print('went on'); c._joined = True\n"
              "print('buffered'); sys.stderr.write('err')\n"
              "c.end_joined_process(int(sys.argv[1]))\n"
              "print('after the end')\n")
    for code in (0, 3):
        done = subprocess.run([sys.executable, "-c", script, str(code)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == code
        assert done.stdout.split() == ["went", "on", "buffered"]
        assert done.stderr.endswith("err")
