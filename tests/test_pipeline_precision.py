"""A pipeline stage holding its weights as the GPU does (bf16 compute copies of fp32
masters, the GPU step's kernel registry, gradients summed in fp32:
runtime/train/pipeline_precision.py), checked on two gloo processes against one process
doing the same arithmetic, so that the masters' bookkeeping (hold, step, refresh, state)
is tested without a GPU. `--device cuda --pp` runs this way (tests/test_cuda_pipeline.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import pipeline_precision_workers as workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

SIZES = dict(steps=2, micro=2, rows=1, seq=8)


# (model, clip): a dense stack; MoE, whose router statistics' fp32 sums cross the boundary
# in fp32 beside bf16 activations, clipped; a tied head, its copies' gradients summed
RUNS = [("llama", None), ("mixtral", 0.05), ("llama_tied", None)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The two stages' files of every run of RUNS, from one spawn (starting the processes
    was most of a run's time): run i's stage r in `out`.i.r."""
    out = tmp_path_factory.mktemp("pipeline_precision") / "stage"
    spawn(workers.mixed_pipelined, nprocs=2,
             args=(2, free_port(), RUNS, *SIZES.values(), str(out)))
    return out


@pytest.fixture(scope="module", params=RUNS, ids=["llama", "mixtral-clipped", "tied"])
def runs(request, spawned):
    name, clip = request.param
    out = f"{spawned}.{RUNS.index(request.param)}"
    stages = [torch.load(f"{out}.{r}") | {"reloaded": torch.load(f"{out}.{r}.reloaded")}
              for r in (0, 1)]
    # bit for bit where both sum in the same order: clipping's norm sums the stages'
    # squares in another, and a tied head's two stages' fp32 sums add at the end
    exact = clip is None and name != "llama_tied"
    return stages, workers.mixed_reference(name, *SIZES.values(), clip), exact


def test_mixed_stages_train_as_one_process_doing_the_same_arithmetic(runs):
    (first, second), (losses, masters), exact = runs
    assert first["losses"] == second["losses"] == pytest.approx(losses, rel=1e-12)
    got = first["state"]["masters"] | second["state"]["masters"]
    assert set(got) == set(masters)
    for path in first["state"]["masters"].keys() & second["state"]["masters"].keys():
        assert torch.equal(first["state"]["masters"][path],  # a shared parameter's copies
                           second["state"]["masters"][path]), path
    for path, want in masters.items():
        assert got[path].dtype == torch.float32, path
        if exact:
            assert torch.equal(got[path], want), path
        else:
            # Adam turns the sums' last-bit differences in tiny gradients into steps
            torch.testing.assert_close(got[path], want, rtol=1e-6, atol=1e-4, msg=path)


def test_stages_compute_with_bf16_copies_of_fp32_state(runs):
    """The kernels read bf16 copies, each its master rounded to nearest; the masters and
    moments stay fp32 and hold more than bf16 does (an update of the copies themselves
    would have rounded it away)."""
    (first, second), _, _ = runs
    for stage in (first, second):
        masters = stage["state"]["masters"]
        for path, copy in stage["copies"].items():
            assert copy.dtype == torch.bfloat16, path
            if path in masters:
                assert torch.equal(copy, masters[path].to(torch.bfloat16)), path
        finer = sum(int((m != m.to(torch.bfloat16).float()).sum()) for m in masters.values())
        assert finer > 0
        for part in ("exp_avg", "exp_avg_sq"):
            assert {str(t.dtype) for t in stage["state"][part].values()} == {"torch.float32"}
    whole = first["whole"]["masters"]
    assert {str(t.dtype) for t in whole.values()} == {"torch.float32"}


def test_a_state_loads_into_the_tensors_a_captured_step_updates(runs):
    """load_state after steps (step 1's state) copies into the moments and masters the
    stage holds, never new tensors: a captured CUDA graph keeps updating the ones it
    recorded (runtime/train/pipeline_graph.py); the device's step count follows."""
    (first, second), _, _ = runs
    for stage in (first, second):
        got = stage["reloaded"]
        assert got["same_tensors"]
        want = got["loaded"]
        assert got["step"] == got["device_step"] == want["step"] == 1
        for part in ("exp_avg", "exp_avg_sq", "masters"):
            assert got["state"][part], part
            for path, value in got["state"][part].items():
                assert torch.equal(value, want[part][path].to(value.dtype)), (part, path)


def test_a_step_leaves_no_frame_of_its_micro_batches_alive(runs):
    """Every micro-batch's frames (and the saved activations they hold) are gone after
    its step: the count of live frames does not grow from step to step."""
    (first, second), _, _ = runs
    for stage in (first, second):
        assert stage["frames"][1] == stage["frames"][0], stage["frames"]


def test_modulec_plan_counts_what_a_mixed_stage_holds(runs):
    """The plan's per-stage fixed state (modulec/plan/pipeline_memory.py) is the bytes a
    stage holds after a step: compute copies, fp32 masters and moments, to the byte."""
    (first, second), _, _ = runs
    for stage in (first, second):
        assert stage["held"] == stage["planned"]


def test_zero1_pipelines_broadcast_the_masters_and_train_as_zero0(tmp_path):
    """DP 2 x PP 2, mixed stages: under the pipelines' ZeRO-1 a replica steps only its
    buckets and the others receive the owner's fp32 masters (their bf16 copies remade):
    every rank ends where ZeRO-0's ends, bit for bit."""
    out = tmp_path / "zero1"
    spawn(workers.mixed_zero1, nprocs=4, args=(4, free_port(), str(out)))
    ranks = [torch.load(f"{out}.{r}") for r in range(4)]
    for rank in ranks:
        zero0, zero1 = rank[0], rank[1]
        assert zero0["owned"] is None and zero1["owned"]  # ZeRO-1 owns some buckets only
        assert zero1["losses"] == zero0["losses"]
        assert zero1["masters"].keys() == zero0["masters"].keys()
        for path, master in zero0["masters"].items():
            assert torch.equal(zero1["masters"][path], master), path
            assert torch.equal(zero1["copies"][path], master.to(torch.bfloat16)), path
    for a, b in ((0, 2), (1, 3)):  # a stage's two replicas hold the same masters
        for path, master in ranks[a][1]["masters"].items():
            assert torch.equal(ranks[b][1]["masters"][path], master), path


def test_device_adamw_steps_as_torch_adamw():
    """DeviceAdamW (the rate and step count device scalars a captured step reads) takes
    torch.optim.AdamW's steps: per-parameter lr scale and weight decay, a rate changed
    between steps through its scalar, and a clipping factor on the gradients."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline_precision import DeviceAdamW

    generator = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(16, 8, generator=generator),
             "b": torch.randn(8, generator=generator)}
    grads = [{p: torch.randn(v.shape, generator=generator) for p, v in start.items()}
             for _ in range(4)]
    settings = {"w": (0.5, 0.1), "b": (1.0, 0.0)}  # (lr scale, weight decay)
    params = {p: v.clone() for p, v in start.items()}
    adamw = AdamW(lr=1e-2)
    device = DeviceAdamW(adamw, "cpu")
    torch_params = {p: torch.nn.Parameter(v.clone()) for p, v in start.items()}
    optimizer = torch.optim.AdamW(
        [{"params": [torch_params[p]], "scale": s, "weight_decay": wd}
         for p, (s, wd) in settings.items()], lr=1e-2, betas=adamw.betas, eps=adamw.eps)
    scale = torch.tensor(0.5, dtype=torch.float64)
    for step, grad in enumerate(grads):
        lr = 1e-2 * (1 - 0.2 * step)
        device.lr.fill_(lr)  # what PipelineTrainer.set_lr writes
        device.update(params, grad, settings.get, scale)
        for group, path in zip(optimizer.param_groups, settings):
            group["lr"] = lr * group["scale"]
            torch_params[path].grad = grad[path] * 0.5
        optimizer.step()
    assert float(device.count) == len(grads)
    for path, value in torch_params.items():
        assert not torch.equal(params[path], start[path]), path
        torch.testing.assert_close(params[path], value.detach(), rtol=0, atol=1e-6,
                                   msg=path)


def test_mixed_stages_refuse_a_parameter_stored_in_its_own_dtype(tmp_path):
    """`norm: [d] @dtype(fp32)`: the one-GPU step holds it in fp32; a mixed stage, which
    makes a bf16 copy of every parameter, refuses it rather than run it in bf16 (a stage
    without it, and the CPU's stages in the model's dtype, take the model)."""
    from runtime.errors import RuntimeUserError
    from runtime.train.pipeline_precision import StagePrecision
    from tests.test_cuda_annotations import _dtype_program

    _, program = _dtype_program(tmp_path)
    paths = ["emb", "norm", "w", "head"]
    mixed = StagePrecision.of("cpu", torch.float32, mixed=True)
    StagePrecision.of("cpu", torch.float32, mixed=False).refuse_own_dtypes(program, paths)
    mixed.refuse_own_dtypes(program, ["emb", "w"])
    with pytest.raises(RuntimeUserError, match=r"`norm` is stored in float32 \(`@dtype`\)"
                       r": not supported yet") as error:
        mixed.refuse_own_dtypes(program, paths)
    assert "--device cpu" in error.value.help[0]
