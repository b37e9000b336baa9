"""Pipeline stages that share a parameter (docs/pipeline.md, "Shared and tied
parameters"): a tied LM head on the last stage reads the embedding of stage 0 (Llama with
tie_word_embeddings: the same parameter; GPT-2: `lm_head: tied_to(wte)`). Each stage
holds a copy, the copies' gradients are summed over the stages that hold them, and every
copy steps alike: two gloo processes (float64) train as one process accumulating the
same micro-batches, and their checkpoint holds the parameter once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import pipeline_shared_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.dist_workers import windows  # noqa: E402
from tests.pipeline_shared_workers import tied_model  # noqa: E402

# (model, clip, steps, micro-batches, rows, seq): the embedding read by both stages, with
# and without global clipping (clip 1e-3: every step clipped); GPT-2's `tied_to` head
RUNS = [("llama_tied", None, 2, 2, 1, 8), ("llama_tied", 1e-3, 2, 2, 1, 8),
        ("example_gpt2", 1e-3, 2, 2, 1, 8)]
SHARED = {"llama_tied": ("embedding", ["embedding"]),
          "example_gpt2": ("wte", ["wte", "lm_head"])}


def reference(name: str, clip, steps: int, micro: int, rows: int, seq: int,
              state: dict | None = None):
    """One process accumulating the micro-batches (`state`: resumed from it, the steps
    after it): losses, gradient norms, the state after the last step."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(tied_model(name), rows, seq,
                         AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip),
                         accumulation=micro)
    batches = windows(steps, rows * micro, seq)
    if state is not None:
        trainer.load_state(state)
        batches = batches[state["step"]:]
    losses, norms = [], []
    for window in batches:
        losses.append(trainer.train_step(window))
        norms.append(trainer.step_metrics()["grad_norm"])
    return losses, norms, trainer.state()


def _same_state(got: dict, want: dict, what: str) -> None:
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        assert set(got[part]) == set(want[part]), (what, part)
        for path, value in want[part].items():
            torch.testing.assert_close(got[part][path], value, rtol=1e-12, atol=1e-14,
                                       msg=f"{what} {part} {path}")


def _cli(folder, **more) -> dict:
    """`modulec train` of the tiny std GPT-2 (its head `tied_to(wte)`) from `--init
    random`, float32 on the CPU, 2 steps of 2 micro-batches of one row (`more`: --pp 2
    and its checkpoints, or one process's settings)."""
    from tests.runtime_models import GPU_ONLY

    path, settings = GPU_ONLY["gpt2"]
    return dict(file=Path(path), settings={k: str(v) for k, v in settings.items()},
                data=folder / "tokens.bin", seq=8, batch=1, steps=2, device="cpu",
                lr=1e-2, fmt="json", init="random") | more


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """RUNS on two gloo processes (stage.<rank>), then in the same processes `modulec train
    --pp 2 --microbatches 2 --save pp --save-every 1` (its entry, as under torchrun:
    stage.0.<rank>)."""
    folder = tmp_path_factory.mktemp("shared")
    np.random.default_rng(0).integers(0, 64, 400).astype("<u2").tofile(folder / "tokens.bin")
    cli = [_cli(folder, pp=2, microbatches=2, save=folder / "pp", save_every=1)]
    spawn(pipeline_shared_workers.train_shared, nprocs=2,
             args=(2, free_port(), RUNS, str(folder / "stage"), ([free_port()], cli)))
    return folder


@pytest.fixture(scope="module")
def spawned(folder):
    return [torch.load(folder / f"stage.{r}") for r in (0, 1)]


@pytest.mark.parametrize("run", range(len(RUNS)))
def test_stages_sharing_a_parameter_train_as_one_process(spawned, run):
    """Losses, gradient norms (the shared parameter counted once) and the whole state
    after two steps equal one process's to 1e-12; both stages hold the same copy of the
    shared parameter (bit for bit), under the tied target's name, which the gathered
    state holds once."""
    name, clip, *sizes = RUNS[run]
    want_losses, want_norms, want = reference(name, clip, *sizes)
    first, second = (s[run] for s in spawned)
    param, paths = SHARED[name]
    for stage in (first, second):
        assert stage["losses"] == pytest.approx(want_losses, rel=1e-12)
        assert stage["norms"] == pytest.approx(want_norms, rel=1e-12)
        assert param in stage["names"] and not set(paths[1:]) & set(stage["names"])
    assert torch.equal(first["params"][param], second["params"][param])
    if len(paths) > 1:  # the tied path reads its stage's copy of the target (one storage)
        tied, target = second["params"][paths[1]], second["params"][param]
        assert tied.untyped_storage().data_ptr() == target.untyped_storage().data_ptr()
    _same_state(first["whole"], want, name)
    if clip is not None:
        assert all(n > clip for n in want_norms)  # the clipping acted


@pytest.mark.parametrize("run", range(len(RUNS)))
def test_a_pipelines_state_resumes_on_one_process(spawned, run):
    """The state after step 1 (gathered on rank 0, as a checkpoint is) resumed on one
    process takes the pipeline's second step."""
    name, clip, *sizes = RUNS[run]
    state = spawned[0][run]["first"]
    losses, _, after = reference(name, clip, *sizes, state=state)
    assert losses == pytest.approx(spawned[0][run]["losses"][1:], rel=1e-12)
    _same_state(after, spawned[0][run]["whole"], f"resumed {name}")


def _steps(text: str) -> list[float]:
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def _one_process(folder, *args) -> list[float]:
    """`modulec train` of _cli's model and data on one process, --grad-accum 2."""
    from tests.test_cli import run

    given = _cli(folder)
    sets = [a for k, v in given["settings"].items() for a in ("--set", f"{k}={v}")]
    done = run("train", given["file"], *sets, "--data", given["data"], "--seq", "8",
               "--batch", "1", "--steps", "2", "--device", "cpu", "--lr", "1e-2",
               "--format", "json", "--grad-accum", "2", *args)
    assert done.exit_code == 0, done.output
    return _steps(done.stdout)


def test_modulec_train_pp_saves_the_tied_weight_once_and_resumes_on_one_process(folder):
    """`modulec train --pp 2 --save` of the tied std GPT-2 takes one process's steps
    (`--grad-accum 2`) and writes one process's checkpoints: `wte` once (the stages' two
    copies are one tensor), no `lm_head`; one process resumes it from step 1 and takes
    the pipeline's second step."""
    from safetensors.torch import load_file

    steps = _steps((folder / "stage.0.0").read_text())
    one = _one_process(folder, "--init", "random", "--save", folder / "one", "--save-every",
                       "1")
    assert len(steps) == 2 and steps == pytest.approx(one, rel=1e-5)
    for step in (1, 2):
        got = load_file(str(folder / "pp" / f"checkpoint-{step}" / "model.safetensors"))
        want = load_file(str(folder / "one" / f"checkpoint-{step}" / "model.safetensors"))
        assert got.keys() == want.keys() and not [k for k in got if "lm_head" in k]
        for key, value in want.items():  # float32; the attention's key bias has only
            # rounding noise for a gradient (softmax ignores it), which AdamW makes steps
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=5e-5, msg=key)
        torch.testing.assert_close(got["transformer.wte.weight"],
                                   want["transformer.wte.weight"], rtol=1e-5, atol=1e-7)
    resumed = _one_process(folder, "--resume", folder / "pp" / "checkpoint-1")
    assert resumed == pytest.approx(steps[1:], rel=1e-5)
