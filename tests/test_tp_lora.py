"""LoRA under tensor parallel (`modulec train --tp 2 --lora ...`, modulec/lower/lora_tp.py,
docs/decisions.md "LoRA under tensor parallel") on gloo CPU processes, the tiny Llama with
adapters on every projection: the adapters of a column-parallel projection (q, k, v,
gate, up) have B split by rows and A whole (its gradient summed by a `tp_copy`), those of
a row-parallel one (o, down) A split by columns and B whole (likewise). Two AdamW steps
of the TP pair (also with --sp, and DP 2 x TP 2 under ZeRO-2) equal one process's in
float64: losses, adapters and moments joined; the base weights untouched. The adapters
of a --tp run start as one process's (drawn whole, sliced), and `modulec train --tp 2
--lora --save` writes the whole adapters, which a one-process resume continues from.
On two GPUs: tests/test_cuda_tp_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from modulec.lower.lora import is_adapter  # noqa: E402
from runtime.tensor_parallel import shard_params, unshard_params  # noqa: E402
from tests import tp_lora_workers as workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.runtime_models import TINY  # noqa: E402

pytest.importorskip("transformers")
from tests.test_train import LLAMA, ckpt  # noqa: E402,F401 (the tiny HF Llama fixture)

STEPS, ROWS, SEQ = 2, 2, 8
RUNS = [(False, None), (True, None)]  # (--sp, --zero)
PARTS = ("masters", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def whole() -> dict:
    return workers.whole_params()


def _cli(ckpt, **more) -> dict:
    """`modulec train --lora ...`'s arguments (float32 on the CPU, the tiny HF Llama)."""
    from modulec.lower.lora import LoraOptions

    return dict(file=Path(LLAMA), data=ckpt / "tokens.bin", seq=16, batch=1, device="cpu",
                lr=1e-2, fmt="json", lora=LoraOptions.of(workers.LORA),
                hf_weights=ckpt / "hf", steps=2) | more


@pytest.fixture(scope="module")
def spawned(whole, ckpt, tmp_path_factory) -> Path:
    """One start of two gloo processes (--tp 2) for both: the float64 steps of RUNS, then
    `modulec train --tp 2 --lora --save` (its entry, as under torchrun) saving each step,
    and the same resumed from its first checkpoint."""
    folder = tmp_path_factory.mktemp("tp_lora")
    cli = [_cli(ckpt, tp=2, save=folder / "tp", save_every=1),
           _cli(ckpt, tp=2, save=folder / "again", hf_weights=None,
                resume=folder / "tp" / "checkpoint-1")]  # the same layout: its shards
    spawn(workers.lora_rank, nprocs=2,
             args=(2, [free_port() for _ in range(3)], whole, RUNS, (STEPS, ROWS, SEQ), cli,
                   str(folder / "rank")))
    return folder


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for path, value in want.items():
        torch.testing.assert_close(got[path], value, rtol=1e-9, atol=1e-12,
                                   msg=f"{what} {path}")


def _check(got: dict, want: dict, whole: dict, program, rank: int, what: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-10), what
    adapters = {p for p in want["masters"] if is_adapter(p)}
    assert adapters and set(want["exp_avg"]) == adapters  # LoRA: the adapters train
    for part in PARTS:
        _close({p: got[part][p] for p in adapters}, {p: want[part][p] for p in adapters},
               f"{what} {part}")
    for path in adapters:  # it trained: the adapters moved
        assert not torch.equal(want["masters"][path], whole[path]), path
    mine = shard_params(whole, program, rank)
    for path, value in got["params"].items():  # the frozen base: this rank's slices as given
        if not is_adapter(path):
            assert torch.equal(value, mine[path]), (what, path)


def test_tp_lora_steps_equal_one_process(whole, spawned):
    """--tp 2, with and without --sp, on two processes: one process's steps; a step of
    the GPU trainer's interpreter (its LoRA paths: the delta's addmm, the d_x sums) on a
    rank's program is the reference's."""
    want = workers.one_process(whole, STEPS, ROWS, SEQ)
    ranks = [torch.load(spawned / f"rank.{r}") for r in range(2)]
    for sp, zero in RUNS:
        program = workers.lora_model(2, 0, sp).source.program(planned=False)
        for rank, got in enumerate(ranks):
            _check(got[sp, zero], want, whole, program, rank, f"sp={sp} rank {rank}")
            gathered = got[sp, zero]["gpu_gathered"]  # the GPU trainer's save, joined
            if rank == 0:  # (the main rank's: the one the checkpoint writes)
                for part in PARTS:
                    _close(gathered[part], got[sp, zero][part], f"gathered {part}")
            paths = got[sp, zero]["gpu_paths"]  # the GPU step's interpreter, on the CPU
            assert paths["same_grads"] and paths["loss"] < 1e-12 and paths["grads"] < 1e-12
            assert (paths["fused"], paths["dx_fused"]) == (8, 8)  # 4 projections x 2 layers


def test_the_adapters_split_as_their_weights_and_start_as_one_processes():
    """The program's tensor_parallel section: B of a column-parallel projection split
    along its rows (a fused weight's part by its own rows), A of a row-parallel one along
    its columns; A of a column-parallel and B of a row-parallel projection read through
    a `tp_copy`. A TP rank's fresh adapters (runtime.lora.init_adapters) are its slices of
    one process's."""
    from runtime.lora import init_adapters
    from runtime.program import tp_section

    one = workers.lora_model()
    init_adapters(one)
    ranks = []
    for rank in (0, 1):
        model = workers.lora_model(2, rank)
        init_adapters(model)
        ranks.append({p: t for p, t in model.params.items()})
    program = workers.lora_model(2, 0).source.program(planned=False)
    shards = tp_section(program.document)["shards"]
    attention = next(v for k, v in shards.items() if k.startswith("CausalSelfAttention"))
    assert attention["qkv_weight.k.lora_B"] == {"strategy": "column", "dim": 0,
                                                "parts": [16], "size": 2}
    assert attention["out_weight.lora_A"]["dim"] == 1
    assert "qkv_weight.q.lora_A" not in attention and "out_weight.lora_B" not in attention
    copied = {n.inputs[0] for f in program.graph.functions for n in f.nodes
              if n.target == "tp_copy" and n.inputs[0].startswith(("param:", "%lora"))}
    assert "param:out_weight.lora_B" in copied and "param:down_weight.lora_B" in copied
    joined = unshard_params(ranks, program)
    assert set(joined) == set(one.params)
    for path, value in one.params.items():
        assert torch.equal(joined[path], value), path
    assert ranks[0]["blocks[0].mlp.down_weight.lora_A"].shape == (4, 24)  # d_ff 48 / 2


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.startswith("{")]


def test_tp_lora_saves_the_whole_adapters_and_resumes_on_one_process(ckpt, spawned,
                                                                     tmp_path):
    """`modulec train --tp 2 --lora --save` saves PEFT adapter files holding the whole A
    and B: those of the one-process run; a one-process resume from the TP checkpoint
    (--tp 2 -> 1) takes the step the TP run took, and a --tp 2 resume (from the ranks'
    shards) ends with the same adapters bit for bit."""
    from safetensors.torch import load_file

    from runtime.lora import CONFIG, WEIGHTS
    from runtime.train.run import train_model

    steps = [r["loss"] for r in _rows(spawned / "rank.0.0") if r["event"] == "step"]
    one = json.loads(train_model(**_cli(ckpt, save=tmp_path / "one")))
    assert steps[-1] == pytest.approx(one["loss_last"], rel=1e-5)
    a = load_file(str(spawned / "tp" / "checkpoint-2" / WEIGHTS))
    b = load_file(str(tmp_path / "one" / "checkpoint-2" / WEIGHTS))
    assert a.keys() == b.keys() and len(a) == 2 * 2 * 7  # 2 layers, 7 projections, A and B
    for name in b:
        assert a[name].shape == b[name].shape, name
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)
    assert b["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 48)
    assert bool(b["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].any())
    config = json.loads((spawned / "tp" / "checkpoint-2" / CONFIG).read_text())
    assert config["r"] == 4 and "down_proj" in config["target_modules"]
    resumed = json.loads(train_model(**_cli(ckpt, resume=spawned / "tp" / "checkpoint-1",
                                            hf_weights=None)))
    assert resumed["loss_last"] == pytest.approx(steps[1], rel=1e-5)
    again = _rows(spawned / "rank.1.0")  # --tp 2 resumed from step 1's per-rank shards
    assert "resumed at step 1 from the per-rank shards (2 ranks, --tp 2)" in \
        [r["text"] for r in again if r["event"] == "note"]
    assert [r["loss"] for r in again if r["event"] == "step"] == steps[1:]
    twice = load_file(str(spawned / "again" / "checkpoint-2" / WEIGHTS))
    assert all(torch.equal(twice[name], a[name]) for name in a)  # bit for bit


MISALIGNED = '''
model Halves(d: int = 8, f: int = 8):
  let:
    lf = f // tp_size
  params:
    up: [2 * lf, d] @shard(column)
    down: [d, lf] @shard(row)
  forward:
    in: x: [B, d]
    out: [B, d]
    graph:
      x -> matmul(up, transpose=NT) -> h @adapter(lora, targets=[a, b])
      h -> split([lf, lf], dim=-1) -> (a, b)
      (a, b) -> add() -> s
      s -> matmul(down, transpose=NT) -> out
'''


def test_adapters_that_would_not_split_as_their_weight_are_e008(tmp_path):
    """A fused weight's LoRA parts (two halves, a and b) that its `@shard` does not name
    as parts (each rank holds one contiguous block of both): E008 naming the weight; the
    same build without --tp adapts both parts."""
    from modulec.lower.build import BuildRequest, build
    from modulec.lower.lora import LoraOptions

    source = tmp_path / "halves.module"
    source.write_text(MISALIGNED)
    request = dict(model="Halves", shapes={"B": 2}, lora=LoraOptions())
    errors = [d for d in build(BuildRequest(source, tensor_parallel=2, **request)).diagnostics
              if d.is_error]
    assert len(errors) == 1 and errors[0].code == "E008", errors
    assert "LoRA on `up` of `Halves` under tensor parallel" in errors[0].message
    assert "are not the parts of its `@shard`" in errors[0].message
    alone = build(BuildRequest(source, **request))
    assert alone.document is not None
    targets = [a["target"] for a in alone.document["metadata"]["lora"]["adapters"]]
    assert targets == ["a", "b"]


def test_a_shard_resume_reads_a_tensor_parallel_ranks_slices_of_the_frozen_base(whole,
                                                                              tmp_path):
    """Under DP x TP with ZeRO a resume from the ranks' shards reads LoRA's frozen base
    from the consolidated optimizer file (whole tensors): each rank keeps its slices, on
    the CPU trainer (its model's parameters) and the GPU trainer (its host copies)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from runtime.train.checkpoint import OPTIMIZER
    from runtime.train.shards import load_frozen

    save_file({f"master.{p}": t.contiguous() for p, t in whole.items()},
              str(tmp_path / OPTIMIZER))
    model = workers.rank_model(whole, 2, 1)
    program = model.source.program(planned=False)
    want = shard_params(whole, program, 1)
    base = sorted(p for p in model.params if not is_adapter(p))
    zero = SimpleNamespace(paths={p for p in model.params if is_adapter(p)})
    for p in base:
        model.params[p] = torch.zeros_like(model.params[p])
    load_frozen(SimpleNamespace(zero=zero, names=sorted(model.params), model=model), tmp_path)
    gpu = SimpleNamespace(step=SimpleNamespace(zero=zero), model=model,
                          frozen={p: torch.zeros_like(want[p]) for p in base})
    load_frozen(gpu, tmp_path)
    assert any(want[p].shape != whole[p].shape for p in base)  # some are slices
    for p in base:
        assert torch.equal(model.params[p], want[p]) and torch.equal(gpu.frozen[p], want[p]), p


def test_the_lora_pass_returns_its_shards_and_writes_no_plan(monkeypatch):
    """No pass writes the tensor-parallel plan it reads (modulec/lower/pass_result.py): the
    plan the build hands the pipeline is unchanged after it, and the plan run_pipeline
    leaves in the context is that one with the `lora` pass's split adapters and the
    `tensor_parallel` pass's vocabulary-split logits added (what the section holds)."""
    from modulec.lower import build as build_module
    from modulec.lower.build import BuildRequest, build
    from modulec.lower.lora import LoraOptions, is_adapter

    seen, real = {}, build_module.run_pipeline

    def spy(graph, dump_after, dump, context):
        given = context.tensor_parallel
        before = ({f: dict(s) for f, s in given.shards.items()}, list(given.vocab_outputs))
        graph = real(graph, dump_after, dump, context)
        seen.update(given=given, before=before, after=context.tensor_parallel)
        return graph

    monkeypatch.setattr(build_module, "run_pipeline", spy)
    path, settings = TINY["llama"]
    built = build(BuildRequest(Path(path), settings={k: str(v) for k, v in settings.items()},
                               shapes={"B": 2, "T": 8}, tensor_parallel=2,
                               lora=LoraOptions.of(workers.LORA)))
    assert built.document is not None, built.diagnostics
    given, after = seen["given"], seen["after"]
    assert (given.shards, given.vocab_outputs) == seen["before"]  # nothing written into it
    assert not any(is_adapter(p) for found in given.shards.values() for p in found)
    added = {(f, p) for f, found in after.shards.items() for p in found} - \
        {(f, p) for f, found in given.shards.items() for p in found}
    assert added and all(is_adapter(p) for _, p in added)
    assert after.vocab_outputs == ["logits"] and given.vocab_outputs == []
    section = built.document["schedule"]["tensor_parallel"]["shards"]
    assert {(f, p[len("param:"):]) for f, p in added} <= \
        {(f, p) for f, found in section.items() for p in found}
