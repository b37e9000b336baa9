"""Tensor parallel (`--tp`, spec §7.6.1) on two CPU processes (gloo): each rank runs its
program (column-parallel QKV and gate/up, row-parallel O and down, tp_copy /
tp_all_reduce inserted by the `tensor_parallel` pass, backward derived); the logits, the
loss and every parameter gradient, gathered from the shards, equal one process running
the unsharded model (float64). Also the per-rank program, the weight slicing and the
diagnostics of shardings that cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")

from modulec.lower.build import BuildRequest, build  # noqa: E402
from runtime.tensor_parallel import (shard_tensor, unshard_params, unshard_tensors,  # noqa: E402
                                     vocab_outputs)
from tests import tp_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.runtime_models import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def tp_build(name: str, tp: int, **more):
    path, settings = TINY[name]
    settings = {k: str(v) for k, v in (settings | more).items()}
    return build(BuildRequest(ROOT / path, settings=settings, shapes={"B": 2, "T": 6},
                              tensor_parallel=tp))


# qwen3 runs on a process group given to set_tp_group, the others on the default group
# every one shards its vocabulary (`@shard(vocab)`: vocab-parallel embedding, head and
# loss); llama_tied and example_gpt2: one table serves the lookup and the head
STEPS = [("llama", False), ("qwen3", True), ("mixtral", False), ("example_gpt2", False),
         ("llama_tied", False)]
TRAINED = ["llama", "example_gpt2"]  # GPT-2: a tied head's slice


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The two ranks' results of every case of this file's tests, from one spawn
    (tests/tp_workers.py run_cases): [rank 0's, rank 1's], each {case: result}."""
    out = str(tmp_path_factory.mktemp("tp") / "rank")
    cases = [("step", name, own) for name, own in STEPS] + \
        [("train", name) for name in TRAINED] + [("vocab",)]
    spawn(tp_workers.run_cases, nprocs=2, args=(2, free_port(), cases, out))
    return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.mark.parametrize("name, own_group", STEPS)
def test_two_ranks_equal_one_process(name, own_group, two_ranks):
    want = tp_workers.step(tp_workers.tiny_model(name))
    ranks = [rank[("step", name, own_group)] for rank in two_ranks]
    program = tp_workers.tiny_model(name, 2, 0).source.program(planned=False)
    logits = [r["logits"] for r in ranks]
    if "logits" in vocab_outputs(program):  # a @shard(vocab) head: each rank's block
        logits = [torch.cat(logits, dim=-1)] * 2
    for got, rank_logits in zip(ranks, logits):
        torch.testing.assert_close(rank_logits, want["logits"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-10, atol=1e-12)
    grads = unshard_params([r["grads"] for r in ranks], program)
    assert set(grads) == set(want["grads"])
    for path, value in want["grads"].items():
        torch.testing.assert_close(grads[path], value, rtol=1e-9, atol=1e-12, msg=path)
    # a replicated parameter (norms, router, Qwen3's q_norm) gets the whole
    # gradient on both ranks
    replicated = [p for p in want["grads"] if ranks[0]["grads"][p].shape == grads[p].shape]
    assert len(replicated) < len(want["grads"])
    for path in replicated:
        torch.testing.assert_close(ranks[1]["grads"][path], ranks[0]["grads"][path],
                                   rtol=1e-10, atol=1e-12, msg=path)


@pytest.mark.parametrize("name", TRAINED)
def test_two_adamw_steps_on_two_ranks_equal_one_process(name, two_ranks):
    """AdamW is element-wise: each rank stepping its slices is the unsharded step (the
    tied head stays its table's slice: one tensor, its two gradients summed)."""
    want = tp_workers.train(tp_workers.tiny_model(name))
    ranks = [rank[("train", name)] for rank in two_ranks]
    program = tp_workers.tiny_model(name, 2, 0).source.program(planned=False)
    for got in ranks:
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-9)
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        whole = unshard_params([r[key] for r in ranks], program)
        assert set(whole) == set(want[key]), key
        for path, value in want[key].items():
            torch.testing.assert_close(whole[path], value, rtol=1e-9, atol=1e-12,
                                       msg=f"{key} {path}")


def test_the_vocab_parallel_kernels_on_two_ranks_equal_the_whole(two_ranks):
    """The loss over two vocabulary blocks (max and sums all-reduced, the target taken by
    its owner; ignore_index rows out; in chunks of 4 rows) and its local gradient equal
    torch's cross-entropy;
    the lookups' parts sum to the whole embedding; the padding row gets no gradient."""
    ranks = [rank[("vocab",)] for rank in two_ranks]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 8, (3, 5), generator=g)
    labels[0, :3] = -1
    ids = torch.randint(0, 8, (2, 7), generator=g, dtype=torch.int32)
    d_y = torch.randn(2, 7, 4, generator=g, dtype=torch.float64)
    table = torch.randn(8, 4, generator=g, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1),
                                             ignore_index=-1)
    (d_logits,) = torch.autograd.grad(loss, logits)
    for got in ranks:
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([r["d_logits"] for r in ranks], -1), d_logits,
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ranks[0]["part"] + ranks[1]["part"], table[ids.long()])
    d_table = torch.zeros(8, 4, dtype=torch.float64).index_add(0, ids.reshape(-1).long(),
                                                                d_y.reshape(-1, 4))
    d_table[5] = 0  # padding_idx 5: rank 1's row 1
    torch.testing.assert_close(torch.cat([r["d_table"] for r in ranks]), d_table)
    for got in ranks:  # the GPU step's kernel (train_kernels) agrees with the reference
        torch.testing.assert_close(got["step_d_table"], got["d_table"])
        torch.testing.assert_close(got["step_part"], got["part"])
        maxed, summed = got["reduced"]  # all_reduce_'s op: [0, 0] and [1, -1] reduced
        assert maxed.tolist() == [1.0, 0.0] and summed.tolist() == [1.0, -1.0]


def test_the_rank_program_splits_heads_and_columns():
    result = tp_build("llama", 2)
    assert not [d for d in result.diagnostics if d.is_error]
    graph = result.graph
    attention = graph.function("CausalSelfAttention#1")
    shapes = {p.id: p.shape for p in attention.params}
    assert shapes == {"param:qkv_weight": ("32", "32"), "param:out_weight": ("32", "16")}
    ops = [n.target for n in attention.nodes]
    assert ops[0] == "tp_copy" and ops[-1] == "tp_all_reduce"
    backward = graph.function("CausalSelfAttention#1.backward")
    # the input gradient's all-reduce is the last op (tp_overlap: the weight gradient's
    # GEMM runs after it is issued, then the wait)
    assert [n.target for n in backward.nodes if n.kind == "op"][-2:] == [
        "tp_copy_backward", "matmul_backward"]
    section = result.document["schedule"]["tensor_parallel"]
    assert section["shards"]["CausalSelfAttention#1"]["qkv_weight"] == {
        "strategy": "column", "dim": 0, "parts": [32, 16, 16], "size": 2}
    schema = {e["param"]: e for e in result.document["weight_schema"]}
    assert schema["blocks[{i}].attention.qkv_weight"]["shape"] == [64, 32]  # the checkpoint's
    assert schema["blocks[{i}].mlp.down_weight"]["shard"]["dim"] == 1


def test_tp_1_is_the_unsharded_program():
    plain = tp_build("qwen3", 1)
    assert "tensor_parallel" not in plain.document["schedule"]
    assert not any(n.target.startswith("tp_") for f in plain.graph.functions for n in f.nodes)


def test_a_fused_parameter_is_sliced_per_part():
    shard = {"strategy": "column", "dim": 0, "parts": [4, 2, 2], "size": 2}  # q, k, v rows
    whole = torch.arange(8).reshape(8, 1)
    assert shard_tensor(whole, shard, 0).flatten().tolist() == [0, 1, 4, 6]
    assert shard_tensor(whole, shard, 1).flatten().tolist() == [2, 3, 5, 7]
    slices = [shard_tensor(whole, shard, r) for r in range(2)]
    assert torch.equal(unshard_tensors(slices, shard), whole)


def test_kv_heads_not_divisible_by_tp_is_an_error_naming_the_tensor_and_dim():
    result = tp_build("llama", 4)  # num_kv_heads = 2
    errors = [d for d in result.diagnostics if d.is_error]
    assert errors and errors[0].code == "E027"
    message = errors[0].message
    assert "`qkv_weight`" in message and "dim 0" in message and "num_kv_heads" in message
    assert "tp_size 4" in message


def test_a_vocabulary_not_divisible_by_tp_is_an_error_naming_the_table_and_dim():
    errors = [d for d in tp_build("llama", 2, vocab_size=65).diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E027", "E027"]
    assert "`@shard(vocab)` of `embedding` cannot split across tp_size 2: dim 0 (65) is " \
        "not divisible by tp_size 2" in errors[0].message
    assert "`lm_head`" in errors[1].message and "padded" in errors[0].help[0]


def test_the_rank_program_splits_the_vocabulary():
    """Rank r's rows of the table (`@shard(vocab)`): a masked lookup all-reduced, the head
    column-parallel, the logits this rank's block of the vocabulary (an output the
    document names); a tied head (GPT-2) is its table's shard."""
    for name, table, head in (("llama", "embedding", "lm_head"), ("example_gpt2", "wte",
                                                                   "lm_head")):
        result = tp_build(name, 2)
        entry = result.graph.function(result.graph.entry)
        ops = [n.target for n in entry.nodes]
        assert ops[:2] == ["vocab_parallel_embedding", "tp_all_reduce"]
        assert ops[-2:] == ["tp_copy", "matmul"]
        assert entry.value(entry.outputs[0]).shape == ("2", "6", "32")
        section = result.document["schedule"]["tensor_parallel"]
        assert section["vocab_outputs"] == ["logits"]
        shards = section["shards"][entry.name]
        assert shards[table] == shards[head] == {"strategy": "vocab", "dim": 0,
                                                 "parts": [64], "size": 2}
        schema = {e["param"]: e for e in result.document["weight_schema"]}
        assert schema[head]["shape"] == [64, 32]  # the checkpoint's whole table


def test_d_ff_not_divisible_by_tp_is_an_error():
    result = tp_build("llama", 2, d_ff=47, num_heads=4, num_kv_heads=2)
    messages = [d.message for d in result.diagnostics if d.is_error]
    assert any("`up_weight`" in m and "d_ff" in m for m in messages), messages


def test_a_layout_conflict_is_an_error(tmp_path):
    source = tmp_path / "conflict.module"
    source.write_text('''module Conflict(d: int = 8, f: int = 16):
  let:
    local_f = f // tp_size

  params:
    up: [local_f, d] @shard(column)
    down: [d, local_f]

  forward:
    in: x: [B, d]
    out: [B, d]

    graph:
      x -> matmul(up, transpose=NT) -> h
      h -> matmul(down, transpose=NT) -> out
''')
    errors = _tp2_errors(source, "Conflict")
    assert errors and errors[0].code == "E008"
    assert "a column-sharded value (`%2`) is an output of `Conflict`: a row-sharded matmul " \
        "must reduce it first" in errors[0].message


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_each_rank_loads_its_slice_of_an_hf_checkpoint(name, tmp_path):
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params

    whole = tp_workers.tiny_model(name)
    # the fused parameters' part sizes are the shards' parts (q, k, v rows; gate, up)
    schema = tp_workers.tiny_model(name, 2).source.program(planned=False).weight_schema
    whole.hf_layout = {e["param"]: e["shard"]["parts"] for e in schema
                       if e.get("shard") and len(e["shard"]["parts"]) > 1}
    whole.save_hf(tmp_path)
    path, settings = TINY[name]
    settings = {k: str(v) for k, v in settings.items()}
    full = Model.from_module(path, settings=settings, dtype=torch.float64,
                             hf_weights=tmp_path).hf_tensors()
    for rank in range(2):
        model = Model.from_module(path, settings=settings, dtype=torch.float64,
                                  tensor_parallel=2, tp_rank=rank, hf_weights=tmp_path)
        want = shard_params(whole.params, model.source.program(planned=False), rank)
        assert set(model.params) == set(want)
        for key, value in want.items():
            assert torch.equal(model.params[key], value), key
        # its HF export is its slice of each HF tensor (q_proj: its heads' rows)
        exported = model.hf_tensors()
        q = "model.layers.0.self_attn.q_proj.weight"
        rows = exported[q].shape[0]
        assert torch.equal(exported[q], full[q][rank * rows:(rank + 1) * rows])


def test_a_shape_not_written_over_the_local_part_is_an_error(tmp_path):
    source = tmp_path / "global.module"
    source.write_text('''module Global(d: int = 8, f: int = 16):
  params:
    up: [f, d] @shard(column)
    down: [d, f] @shard(row)

  forward:
    in: x: [B, d]
    out: [B, d]

    graph:
      x -> matmul(up, transpose=NT) -> h
      h -> matmul(down, transpose=NT) -> out
''')
    errors = _tp2_errors(source, "Global")
    assert errors and errors[0].code == "E008"
    assert "`up`: dim 0 (f) does not depend on `tp_size`" in errors[0].message


def test_tp_on_a_model_without_sharded_parameters_is_an_error():
    result = build(BuildRequest(ROOT / "examples/mamba.module", shapes={"B": 2, "T": 6},
                                settings=dict(n_layers="2", d_model="32", vocab_size="64",
                                              d_state="8", head_dim="8"),
                                tensor_parallel=2))
    errors = [d for d in result.diagnostics if d.is_error]
    assert errors and "nothing to split" in errors[0].message


def _tp2_errors(source, model: str) -> list:
    """The errors of building `model` of `source` for tensor parallel 2."""
    result = build(BuildRequest(source, model=model, shapes={"B": 2}, tensor_parallel=2))
    return [d for d in result.diagnostics if d.is_error]


def test_the_verifier_rederives_the_vocab_parallel_types():
    """A document that says the vocab-parallel lookup gives the table's whole width, or
    the split head gives the whole vocabulary, is refused."""
    from dataclasses import replace

    from modulec.ir.verify import verify_graph

    graph = tp_build("llama", 2).graph
    entry = graph.function(graph.entry)
    lookup, logits = entry.nodes[0].outputs[0], entry.outputs[0]
    lies = {lookup: ("2", "6", "64"), logits: ("2", "6", "64")}
    values = tuple(replace(v, shape=lies.get(v.id, v.shape)) for v in entry.values)
    lied = replace(graph, functions=tuple(replace(f, values=values) if f is entry else f
                                          for f in graph.functions))
    problems = "\n".join(verify_graph(lied))
    assert "vocab_parallel_embedding gives [2, 6, 32" in problems, problems
    assert "matmul(transpose=NT) gives [2, 6, 32" in problems, problems
