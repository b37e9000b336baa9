"""Pipeline parallel executed (issue 17, item 4): two processes (gloo) run the IR's
`pipeline` section, one stage each, its 1F1B ops with torch.distributed point-to-point,
and train as one process accumulating the same micro-batches (float64: equal)."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from tests import pipeline_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.pipeline_workers import MODELS  # noqa: E402
from tests.test_train import LLAMA, ckpt  # noqa: E402,F401

# (model, settings, steps, micro-batches, rows, seq): @partition stages cut between two
# calls, dropout on both (masks seeded per micro-batch as one process seeds them); and an
# IR document built with `--pp 2` (its section read as written), whose balanced split cuts
# the stack of layers
RUNS = [("pipelined", {}, 1, 2, 1, 8), ("llama", {"n_layers": 4}, 1, 2, 1, 8)]
# the @partition model with LoRA on every projection, dropout on the adapters' input too,
# built with --pp 2 (PIPELINED_LORA: two AdamW steps of (steps, micro, rows, seq)); and
# `modulec train --pp 2 --lora LORA_TEXT`'s adapters
PIPELINED_LORA = ("rank=4,alpha=8,targets=[qkv,out,up,down],dropout=0.25", 2, 2, 1, 8)
LORA_TEXT = "rank=4,alpha=8,targets=[q,v,down],dropout=0.25"


def _built_ir(tmp_path, settings: dict, micro: int, rows: int, seq: int, dp: int = 1,
              zero: int = 0, lora: tuple = (), name: str = "llama") -> str:
    """`modulec build --pp 2 --dp DP --zero Z` of the tiny Llama (`lora`: its --lora
    arguments; `name`: the document's name) to an IR document."""
    from tests.runtime_models import TINY
    from tests.test_cli import run

    path = tmp_path / f"{name}-dp{dp}-zero{zero}{'-lora' if lora else ''}-pp2.ir"
    sets = [a for k, v in (TINY["llama"][1] | settings).items() for a in ("--set", f"{k}={v}")]
    built = run("build", TINY["llama"][0], *sets, "--shape", f"B={rows}", "--shape",
                f"T={seq}", "--pp", "2", "--dp", str(dp), "--zero", str(zero),
                "--microbatches", str(micro), *lora, "-o", path)
    assert built.exit_code == 0, built.output
    return str(path)


@pytest.fixture(scope="module")
def spawned(ckpt, tmp_path_factory):
    """One start of two gloo processes for the pipeline's steps (RUNS, the first one's
    `--pp 2` IR document, PIPELINED_LORA's), then `modulec train --pp 2 --lora --save` (its entry,
    as under torchrun) saving each step, and the same resumed from its first checkpoint."""
    from tests.test_cli import run

    folder = tmp_path_factory.mktemp("pipeline")
    _, settings, steps, micro, rows, seq = RUNS[1]
    document = _built_ir(folder, settings, micro, rows, seq)
    lora, *sizes = PIPELINED_LORA
    built = run("build", MODELS["pipelined"][0], "--lora", lora, "--shape", f"B={sizes[2]}",
                "--shape", f"T={sizes[3]}", "--pp", "2", "--microbatches", str(sizes[1]),
                "-o", folder / "lora.ir")
    assert built.exit_code == 0, built.output
    runs = [RUNS[0], (document, settings, steps, micro, rows, seq),
            (str(folder / "lora.ir"), {}, *sizes)]
    cli = [_lora_cli(ckpt, save=folder / "pp", save_every=1),
           _lora_cli(ckpt, save=folder / "again", hf_weights=None,
                     resume=folder / "pp" / "checkpoint-1")]
    spawn(pipeline_workers.train_pipelined, nprocs=2,
             args=(2, free_port(), runs, str(folder / "stage"),
                   ([free_port() for _ in cli], cli)))
    return folder


def test_two_stages_train_as_one_process_accumulating(spawned):
    stages = [torch.load(spawned / f"stage.{r}") for r in (0, 1)]
    for index, (name, settings, steps, micro, rows, seq) in enumerate(RUNS):
        want_losses, want = pipeline_workers.train_reference(name, steps, micro, rows, seq,
                                                             settings)
        first, second = (s[index] for s in stages)
        assert first["losses"] == second["losses"] == pytest.approx(want_losses, rel=1e-12)
        for part in ("masters", "exp_avg", "exp_avg_sq"):
            assert not set(first["state"][part]) & set(second["state"][part])
            got = first["state"][part] | second["state"][part]
            assert set(got) == set(want[part]), (name, part)
            for path, value in want[part].items():
                torch.testing.assert_close(got[path], value, rtol=1e-12, atol=1e-14,
                                           msg=f"{name} {part} {path}")


def train_on_four(ckpt, save, *extra) -> list[float]:
    """The step losses of `torchrun --nproc-per-node 4 -m modulec train` on the tiny Llama
    (2 steps, --pp 2 --microbatches 2 after `extra`), its checkpoint saved in `save`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-port", str(free_port()), "-m", "modulec", "train", str(LLAMA),
               "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--lr", "1e-2", "--format", "json", "--hf-weights",
               str(ckpt / "hf"), "--steps", "2", *extra, "--microbatches", "2",
               "--save", str(save)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_modulec_train_dp2_pp2_trains_as_one_process_and_resumes_on_one(ckpt, tmp_path):
    """`torchrun --nproc-per-node 4 -m modulec train --pp 2 --microbatches 2`: two
    data-parallel pipelines of the tiny Llama's two layers on two stages, each reading its
    own rows; the losses are one process's with --grad-accum 4 over the same rows, and one
    process (another data-parallel size) resumes the consolidated checkpoint."""
    from tests.test_train import _tensors, losses, train

    two = train_on_four(ckpt, tmp_path / "pp", "--pp", "2")
    # train()'s --batch 2 overridden (click keeps the last): one row a micro-batch
    one = train(ckpt, "--batch", "1", "--steps", "3", "--grad-accum", "4", "--save",
                tmp_path / "one")
    assert two == pytest.approx(losses(one)[:2], rel=1e-6)
    # the checkpoint's batch is 1 row x 2 pipelines: one process takes 2 rows a micro-batch
    rest = losses(train(ckpt, "--batch", "2", "--steps", "3", "--grad-accum", "2", "--resume",
                        tmp_path / "pp", "--save", tmp_path / "pp", weights=False))
    assert rest == pytest.approx(losses(one)[2:], rel=1e-5)
    a, b = _tensors(tmp_path / "one" / "checkpoint-3"), _tensors(tmp_path / "pp" / "checkpoint-3")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def _request(**given):
    from pathlib import Path

    fields = dict(pp=2, microbatches=None, tp=1, zero=None, lora=None, grad_accum=1,
                  memory_budget=None,
                  file=Path("m.module"))
    return SimpleNamespace(**(fields | given))


@pytest.mark.parametrize("given, world, message", [
    (dict(pp=1, microbatches=4), 1, "--microbatches is the pipeline's: it needs --pp P"),
    (dict(), 1, "--pp 2 runs one stage per process; this is one process"),
    (dict(), 3, "the 3 processes are not a multiple of --pp 2 x --tp 1 = 2: each "
                "data-parallel replica is one pipeline of 2 processes"),
    (dict(pp=3), 4, "the 4 processes are not a multiple of --pp 3 x --tp 1 = 3"),
    (dict(microbatches=1), 2, "--microbatches 1 is fewer than the 2 pipeline stages"),
    (dict(zero=2), 4, "--zero with --pp: not supported yet"),
    (dict(zero=1), 2, "--zero 1 with --pp shards each stage's optimizer state over its "
                      "data-parallel replicas; these 2 processes are one pipeline"),
    (dict(tp=2), 6, "the 6 processes are not a multiple of --pp 2 x --tp 2 = 4: each "
                    "data-parallel replica is one pipeline of 4 processes"),
    (dict(memory_budget=2**30), 2, "--memory-budget with --pp: not supported yet"),
    (dict(grad_accum=2), 2, "--grad-accum with --pp"),
])
def test_bad_pipeline_launches_are_clear_errors(given, world, message):
    from runtime.errors import RuntimeUserError
    from runtime.train.pipeline import check_launch

    context = SimpleNamespace(distributed=world > 1, world=world)
    with pytest.raises(RuntimeUserError) as caught:
        check_launch(_request(**given), context)
    assert message in caught.value.message


def test_the_micro_batches_become_the_accumulation():
    from runtime.train.pipeline import check_launch

    request = _request()
    check_launch(request, SimpleNamespace(distributed=True, world=2))
    assert request.microbatches == request.grad_accum == 8  # 4 x pp by default
    request = _request(zero=0)  # what the pipelines run: gradients all-reduced, unsharded
    check_launch(request, SimpleNamespace(distributed=True, world=4))
    assert request.microbatches == 8
    request = _request(lora=object(), tp=2)  # LoRA, also with --tp: each stage's adapters
    check_launch(request, SimpleNamespace(distributed=True, world=8))
    assert request.microbatches == 8


def test_sharing_the_section_does_not_record_is_refused():
    """Tied embeddings (the embedding read on stage 0 and by the head on stage 1) run as
    the section's `shared` entry (tests/test_pipeline_shared.py); a parameter two stages
    hold without one (a document of an older modulec), or a tie the section does not
    record (inside repeated layers), is an error, never two copies trained apart."""
    from runtime.errors import RuntimeUserError
    from runtime.inputs import sized_inputs
    from runtime.train.pipeline import (_refuse_unrecorded_sharing, _refuse_unsupported,
                                        _section, with_pipeline)

    model = with_pipeline(pipeline_workers.tiny_model("llama_tied"), 2, 2)
    program = model.source.program_for(sized_inputs(["token_ids"], 1, 8))
    section = _section(program, 2, 2)
    assert [e["param"] for e in section["shared"]] == ["embedding"]
    _refuse_unsupported(model, program, section)
    with pytest.raises(RuntimeUserError, match=r"parameters two stages hold \(embedding\) "
                       r"but no `shared` entry"):
        _refuse_unsupported(model, program, dict(section, shared=[]))
    with pytest.raises(RuntimeUserError, match="has no `shared`"):
        _section(SimpleNamespace(document={"schedule": {"pipeline": {
            k: v for k, v in section.items() if k != "shared"}}}), 2, 2)
    with pytest.raises(RuntimeUserError, match=r"tied weights inside repeated layers "
                       r"\(blocks\[1\].x\) is not supported yet"):
        _refuse_unrecorded_sharing({"blocks[1].x": "blocks[1].y"}, section)


def test_an_ir_documents_micro_batches_are_the_default(tmp_path):
    from runtime.errors import RuntimeUserError
    from runtime.train.pipeline import check_launch

    with_section, without = tmp_path / "pp.ir", tmp_path / "plain.ir"
    with_section.write_text(json.dumps({"schedule": {"pipeline": {"microbatches": 6}}}))
    without.write_text(json.dumps({"schedule": {}}))
    request = _request(file=with_section)
    check_launch(request, SimpleNamespace(distributed=True, world=2))
    assert request.microbatches == request.grad_accum == 6
    with pytest.raises(RuntimeUserError, match="plain.ir has no pipeline section"):
        check_launch(_request(file=without), SimpleNamespace(distributed=True, world=2))


def test_two_pipelines_of_two_stages_train_as_one_process_accumulating(tmp_path):
    """DP 2 x PP 2 (four gloo processes; rank r is stage r % 2 of pipeline r // 2): each
    pipeline its own rows, each stage's gradients averaged over its two replicas. In
    float64 the losses and every parameter and moment after two steps are one process's
    with --grad-accum 4 over the same rows (to 1e-12), both replicas of a stage hold the
    same weights, and a trainer resumed from the state after step 1 ends the same. The
    programs are IR documents built with `--dp 2 --pp 2` (ZeRO-0: every replica steps
    its stage) and `--dp 2 --zero 1 --pp 2` (each bucket's moments on its owner alone,
    its weights broadcast from there): their mesh, buckets and ops read as written."""
    out = tmp_path / "dp"
    settings, steps, micro, rows, seq = {"n_layers": 4}, 2, 2, 1, 8
    documents = [_built_ir(tmp_path, settings, micro, rows, seq, dp=2, zero=zero)
                 for zero in (0, 1)]
    lora = _built_ir(tmp_path, {}, micro, rows, seq, dp=2, lora=("--lora", LORA_TEXT))
    tied = _built_ir(tmp_path, settings | {"tie_word_embeddings": "true"}, micro, rows, seq,
                     dp=2, zero=1, name="tied")
    spawn(pipeline_workers.train_data_parallel, nprocs=4,
             args=(4, free_port(), [(d, steps, micro, rows, seq)
                                    for d in documents + [lora, tied]], str(out)))
    ranks = [torch.load(f"{out}.{r}") for r in range(4)]
    for rank in ranks:
        for run in rank:
            _check_shard_resume(run)
    _check_dp_lora(lora, [r[2] for r in ranks], steps, micro, rows, seq)
    _check_dp_tied(tied, [r[3] for r in ranks], steps, micro, rows, seq)
    want_losses, want = pipeline_workers.train_reference(documents[0], steps, 2 * micro,
                                                         rows, seq)
    for run, zero in enumerate((0, 1)):
        runs = [r[run] for r in ranks]
        for rank in runs:
            assert rank["losses"] == pytest.approx(want_losses, rel=1e-12)
            assert rank["resumed"] == pytest.approx(want_losses[1:], rel=1e-12)
        for stage in (0, 1):  # the replicas of a stage: ranks stage and stage + 2
            for key in ("state", "resumed_state"):
                a, b = runs[stage][key]["masters"], runs[stage + 2][key]["masters"]
                assert a.keys() == b.keys()
                assert all(torch.equal(a[p], b[p]) for p in a)
        checked = [runs[0]["whole"]]  # state(): gathered over the stages (and replicas)
        if zero == 0:  # each replica's stages hold all of it
            checked += [{part: runs[0][key][part] | runs[1][key][part]
                         for part in ("masters", "exp_avg", "exp_avg_sq")}
                        for key in ("state", "resumed_state")]
        for got in checked:
            for part in ("masters", "exp_avg", "exp_avg_sq"):
                assert set(got[part]) == set(want[part]), (zero, part)
                for path, value in want[part].items():
                    torch.testing.assert_close(got[part][path], value, rtol=1e-12,
                                               atol=1e-14, msg=f"zero {zero} {part} {path}")
        if zero == 1:  # each replica holds the moments of the buckets it owns, no others
            for rank in runs:
                assert rank["owned"] and set(rank["state"]["exp_avg"]) == rank["owned"]
            assert runs[0]["owned"].isdisjoint(runs[2]["owned"])
            resumed = {part: {p: t for r in runs for p, t in r["resumed_state"][part].items()}
                       for part in ("masters", "exp_avg")}
            for part, got in resumed.items():
                for path, value in got.items():
                    torch.testing.assert_close(value, want[part][path], rtol=1e-12,
                                               atol=1e-14, msg=f"resumed {part} {path}")


def _check_shard_resume(run: dict) -> None:
    """A trainer given this rank's shard after step 1 (runtime.train.shards, each path
    from the replica that keeps it) runs the later steps bit for bit as the first did."""
    assert run["from_shards"] == run["losses"][1:]
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        a, b = run["state"][part], run["shard_state"][part]
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a), part


def _check_dp_tied(document: str, runs: list, steps: int, micro: int, rows: int,
                   seq: int) -> None:
    """DP 2 x PP 2 of tied embeddings (ZeRO-1; tests/test_pipeline_shared.py): each
    pipeline sums its two stages' embedding gradients in its own group after the DP
    all-reduces; one process's steps with --grad-accum 4 (float64, 1e-12), every rank's
    copy of the embedding the same, a resume from step 1 the same."""
    want_losses, want = pipeline_workers.train_reference(document, steps, 2 * micro,
                                                         rows, seq)
    for rank in runs:
        assert rank["losses"] == pytest.approx(want_losses, rel=1e-12)
        assert rank["resumed"] == pytest.approx(want_losses[1:], rel=1e-12)
    copies = [rank["state"]["masters"]["embedding"] for rank in runs]
    assert all(torch.equal(copy, copies[0]) for copy in copies)
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        assert set(runs[0]["whole"][part]) == set(want[part]), part
        for path, value in want[part].items():
            torch.testing.assert_close(runs[0]["whole"][part][path], value, rtol=1e-12,
                                       atol=1e-14, msg=f"dp tied {part} {path}")


def _check_dp_lora(document: str, runs: list, steps: int, micro: int, rows: int,
                   seq: int) -> None:
    """DP 2 x PP 2 with LoRA (`modulec build --pp 2 --dp 2 --lora LORA_TEXT`'s document,
    ZeRO-0): each stage's adapter gradients averaged over its replicas as its other
    gradients are; one process's steps with --grad-accum 4 (float64, 1e-10), the
    replicas of a stage equal, a resume from step 1 the same."""
    from modulec.lower.lora import is_adapter

    section = json.loads(Path(document).read_text())["schedule"]["pipeline"]
    assert all(is_adapter(r["path"]) for s in section["stages"]  # the base: no reduction
               for b in s["grad_buckets"] for r in b["params"])
    want_losses, want = pipeline_workers.train_reference(document, steps, 2 * micro,
                                                         rows, seq)
    for rank in runs:
        assert rank["losses"] == pytest.approx(want_losses, rel=1e-10)
        assert rank["resumed"] == pytest.approx(want_losses[1:], rel=1e-10)
    for stage in (0, 1):
        a, b = runs[stage]["state"]["masters"], runs[stage + 2]["state"]["masters"]
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
    got = runs[0]["whole"]
    assert set(got["exp_avg"]) == {p for p in want["masters"] if is_adapter(p)}
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        assert set(got[part]) == set(want[part]), part
        for path, value in want[part].items():
            torch.testing.assert_close(got[part][path], value, rtol=1e-10, atol=1e-12,
                                       msg=f"dp lora {part} {path}")


def test_the_irs_mesh_must_be_the_launch():
    """An IR built for one pipeline (mesh dp 1 x pp 2) on four processes: an error naming
    both numbers and the build that fits, before any group is made."""
    from runtime.dist.mesh import PipelineMesh
    from runtime.errors import RuntimeUserError

    with pytest.raises(RuntimeUserError) as caught:
        PipelineMesh.of(SimpleNamespace(world=4, rank=0), {"dp": 1, "pp": 2, "tp": 1})
    assert caught.value.message == ("the IR's pipeline mesh is dp 1 x pp 2 x tp 1 = 2 "
                                    "processes; this run has 4")
    assert "modulec build ... --pp 2 --dp 2" in caught.value.help[0]
    mesh = PipelineMesh(dp=2, pp=2, rank=3)
    assert (mesh.stage, mesh.dp_index, mesh.rank_of(0)) == (1, 1, 2)


def test_rows_of_a_pipeline_replica():
    from runtime.train.pipeline import pipeline_replica

    request = _request(pp=2)
    assert pipeline_replica(request, SimpleNamespace(distributed=True, world=4, rank=3)) == \
        (2, 1)
    assert pipeline_replica(request, SimpleNamespace(distributed=True, world=2, rank=1)) == \
        (1, 0)


def test_an_ir_with_a_zero_section_is_refused_under_pp(tmp_path):
    """`modulec build --dp 2 --zero 2 --pp 2` writes the distributed section (the plan's
    per-stage ZeRO memory); the pipeline runtime does not run it: a clear error."""
    from runtime.errors import RuntimeUserError
    from runtime.inputs import sized_inputs
    from runtime.train.pipeline import _section
    from tests.test_cli import run

    path = tmp_path / "zero.ir"
    built = run("build", "tests/data/pipeline_llama.module", "--shape", "B=1", "--shape",
                "T=8", "--dp", "2", "--zero", "2", "--pp", "2", "--microbatches", "2", "-o",
                path)
    assert built.exit_code == 0, built.output
    model = pipeline_workers.tiny_model(str(path))
    program = model.source.program_for(sized_inputs(["token_ids"], 1, 8))
    with pytest.raises(RuntimeUserError, match=r"--zero with --pp: not supported yet \(the "
                       r"IR has a `distributed` section, ZeRO-2"):
        _section(program, 2, 2)
    # ZeRO-0 is what the pipelines run: the pipeline section alone says it
    built = run("build", "tests/data/pipeline_llama.module", "--shape", "B=1", "--shape",
                "T=8", "--dp", "2", "--zero", "0", "--pp", "2", "-o", path)
    assert built.exit_code == 0, built.output
    schedule = json.loads(path.read_text())["schedule"]
    assert "distributed" not in schedule and schedule["pipeline"]["mesh"]["dp"] == 2


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.startswith("{")]


def _lora_cli(ckpt, **more) -> dict:
    """`modulec train --pp 2 --microbatches 2 --lora LORA_TEXT`'s arguments (the tiny HF
    Llama, float32 on the CPU, 2 steps of one row a micro-batch)."""
    from modulec.lower.lora import LoraOptions

    return dict(file=Path(LLAMA), data=ckpt / "tokens.bin", seq=16, batch=1, device="cpu",
                lr=1e-2, fmt="json", lora=LoraOptions.of(LORA_TEXT), hf_weights=ckpt / "hf",
                steps=2, pp=2, microbatches=2) | more


def test_pp_lora_trains_each_stages_adapters_as_one_process(spawned):
    """--pp 2 with LoRA (`modulec build --pp 2 --lora`'s document of the @partition model;
    float64, dropout on the model and on the adapters' input): two AdamW steps equal one
    process's accumulating the two micro-batches (losses, adapters and moments, to
    1e-10); each stage trains (and keeps moments for) its own layers' adapters only,
    drawn as one process draws them; the frozen base is untouched."""
    from modulec.lower.lora import is_adapter

    name, (_, steps, micro, rows, seq) = str(spawned / "lora.ir"), PIPELINED_LORA
    stages = [torch.load(spawned / f"stage.{r}")[2] for r in (0, 1)]
    want_losses, want = pipeline_workers.train_reference(name, steps, micro, rows, seq)
    first = pipeline_workers.tiny_model(name).params  # one process's start
    adapters = {p for p in want["masters"] if is_adapter(p)}
    assert adapters and set(want["exp_avg"]) == adapters  # LoRA: the adapters train
    trained = [set(s["state"]["exp_avg"]) for s in stages]
    assert all(trained) and not trained[0] & trained[1] and trained[0] | trained[1] == adapters
    for stage, mine in zip(stages, trained):
        assert stage["losses"] == pytest.approx(want_losses, rel=1e-10)
        assert {p for p in stage["params"] if is_adapter(p)} == mine  # its layers' alone
        for path, value in stage["params"].items():
            if is_adapter(path):
                torch.testing.assert_close(value, want["masters"][path], rtol=1e-10,
                                           atol=1e-12, msg=path)
            else:  # the frozen base, bit for bit
                assert torch.equal(value, first[path]), path
    whole = stages[0]["whole"]  # state(): the stages gathered on rank 0
    for part in ("masters", "exp_avg", "exp_avg_sq"):
        assert set(whole[part]) == set(want[part]), part
        for path, value in want[part].items():
            torch.testing.assert_close(whole[part][path], value, rtol=1e-10, atol=1e-12,
                                       msg=f"{part} {path}")
    assert all(bool(want["masters"][p].any()) for p in adapters if p.endswith("lora_B"))


def test_pp_lora_saves_one_processes_adapter_file_and_resumes(ckpt, spawned, tmp_path):
    """`modulec train --pp 2 --lora --save` writes one PEFT adapter file of both stages'
    adapters (gathered on rank 0) beside the base: one process's (`--grad-accum 2`, an IR
    document built with `--lora`, whose checkpoint holds the adapter files too), the
    base bit for bit; a --pp 2 resume from step 1 ends with the same adapters bit for
    bit, and a one-process resume from it takes the step the pipeline took."""
    from safetensors.torch import load_file

    from runtime.lora import CONFIG, WEIGHTS
    from tests.test_cli import run
    from tests.test_train import losses, train

    steps = [r["loss"] for r in _rows(spawned / "stage.0.0") if r["event"] == "step"]
    built = run("build", LLAMA, "--config", ckpt / "hf" / "config.json", "--shape", "B=1",
                "--shape", "T=16", "--lora", LORA_TEXT, "-o", tmp_path / "lora.ir")
    assert built.exit_code == 0, built.output
    one = run("train", tmp_path / "lora.ir", "--data", ckpt / "tokens.bin", "--seq", "16",
              "--batch", "1", "--device", "cpu", "--lr", "1e-2", "--format", "json",
              "--hf-weights", ckpt / "hf", "--grad-accum", "2", "--steps", "2", "--save",
              tmp_path / "one")
    assert steps == pytest.approx(losses(one), rel=1e-5)
    lora = ("--batch", "1", "--grad-accum", "2", "--steps", "2", "--lora", LORA_TEXT)
    pp, ref = spawned / "pp" / "checkpoint-2", tmp_path / "one" / "checkpoint-2"
    a, b = load_file(str(pp / WEIGHTS)), load_file(str(ref / WEIGHTS))
    assert a.keys() == b.keys() and len(a) == 2 * 3 * 2  # 2 layers, 3 projections, A and B
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)
    assert json.loads((pp / CONFIG).read_text()) == json.loads((ref / CONFIG).read_text())
    base, want = load_file(str(pp / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert base.keys() == want.keys() and all(torch.equal(base[k], want[k]) for k in want)
    again = _rows(spawned / "stage.1.0")  # --pp 2 resumed from step 1
    assert any(r["event"] == "note" and r["text"].startswith("resumed at step 1")
               for r in again)
    assert [r["loss"] for r in again if r["event"] == "step"] == steps[1:]
    twice = load_file(str(spawned / "again" / "checkpoint-2" / WEIGHTS))
    assert all(torch.equal(twice[name], a[name]) for name in a)  # bit for bit
    one = train(ckpt, *lora, "--resume", spawned / "pp" / "checkpoint-1", "--save",
                tmp_path / "r", weights=False)
    assert losses(one) == pytest.approx(steps[1:], rel=1e-5)
    notes = [json.loads(line)["text"] for line in one.stdout.splitlines() if '"note"' in line]
    assert "resumed at step 1 from the consolidated checkpoint (this run is one process)" \
        in notes  # the pipeline's shards joined (no optimizer.safetensors)
    onward = load_file(str(tmp_path / "r" / "checkpoint-2" / WEIGHTS))
    for name in a:
        torch.testing.assert_close(onward[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_pp_saves_per_rank_shards_and_resumes_from_them(spawned):
    """`modulec train --pp 2 --save` (the LoRA run above, a save each step) writes each
    rank's shard and its layout into the checkpoint, no consolidated optimizer file (the
    shards hold it all); the --pp 2 resume from step 1 reads the shards, says so, and
    its step-2 checkpoint is the uninterrupted run's bit for bit (weights and shards)."""
    from safetensors.torch import load_file

    saved = spawned / "pp" / "checkpoint-1"
    names = sorted(f.name for f in saved.glob("shard-rank*"))
    assert names == [f"shard-rank0000{r}.{ext}" for r in (0, 1) for ext in ("json",
                                                                             "safetensors")]
    assert not (saved / "optimizer.safetensors").exists()
    for rank in (0, 1):
        index = json.loads((saved / f"shard-rank0000{rank}.json").read_text())
        assert {k: index[k] for k in ("world", "rank", "pp", "stage", "dp", "tp", "zero",
                                      "step")} == dict(world=2, rank=rank, pp=2, stage=rank,
                                                       dp=1, tp=1, zero=None, step=1)
        assert index["data"] == {"step": 1, "samples": 2} and len(index["layout"]) == 16
        held = load_file(str(saved / index["file"]))
        masters = {k for k in held if k.startswith("masters.")}
        assert masters and {k.partition(".")[2] for k in held if k.startswith("exp_avg.")} \
            == {k.partition(".")[2] for k in masters if "lora_" in k}  # base: no moments
    notes = [r["text"] for r in _rows(spawned / "stage.1.0") if r["event"] == "note"]
    assert "resumed at step 1 from the per-rank shards (2 ranks, --pp 2)" in notes
    whole, again = spawned / "pp" / "checkpoint-2", spawned / "again" / "checkpoint-2"
    files = sorted(f.name for f in whole.glob("*.safetensors"))
    assert files == sorted(f.name for f in again.glob("*.safetensors"))
    for name in files:
        a, b = load_file(str(whole / name)), load_file(str(again / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_pipeline_shard_of_another_layout_is_not_read(spawned, tmp_path):
    """A shard whose layout is not this run's (another stage here) is refused with the
    key that differs, and the run reads the consolidated state (joined from every rank's
    shard); a checkpoint missing a rank's shard is an error naming the folder, a cut one
    is a damaged checkpoint."""
    import shutil

    from runtime.errors import RuntimeUserError
    from runtime.train.checkpoint import read_optimizer, read_trainer
    from runtime.train.shards import own_shard

    folder = tmp_path / "checkpoint-1"
    shutil.copytree(spawned / "pp" / "checkpoint-1", folder)
    shape = json.loads((folder / "shard-rank00001.json").read_text())
    shape = {k: shape[k] for k in ("world", "rank", "pp", "stage", "dp", "dp_rank", "zero",
                                   "tp", "tp_rank", "layout")}
    index, why = own_shard(folder, shape)
    assert index is not None and why == ""
    index, why = own_shard(folder, shape | {"stage": 0, "layout": "0" * 16})
    assert index is None and "layout differs: stage, layout" in why and "--pp 2" in why
    state = read_optimizer(folder)  # every rank's shard, joined by path
    assert state["step"] == 1 and state["exp_avg"].keys() < state["masters"].keys()
    with open(folder / "shard-rank00001.safetensors", "r+b") as file:
        file.truncate(100)
    with pytest.raises(RuntimeUserError, match="damaged: shard-rank00001.safetensors"):
        read_trainer(folder)
    for name in ("shard-rank00001.safetensors", "shard-rank00001.json"):
        (folder / name).unlink()
    with pytest.raises(RuntimeUserError, match="not every rank's pipeline shard"):
        read_optimizer(folder)


def test_a_mixed_stages_shard_holds_its_fp32_masters_and_loads_in_place(spawned):
    """Stages held as on the GPU (bf16 compute copies of fp32 masters, on gloo): each
    rank's shard holds the fp32 masters and moments; a fresh trainer given it takes step
    2 bit for bit as the first did (the device step count synced), and loading it into a
    trainer that has stepped copies into its masters, moments and compute copies (the
    tensors a captured step reads) and makes each copy its master rounded."""
    for rank in (0, 1):
        got = torch.load(spawned / f"stage.mixed.{rank}")
        assert got["dtypes"] and set(got["dtypes"].values()) == {torch.float32}
        assert got["losses"][0] == got["losses"][1] and got["counts"] == (1, 1.0)
        after, again, reloaded = got["states"]
        assert after["masters"] and after["exp_avg"]
        for part in ("masters", "exp_avg", "exp_avg_sq"):  # step 2: the same bits
            assert after[part].keys() == again[part].keys()
            assert all(torch.equal(after[part][p], again[part][p]) for p in after[part])
            assert all(torch.equal(t, got["shard"][f"{part}.{p}"])  # step 1's, back in
                       for p, t in reloaded[part].items())
        assert got["same_tensors"]
        for path, master in reloaded["masters"].items():
            assert torch.equal(got["copies"][path], master.to(got["copies"][path].dtype))
