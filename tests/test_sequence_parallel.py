"""Sequence parallel (`--tp M --sp`, Megatron-LM's): between the tensor-parallel regions
each rank holds T / M rows of the residual stream (modulec.lower.sequence_parallel). On
two CPU processes (gloo) a step's logits, loss and every gradient equal one process
running the unsharded model and two running tensor parallel alone (float64). Also the
rank program (sp_scatter, sp_all_gather / sp_reduce_scatter, sp_gather, local types)
and the diagnostics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from modulec.ir.verify import verify_graph  # noqa: E402
from modulec.lower.build import BuildRequest, build  # noqa: E402
from runtime.tensor_parallel import unshard_params, vocab_outputs  # noqa: E402
from tests import tp_workers  # noqa: E402
from tests.runtime_models import TINY  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def sp_build(name: str = "llama", tp: int = 2, seq: int = 6, sp: bool = True, **more):
    path, settings = TINY[name]
    settings = {k: str(v) for k, v in (settings | more).items()}
    return build(BuildRequest(ROOT / path, settings=settings, shapes={"B": 2, "T": seq},
                              tensor_parallel=tp, sequence_parallel=sp))


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=what)


MODELS = ["llama", "qwen3", "mixtral", "example_gpt2"]  # + a region weight; MoE; biases, LayerNorm
RUNS = [(name, True) for name in MODELS] + [("llama", False)]  # and tensor parallel alone


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list:
    """Both ranks' steps of every run: one spawn."""
    out = str(tmp_path_factory.mktemp("sp") / "rank")
    spawn(tp_workers.run_rank_sp, nprocs=2, args=(2, free_port(), RUNS, out))
    return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.mark.parametrize("name", MODELS)
def test_tp2_with_sp_equals_one_process(name, two_ranks):
    want = tp_workers.step(tp_workers.tiny_model(name))
    ranks = [r[name, True] for r in two_ranks]
    program = tp_workers.tiny_model(name, 2, 0, True).source.program(planned=False)
    assert program.document["schedule"]["tensor_parallel"]["sequence_parallel"] is True
    whole = torch.cat([r["logits"] for r in ranks], dim=-1)  # a @shard(vocab) head's
    for got in ranks:
        _close(whole if "logits" in vocab_outputs(program) else got["logits"],
               want["logits"], "logits")
        _close(got["loss"], want["loss"], "loss")
    grads = unshard_params([r["grads"] for r in ranks], program)
    assert set(grads) == set(want["grads"])
    for path, value in want["grads"].items():
        _close(grads[path], value, path)
    # a replicated parameter (the norms' weights, read on each rank's rows; biases after
    # a region) gets its gradient summed over the ranks (tp_copy): whole and equal on both
    replicated = [p for p in want["grads"] if ranks[0]["grads"][p].shape == grads[p].shape]
    assert any("ln" in p or "norm" in p for p in replicated)
    for path in replicated:
        _close(ranks[1]["grads"][path], ranks[0]["grads"][path], path)


def test_tp2_with_sp_equals_tp2(two_ranks):
    for rank in two_ranks:
        sp, tp = rank["llama", True], rank["llama", False]
        _close(sp["logits"], tp["logits"], "logits")
        _close(sp["loss"], tp["loss"], "loss")
        assert set(sp["grads"]) == set(tp["grads"])
        for path, value in tp["grads"].items():  # each rank's slices and replicas
            _close(sp["grads"][path], value, path)


def test_the_rank_program_splits_the_sequence_between_the_regions():
    result = sp_build()
    assert not [d for d in result.diagnostics if d.is_error]
    graph = result.graph
    assert not verify_graph(graph)
    attention = graph.function("CausalSelfAttention#1")
    ops = [n.target for n in attention.nodes]
    assert ops[0] == "sp_all_gather" and ops[-1] == "sp_reduce_scatter"
    assert "tp_copy" not in ops and "tp_all_reduce" not in ops
    assert attention.inputs[0].shape == ("2", "3", "32")  # T / 2 rows
    assert attention.value(attention.nodes[0].outputs[0]).shape == ("2", "6", "32")
    block = graph.function("DenseTransformerBlock#1")
    assert [i.shape for i in block.inputs] == [("2", "3", "32")] * 2
    # the norms run on the local rows; their weights' gradients are summed (tp_copy)
    assert [n.target for n in block.nodes].count("tp_copy") == 2
    entry = graph.function(graph.entry)
    targets = [n.target for n in entry.nodes]
    # the vocab-parallel embedding's partial sums reduce-scattered to the local rows; the
    # head's input gathered (its gradient reduce-scattered), the logits every row's, this
    # rank's half of the vocabulary
    assert targets[:2] == ["vocab_parallel_embedding", "sp_reduce_scatter"]
    assert "sp_scatter" not in targets
    assert targets.index("sp_all_gather") == targets.index("matmul") - 1
    assert entry.value(entry.outputs[0]).shape == ("2", "6", "32")
    zeros = next(n for n in entry.nodes if n.target == "zeros")
    assert zeros.attr("shape") == [2, 3, 32]  # made local, not scattered
    backward = graph.function("CausalSelfAttention#1.backward")
    derived = [n.target for n in backward.nodes if n.kind == "op"]
    # the gathered input's reduce-scatter overlaps the weight gradient (tp_overlap)
    assert derived[0] == "sp_reduce_scatter_backward" and derived[-2:] == [
        "sp_all_gather_backward", "matmul_backward"]
    assert result.document["schedule"]["tensor_parallel"]["sequence_parallel"] is True


def test_a_sequence_not_divisible_by_tp_names_the_tensor_and_dim():
    result = sp_build(seq=7)
    errors = [d for d in result.diagnostics if d.is_error]
    assert errors and errors[0].code == "E027"
    # the first value split before the blocks (the zeros of the residual stream; x0, the
    # vocab-parallel embedding's sum, is reduce-scattered only where it splits)
    assert "dim 1 of `residual0` (7, the sequence) is not divisible by tp_size 2" in \
        errors[0].message


# one tensor-parallel region (a column then a row matmul) for the small models below
SHARDED_MLP = """module MLP(d: int = 8, f: int = 16):
  let:
    local_f = f // tp_size

  params:
    up: [local_f, d] @shard(column)
    down: [d, local_f] @shard(row)

  forward:
    in: x: [B, T, d]
    out: [B, T, d]

    graph:
      x -> matmul(up, transpose=NT) -> relu() -> h
      h -> matmul(down, transpose=NT) -> out

"""


def test_dropout_on_split_rows_is_refused(tmp_path):
    source = tmp_path / "drop.module"
    source.write_text(SHARDED_MLP + '''model Drop(d: int = 8):
  params:
    mlp: MLP(d)

  forward:
    in: x: [B, T, d]
    out: y: [B, T, d]

    graph:
      x -> mlp -> h
      h -> dropout(p=0.1) -> (y, mask)
''')
    result = build(BuildRequest(source, model="Drop", shapes={"B": 2, "T": 4},
                                tensor_parallel=2, sequence_parallel=True))
    errors = [d for d in result.diagnostics if d.is_error]
    assert errors and errors[0].code == "E008"
    assert "dropout on sequence-split rows is not supported yet" in errors[0].message


def test_build_and_plan_take_sp():
    from click.testing import CliRunner

    from modulec.cli.main import modulec

    path, settings = TINY["llama"]
    args = [str(ROOT / path)] + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    shapes = ["--shape", "B=2", "--shape", "T=64"]
    built = CliRunner().invoke(modulec, ["build", *args, "--tp", "2", "--sp", "--emit",
                                         "graph"])
    assert built.exit_code == 0, built.output
    assert "op sp_all_gather(x, dim=1, group=tp, size=2)" in built.output
    assert "[B, (T // 2), 32]" in built.output  # the split sequence, T given at run time
    alone = CliRunner().invoke(modulec, ["build", *args, "--sp"])
    assert alone.exit_code == 2 and "give --tp M" in alone.output
    # per rank, sequence parallel keeps fewer activations than tensor parallel alone
    saved = {}
    for flags in (["--tp", "2"], ["--tp", "2", "--sequence-parallel"]):
        planned = CliRunner().invoke(modulec, ["plan", *args, *shapes, *flags,
                                               "--format", "json"])
        assert planned.exit_code == 0, planned.output
        regions = json.loads(planned.output)["regions"]
        saved[len(flags)] = {r["region"]: r["arena_bytes"] for r in regions}
    assert saved[3]["saved_activations"] < saved[2]["saved_activations"]
    assert saved[3]["transient_activations"] < saved[2]["transient_activations"]


def test_the_verifier_rederives_the_collectives_types():
    """A document that lies about a gathered value's sequence dim is refused."""
    from dataclasses import replace

    graph = sp_build().graph
    attention = graph.function("CausalSelfAttention#1")
    gathered = attention.nodes[0].outputs[0]
    values = tuple(replace(v, shape=("2", "3", "32")) if v.id == gathered else v
                   for v in attention.values)
    lied = replace(graph, functions=tuple(replace(f, values=values) if f is attention else f
                                          for f in graph.functions))
    problems = verify_graph(lied)
    assert any("node f0.sp_all_gather0: `%tp_copy1` is declared [2, 3, 32, bf16], but "
               "sp_all_gather gives [2, 6, 32, bf16]" in p for p in problems), problems


@pytest.mark.parametrize("bias, local", [("[B, T, d]", True), ("[1, T, d]", False),
                                         ("[B, 1, d]", False), ("[1, 1, d]", True)])
def test_a_row_wise_op_beside_rows_split_otherwise_reads_gathered_rows(tmp_path, bias, local):
    """A rank's rows are a block of the B x T tokens flattened (runtime/kernels/comm.py):
    an operand that varies along B or T stays beside them only when it is split alike
    (the same [B, T]); else the op runs on all rows (sp_gather)."""
    source = tmp_path / "bias.module"
    source.write_text(SHARDED_MLP + f'''model Bias(d: int = 8):
  params:
    mlp: MLP(d)

  forward:
    in: x: [B, T, d]
    in: b: {bias}
    out: y: [B, T, d]

    graph:
      x -> mlp -> h
      (h, b) -> add() -> y
''')
    result = build(BuildRequest(source, model="Bias", shapes={"B": 2, "T": 4},
                                tensor_parallel=2, sequence_parallel=True))
    assert not [d for d in result.diagnostics if d.is_error]
    entry = result.graph.function(result.graph.entry)
    add = next(n for n in entry.nodes if n.target == "add")
    made = {o: n.target for n in entry.nodes for o in n.outputs}
    assert (made[add.inputs[0]] != "sp_gather") == local
    assert entry.value(add.outputs[0]).shape[1] == ("2" if local else "4")  # T / 2 rows
    assert not verify_graph(result.graph)


def test_sp_without_tp_is_an_error():
    """The CLI (a usage error), the build (E008) and the runtime refuse `--sp` without
    `--tp M` by modulec.lower.tensor_parallel.sequence_parallel_problem's message."""
    from click.testing import CliRunner

    from modulec.cli.main import modulec
    from modulec.lower.tensor_parallel import SP_NEEDS_TP
    from runtime.dist.context import check_tensor_parallel
    from runtime.errors import RuntimeUserError

    errors = [d for d in sp_build(tp=1).diagnostics if d.is_error]
    assert [(d.code, d.message) for d in errors] == [("E008", SP_NEEDS_TP)]
    with pytest.raises(RuntimeUserError, match=r"^--sp splits .* \(M of at least 2\)$"):
        check_tensor_parallel(1, True, 2)
    path, _ = TINY["llama"]
    alone = CliRunner().invoke(modulec, ["build", str(ROOT / path), "--tp", "1", "--sp"])
    assert alone.exit_code == 2 and SP_NEEDS_TP in " ".join(alone.output.split())
    check_tensor_parallel(2, True, 2)  # and with a group to split over, none
