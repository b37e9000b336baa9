"""The memory plan of a training step, from the std models' Graph IR (`modulec plan`)."""

import json

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.from_graph import plan_step

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
SMALL = {"d_model": "256", "num_heads": "4", "num_kv_heads": "2", "d_ff": "512",
         "vocab_size": "1000"}


def summary(layers: int, name: str = "llama", **shapes):
    request = BuildRequest(REPO_DIR / "std" / "models" / f"{name}.module",
                           settings={**SMALL, "n_layers": str(layers)},
                           shapes=shapes or {"B": 2, "T": 64})
    return plan_step(build(request).graph).summary()


def region(data, name):
    return next(r for r in data["regions"] if r["region"] == name)


def test_plan_is_ordered_and_valid():
    data = summary(2)
    for r in data["regions"]:
        assert r["lower_bound_bytes"] <= r["arena_bytes"] <= r["naive_bytes"]
        assert r["arena_bytes"] <= r["exact_size_reuse_bytes"]


def test_parameters_count_their_bytes():
    data = summary(2)
    d, f, v, layers = 256, 512, 1000, 2
    head = 64  # d_model // num_heads
    attention = (4 + 2 * 2) * head * d + d * d
    per_layer = attention + 3 * d * f + 2 * d
    params = 2 * v * d + d + layers * per_layer  # embedding, head, final norm, layers
    assert region(data, "weights")["arena_bytes"] >= 2 * params
    assert region(data, "weights")["arena_bytes"] <= 2 * params + 256 * 40  # alignment
    assert region(data, "optimizer_state")["arena_bytes"] == 12 * params


def test_layers_scale_saved_and_weights_but_not_transients():
    two, four = summary(2), summary(4)
    for key in ("arena_bytes", "lower_bound_bytes"):  # naive has no reuse: it grows
        assert region(four, "transient_activations")[key] == \
            region(two, "transient_activations")[key]
    grow = lambda name: region(four, name)["arena_bytes"] - region(two, name)["arena_bytes"]  # noqa
    assert grow("saved_activations") > 0 and grow("weights") > 0


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_models_with_polymorphic_submodules_plan(name):
    data = summary(2, name)  # MoE routers are typed in their own token dim N = B*T
    assert data["arena_bytes"] >= data["lower_bound_bytes"] > 0


def test_cli_json_and_missing_shape():
    runner = CliRunner()
    ok = runner.invoke(modulec, ["plan", str(LLAMA), "--format", "json", "--shape", "B=1",
                                 "--shape", "T=32", "--set", "n_layers=2"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert {"arena_bytes", "lower_bound_bytes", "naive_bytes"} <= set(data)
    missing = runner.invoke(modulec, ["plan", str(LLAMA), "--set", "n_layers=2"])
    assert missing.exit_code == 2 and "--shape" in missing.output


@pytest.mark.parametrize("example", ["llama", "qwen3", "mistral", "mixtral", "gpt2", "mamba"])
def test_every_example_builds_and_plans(example):
    request = BuildRequest(REPO_DIR / "examples" / f"{example}.module", shapes={"B": 1, "T": 16})
    result = build(request)
    assert result.graph is not None, [d.message for d in result.diagnostics]
    data = plan_step(result.graph).summary()
    assert data["arena_bytes"] >= data["lower_bound_bytes"] > 0


def _llama_plan(layers: int = 2):
    request = BuildRequest(LLAMA, settings={**SMALL, "n_layers": str(layers)},
                           shapes={"B": 2, "T": 64})
    graph = build(request).graph
    return graph, plan_step(graph)


def test_a_callees_results_live_in_its_callers_bytes():
    """The MLP's and attention's results (their own buffers) are handed: no bytes of the
    callee's frame; the entries hand nothing (their results are the step's)."""
    graph, plan = _llama_plan()
    mlp = next(f for f in graph.functions if f.name.startswith("SwiGLU_MLP") and
               not f.gradient_of)
    assert set(plan.handed[mlp.name]) == set(mlp.outputs)
    assert not set(mlp.outputs) & set(plan.placements[mlp.name])
    assert plan.handed[graph.entry] == {} and plan.handed[graph.backward] == {}


def test_a_repeated_call_holds_a_second_buffer_for_each_result_its_callee_does_not_save():
    """Each repetition of the block stack reads the previous one's results: the caller
    holds two buffers for each (the turn), the repetitions writing them in turn, except
    for a result the block saves (the next layer's saved input: it stays in the record)
    and for a twin (the block's backward returns one tensor for d_x and d_residual: the
    caller holds one buffer, and one turn, for both)."""
    from modulec.plan.from_graph import saved_values, turn_of

    graph, plan = _llama_plan()
    turns, twins = 0, 0
    for name in (graph.entry, graph.backward):
        for node in graph.function(name).nodes:
            if node.kind != "call" or int(node.repeat) < 2:
                continue
            callee = graph.function(node.target)
            kept, twin = saved_values(graph, callee), plan.twins.get(node.target, {})
            for k, value in enumerate(callee.outputs):
                own = value not in kept and k not in twin
                assert (turn_of(node.id, k) in plan.placements[name]) == own
                turns += own
            for k, source in twin.items():
                placed = plan.placements[name]
                assert placed[node.outputs[k]].block == placed[node.outputs[source]].block
                twins += 1
    assert turns >= 2 and twins == 1


@pytest.mark.parametrize("derived", [False, True])
def test_concats_are_planned_in_place(derived):
    """The parts of the MLP's and the attention's gradient concats (split's derived
    backward too) are views of the concat's output: one storage, no second buffer."""
    request = BuildRequest(LLAMA, settings={**SMALL, "n_layers": "2"},
                           shapes={"B": 2, "T": 64}, derive_written=derived)
    plan = plan_step(build(request).graph)
    joined = {name: parts for name, parts in plan.joins.items() if parts}
    assert sorted(n.split("#")[0] for n in joined) == ["CausalSelfAttention", "SwiGLU_MLP"]
    for name, parts in joined.items():
        placed = plan.placements[name]
        assert len(parts) in (2, 3)  # (d_gate, d_up); (d_q, d_k, d_v)
        for value, part in parts.items():
            assert placed[value].block == placed[part.concat].block == part.concat
