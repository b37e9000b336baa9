"""Tensor parallel inside pipeline stages (TP x PP; issues 17 and 20): each stage's
program is the `--tp` rank program of its units, rank r = ((dp_index x PP) + pp_index) x
TP + tp_index; the TP collectives run in the stage's TP group, the sends between the
ranks of one tp_index (docs/pipeline.md, "Tensor parallel inside pipeline stages")."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import pipeline_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.test_pipeline_run import _check_shard_resume  # noqa: E402
from tests.test_train import ckpt  # noqa: E402,F401

PARTS = ("masters", "exp_avg", "exp_avg_sq")
STEPS, MICRO, ROWS, SEQ = 2, 2, 2, 8
RUNS = [(False, None, STEPS, MICRO, ROWS, SEQ), (True, 1e-3, STEPS, MICRO, ROWS, SEQ)]
DP_TP_RUNS = [(1, 1e-3, 2, 4, 8)]  # tests/test_tp_clip.py: DP 2 x TP 2, ZeRO-1, clipping
LORA_TEXT = "rank=4,alpha=8,targets=[q,k,v,o,gate,up,down]"  # tp_lora_workers.LORA


def spawn_four(tmp_path_factory) -> dict:
    """One spawn of four gloo processes (their start is the slow part) for: RUNS (PP 2 x
    TP 2), a step from the module and from its `--pp 2 --tp 2` IR document, DP_TP_RUNS
    (tests/tp_workers.py's clipped_runs) and the packed and evaluated pipeline runs of
    tests/test_pipeline_packed_eval.py; each rank's results. The session fixture
    `four_ranks` (tests/conftest.py) runs it once for this file, tests/test_tp_clip.py
    and tests/test_pipeline_packed_eval.py."""
    from tests.test_pipeline_packed_eval import PACKED_EVAL_RUNS, write_eval_file

    folder = tmp_path_factory.mktemp("four")
    built, document = _build(folder, "--tp", "2")
    assert built.exit_code == 0, built.output
    (folder / "lora").mkdir()  # the LoRA one (tests/tp_lora_workers.py's adapters)
    built, lora = _build(folder / "lora", "--tp", "2", "--lora", LORA_TEXT)
    assert built.exit_code == 0, built.output
    from tests.tp_lora_workers import whole_params
    out = folder / "tpp"
    extra = {"document": str(document), "clip": 1e-3, "dp_tp": DP_TP_RUNS,
             "packed_eval": (PACKED_EVAL_RUNS, str(write_eval_file(folder))),
             "lora": (str(lora), whole_params(), STEPS, MICRO, 1, SEQ)}
    spawn(pipeline_workers.train_tp_pipelined, nprocs=4,
             args=(4, free_port(), RUNS, str(out), extra))
    results = {kind: [torch.load(f"{out}.{kind}{r}") for r in range(4)]
               for kind in ("", "ir.", "dptp.", "pe.", "lora.")}
    return results | {"eval_file": folder / "eval.bin"}


def test_pp2_tp2_trains_as_one_process_accumulating(four_ranks):
    """PP 2 x TP 2 on four gloo processes (ranks 0, 1: stage 0's TP pair; 2, 3: stage
    1's), the tiny Llama in float64, with and without --sp: the losses, and every
    parameter and moment after two steps (the slices and stages joined by state()), are
    one process's with --grad-accum 2 over the same rows (to 1e-10); a trainer given the
    state after step 1, cut into its slices, ends the same. The --sp run clips (--clip-grad
    1e-3, below any norm here): its moments hold the clipped gradients, so they match only
    if the global norm sums the TP slices once and the replicated parameters once."""
    steps, micro, rows, seq = STEPS, MICRO, ROWS, SEQ
    ranks = four_ranks[""]
    for index, (sp, clip, *_) in enumerate(RUNS):
        want_losses, want = pipeline_workers.train_reference("llama", steps, micro, rows,
                                                             seq, clip=clip)
        for rank in ranks:
            assert rank[index]["losses"] == pytest.approx(want_losses, rel=1e-10), sp
            assert rank[index]["resumed"] == pytest.approx(want_losses[1:], rel=1e-10), sp
            _check_shard_resume(rank[index])  # its slices' shard: bit for bit
        got = ranks[0][index]["whole"]
        for part in PARTS:
            assert set(got[part]) == set(want[part]), (sp, part)
            for path, value in want[part].items():
                torch.testing.assert_close(got[part][path], value, rtol=1e-10, atol=1e-12,
                                           msg=f"sp {sp} {part} {path}")


def test_pp2_tp2_lora_trains_as_one_process_accumulating(four_ranks):
    """--pp 2 --tp 2 --lora (the document `modulec build --pp 2 --tp 2 --lora` writes):
    each stage's TP pair trains its layers' adapters (split as their weights are,
    modulec/lower/lora_tp.py); the losses, adapters and moments
    (joined by state()) after two steps equal one process's with --grad-accum 2
    (float64, 1e-10), and the frozen base slices are untouched."""
    from modulec.lower.lora import is_adapter
    from runtime.tensor_parallel import shard_params
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW
    from tests import tp_lora_workers
    from tests.dist_workers import windows

    whole = tp_lora_workers.whole_params()
    model = tp_lora_workers.lora_model()
    model.params = {p: t.clone() for p, t in whole.items()}
    trainer = CPUTrainer(model, 1, SEQ, AdamW(lr=1e-2, weight_decay=0.1),
                         accumulation=MICRO)
    want_losses = [trainer.train_step(w) for w in windows(STEPS, MICRO, SEQ)]
    want = trainer.state()
    ranks = four_ranks["lora."]
    for rank, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(want_losses, rel=1e-10), rank
        mine = shard_params(whole, tp_lora_workers.lora_model(2, rank % 2)
                            .source.program(planned=False), rank % 2)
        assert any(is_adapter(p) for p in got["params"])
        for path, value in got["params"].items():
            if not is_adapter(path):
                assert torch.equal(value, mine[path]), (rank, path)
    got = ranks[0]["whole"]
    assert set(got["exp_avg"]) == {p for p in want["masters"] if is_adapter(p)}
    for part in PARTS:
        assert set(got[part]) == set(want[part]), part
        for path, value in want[part].items():
            torch.testing.assert_close(got[part][path], value, rtol=1e-10, atol=1e-12,
                                       msg=f"{part} {path}")


def test_a_pp2_tp2_ir_steps_as_the_module(four_ranks):
    """A step of the pipeline from the document `modulec build --pp 2 --tp 2` writes (its
    tp read from the document, each rank's slices cut from the same weights) equals one
    from the module, bit for bit, float64, clipping at 1e-3: the loss, the norm, and the
    joined weights and moments (issue 17: the IR is the contract)."""
    for module, ir in four_ranks["ir."]:
        assert (ir["loss"], ir["norm"]) == (module["loss"], module["norm"])
        assert module["norm"] > 1e-3  # it clips
    module, ir = four_ranks["ir."][0]
    for part in PARTS:
        assert module["state"][part] and module["state"][part].keys() == \
            ir["state"][part].keys()
        for path, value in module["state"][part].items():
            assert torch.equal(ir["state"][part][path], value), (part, path)


def test_the_mesh_places_ranks_stage_major_tp_minor():
    from runtime.dist.mesh import PipelineMesh

    # rank 5 of dp 2 x pp 2 x tp 2: pipeline 1, stage 0, tp_index 1
    mesh = PipelineMesh(dp=2, pp=2, rank=5, tp=2)
    assert (mesh.dp_index, mesh.stage, mesh.tp_index) == (1, 0, 1)
    assert (mesh.rank_of(1), mesh.replica_rank(0)) == (7, 1)


def test_the_irs_mesh_counts_tp():
    from runtime.dist.mesh import PipelineMesh
    from runtime.errors import RuntimeUserError

    with pytest.raises(RuntimeUserError) as caught:
        PipelineMesh.of(SimpleNamespace(world=4, rank=0), {"dp": 1, "pp": 2, "tp": 4})
    assert caught.value.message == ("the IR's pipeline mesh is dp 1 x pp 2 x tp 4 = 8 "
                                    "processes; this run has 4")
    assert "modulec build ... --pp 2 --tp 4 --dp 1" in caught.value.help[0]


def _build(tmp_path, *extra):
    from tests.runtime_models import TINY
    from tests.test_cli import run

    path, settings = TINY["llama"]
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "tpp.ir"
    return run("build", path, *sets, "--shape", "B=1", "--shape", "T=8", "--pp", "2",
               "--microbatches", "2", "-o", out, *extra), out


def test_the_verifier_reads_the_mesh_against_the_tp_section(tmp_path):
    """`modulec build --pp 2 --tp 2 --dp 2`: the section's mesh says tp 2, its buckets
    hold the rank's slices, the stages carry the TP ops; a mesh that says tp 1 (or a
    pipeline without TP that says 2) is rejected by name."""
    from modulec.ir.serialize import graph_from_data
    from modulec.ir.verify_parallel import verify_parallel

    built, path = _build(tmp_path, "--tp", "2", "--dp", "2")
    assert built.exit_code == 0, built.output
    document = json.loads(path.read_text())
    schedule, graph = document["schedule"], graph_from_data(document["graph"])
    section = schedule["pipeline"]
    assert section["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
    shapes = {row["path"]: row["shape"] for stage in section["stages"]
              for bucket in stage["grad_buckets"] for row in bucket["params"]}
    assert shapes["blocks[0].attention.out_weight"] == [32, 16]  # [d, d / 2]
    targets = {n.target for f in graph.functions for n in f.nodes}
    assert {"tp_copy", "tp_all_reduce"} <= targets
    assert verify_parallel(schedule, graph) == []
    section["mesh"]["tp"] = 1
    assert verify_parallel(schedule, graph) == [
        "schedule.pipeline: `mesh` says tp 1, but the document's stages are built with a "
        "tensor_parallel section of size 2"]
    del schedule["tensor_parallel"]
    section["mesh"]["tp"] = 2
    assert verify_parallel(schedule, graph) == [
        "schedule.pipeline: `mesh` says tp 2, but the document's stages are built with no "
        "tensor_parallel section (tp 1)"]


def test_tp_not_dividing_the_heads_is_named_under_pp(tmp_path):
    built, _ = _build(tmp_path, "--tp", "3")
    assert built.exit_code != 0
    assert "E027" in built.output and "`num_heads` = 4 is not divisible by tp_size 3" \
        in built.output, built.output


def test_modulec_train_pp2_tp2_trains_as_one_process_and_resumes_on_one(ckpt, tmp_path):
    """`torchrun --nproc-per-node 4 -m modulec train --pp 2 --tp 2 --microbatches 2`: the
    HF weights cut into each rank's slices, the losses one process's with --grad-accum 2
    over the same rows; the consolidated checkpoint (the slices joined, the stages
    joined) resumes on one process as that process's own would."""
    from tests.test_pipeline_run import train_on_four
    from tests.test_train import _tensors, losses, train

    four = train_on_four(ckpt, tmp_path / "tpp", "--pp", "2", "--tp", "2")
    one = train(ckpt, "--batch", "1", "--steps", "3", "--grad-accum", "2", "--save",
                tmp_path / "one")
    assert four == pytest.approx(losses(one)[:2], rel=1e-6)
    rest = losses(train(ckpt, "--batch", "1", "--steps", "3", "--grad-accum", "2",
                        "--resume", tmp_path / "tpp", "--save", tmp_path / "tpp",
                        weights=False))
    assert rest == pytest.approx(losses(one)[2:], rel=1e-5)
    a, b = _tensors(tmp_path / "one" / "checkpoint-3"), _tensors(tmp_path / "tpp" / "checkpoint-3")
    assert a.keys() == b.keys()
    # float32, the TP sums in another order: AdamW's normalized step turns a gradient's
    # last-bit differences into ~3e-6 (a step is lr 1e-2); the float64 test is exact
    bad = [k for k in a if not torch.allclose(a[k], b[k], rtol=1e-4, atol=2e-5)]
    assert not bad, bad


def test_emit_pipeline_names_the_tp_launch(tmp_path):
    built, _ = _build(tmp_path, "--tp", "2", "--emit", "pipeline")
    assert built.exit_code == 0, built.output
    assert "`torchrun --nproc-per-node 4 -m modulec train --pp 2 --tp 2` runs it" \
        in built.output
