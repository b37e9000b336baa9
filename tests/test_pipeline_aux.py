"""Auxiliary losses under pipeline parallel: MoE models whose 0-d `aux_loss` (the
load-balancing loss, pooled over every layer's router statistics) trained on two gloo
stages equal one process accumulating the same micro-batches (float64), and the
pipeline section says how the loss takes the outputs and carries them to it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import pipeline_aux_workers as workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

RUNS = [("mixtral", 2, 2, 1, 8), ("qwen3_moe", 2, 2, 1, 8), ("aux_early", 2, 2, 1, 8)]


def write_eval_file(folder):
    """Two batches of one row of 8 (+1) tokens."""
    path = folder / "eval.bin"
    np.random.default_rng(3).integers(0, 64, 2 * 8 + 1).astype("<u2").tofile(path)
    return path


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_aux")
    eval_path = str(write_eval_file(folder))
    spawn(workers.train_pipelined, nprocs=2,
             args=(2, free_port(), RUNS, eval_path, str(folder / "stage")))
    return [torch.load(folder / f"stage.{r}") for r in (0, 1)], eval_path


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_two_stages_train_the_aux_loss_as_one_process_accumulating(spawned, index):
    stages, eval_path = spawned
    name, *sizes = RUNS[index]
    want = workers.reference(name, *sizes, eval_path)
    first, second = (s[index] for s in stages)
    # the reported loss: cross-entropy + the aux term, as the one-process trainer's
    assert first["losses"] == second["losses"] == pytest.approx(want["losses"], rel=1e-12)
    # the eval loss: the cross-entropy alone, as one process evaluates
    assert first["eval"] == second["eval"] == pytest.approx(want["eval"], rel=1e-12)
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        got = first["state"][part] | second["state"][part]
        assert set(got) == set(want["state"][part]), part
        for path, value in want["state"][part].items():
            torch.testing.assert_close(got[path], value, rtol=1e-12, atol=1e-14,
                                       msg=f"{name} {part} {path}")


def test_the_aux_loss_moves_the_first_stages_routers():
    """Not vacuous: without the aux loss (coefficient 0) stage 0's router steps
    elsewhere, and the loss differs."""
    with_aux = workers.reference("aux_early", 1, 2, 1, 8, _eval_file())
    without = workers.reference("aux_early", 1, 2, 1, 8, _eval_file(),
                                settings={"aux_loss_coef": 0.0})
    gate = "blocks[0].router.gate"
    assert (with_aux["state"]["masters"][gate] - without["state"]["masters"][gate]
            ).abs().max() > 1e-6
    assert with_aux["losses"][0] > without["losses"][0]


def _eval_file():
    import tempfile
    from pathlib import Path

    return str(write_eval_file(Path(tempfile.mkdtemp())))


def _section(name: str):
    from runtime.inputs import sized_inputs
    from runtime.train.pipeline import _section, with_pipeline

    model = with_pipeline(workers.moe_model(name), 2, 2)
    program = model.source.program_for(sized_inputs(["token_ids"], 1, 8))
    return program, _section(program, 2, 2)


def test_the_section_carries_the_statistics_and_an_early_aux_loss():
    program, section = _section("mixtral")  # the stack cut after layer 0
    [boundary] = section["boundaries"]
    assert [(t["value"], t["shape"], t["dtype"], t["gradient"])
            for t in boundary["tensors"]][2] == ("f3[0].2", [2, 4], "fp32", True)
    assert [(r["name"], r["stage"], r["loss"]) for r in section["outputs"]] == \
        [("logits", 1, "cross_entropy"), ("aux_loss", 1, "auxiliary")]
    program, section = _section("aux_early")  # the loss on stage 0: carried to stage 1
    [boundary] = section["boundaries"]
    aux = section["outputs"][1]
    assert (aux["name"], aux["stage"], aux["loss"]) == ("aux_loss", 0, "auxiliary")
    assert [(t["shape"], t["gradient"]) for t in boundary["tensors"]
            if t["value"] == aux["value"]] == [([], True)]


def test_ir_verify_wants_every_output_carried_to_the_loss():
    from modulec.ir.verify_parallel import verify_pipeline

    program, section = _section("aux_early")
    assert verify_pipeline(section, program.graph) == []
    dropped = copy.deepcopy(section)
    dropped["boundaries"][0]["tensors"] = [t for t in dropped["boundaries"][0]["tensors"]
                                           if t["value"] != section["outputs"][1]["value"]]
    dropped["boundaries"][0]["activation_bytes"] -= 4
    [problem] = verify_pipeline(dropped, program.graph)
    assert "made on stage 0, is not carried from stage 0 to 1" in problem
    renamed = copy.deepcopy(section)
    renamed["outputs"][1]["loss"] = "mse"
    assert "loss 'mse'" in verify_pipeline(renamed, program.graph)[0]


def test_outputs_the_loss_does_not_take_are_refused():
    from runtime.errors import RuntimeUserError
    from runtime.train.pipeline import _refuse_outputs

    program = SimpleNamespace(output_names=lambda: ["logits", "hidden"])
    rows = [{"name": "logits", "loss": "cross_entropy"}, {"name": "hidden", "loss": "none"}]
    with pytest.raises(RuntimeUserError, match="output hidden is neither"):
        _refuse_outputs(program, {"outputs": rows})
    with pytest.raises(RuntimeUserError, match="does not say how its loss takes"):
        _refuse_outputs(program, {})  # a document built before `outputs`
    _refuse_outputs(SimpleNamespace(output_names=lambda: ["logits"]), {})
