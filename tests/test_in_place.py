"""In-place ops (modulec/plan/in_place.py): RoPE rotates q and k inside the fused QKV
projection output where nothing reads them afterwards; the memory plan, the budget
planner's timeline and the GPU step share that decision."""

from __future__ import annotations

from dataclasses import replace

from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.budget import make_problem
from modulec.plan.in_place import in_place_nodes
from modulec.plan.timeline import flatten
from modulec.plan.devices import H100

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
SMALL = {"d_model": "256", "num_heads": "4", "num_kv_heads": "2", "d_ff": "512",
         "vocab_size": "1000", "n_layers": "2"}


def llama_graph():
    return build(BuildRequest(LLAMA, settings=SMALL, shapes={"B": 2, "T": 64})).graph


def attention(graph):
    return next(f for f in graph.functions
                if f.module == "CausalSelfAttention" and not f.gradient_of)


def rope_node(function):
    return next(n for n in function.nodes if n.target == "rope")


def test_llama_rope_runs_in_place():
    graph = llama_graph()
    function = attention(graph)
    assert in_place_nodes(graph, function) == {rope_node(function).id}


def test_rope_whose_input_is_read_again_does_not_run_in_place():
    graph = llama_graph()
    function = attention(graph)
    q = rope_node(function).inputs[0]
    kept = replace(function, outputs=function.outputs + (q,))  # q read after the rope
    graph = replace(graph, functions=tuple(kept if f.name == function.name else f
                                           for f in graph.functions))
    assert in_place_nodes(graph, kept) == frozenset()


def test_no_backward_function_runs_in_place():
    graph = llama_graph()
    assert all(not in_place_nodes(graph, f) for f in graph.functions if f.gradient_of)


def test_rotated_q_and_k_share_the_qkv_storage_which_is_never_recomputed():
    graph = llama_graph()
    step = flatten(graph, H100)
    written = [s for s in step.storages.values() if s.in_place]
    assert len(written) == int(SMALL["n_layers"])  # one QKV projection output a layer
    for storage in written:
        assert {"q_rot", "k_rot"} <= set(storage.names)
    problem = make_problem(graph, None)
    assert all(not problem.intents.by_storage[s.key].recomputable for s in written)
