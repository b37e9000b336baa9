"""Budget planning: the cost model, the peak / overhead simulation, MuTWO's scheduler and
`modulec plan --memory-budget` (modulec.plan.budget and its parts)."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.budget import make_problem, no_recompute, parse_size, plan_budget, summary
from modulec.plan.cost import (Cost, Values, attention_scale, node_cost, step_seconds,
                               value_table)
from modulec.plan.devices import H100, H200
from modulec.plan.from_graph import plan_step
from modulec.plan.mutwo import prefix
from modulec.plan.recompute import declarations
from modulec.plan.simulate import SwapItem, swap_schedule

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
SMALL = {"d_model": "256", "num_heads": "4", "num_kv_heads": "2", "d_ff": "512",
         "vocab_size": "1000", "n_layers": "4"}
GIB = 2 ** 30


@pytest.fixture(scope="module")
def graph():
    # T=128: at T=64 the lowest peak is the MLP backward's transient (its activation's
    # backward holds d_hidden, d_gate_up and the hidden it returns at once), which no
    # keep / recompute / swap decision lowers, so the lowest plan needs no recompute
    return build(BuildRequest(LLAMA, settings=SMALL, shapes={"B": 2, "T": 128})).graph


@pytest.fixture(scope="module")
def problem(graph):
    return make_problem(graph, declarations(LLAMA), "lora")


@pytest.fixture(scope="module")
def lowest(problem):
    return plan_budget(problem, 0)


# ====================================================================== sizes and costs
@pytest.mark.parametrize("text, size", [("20GiB", 20 * GIB), ("512MiB", 512 * 2 ** 20),
                                        ("80GB", 80 * 10 ** 9), ("1.5 TiB", int(1.5 * 2 ** 40)),
                                        ("4096", 4096), ("2kb", 2000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "20 parsecs", "-1GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def values(**shapes) -> Values:
    return Values({k: ValueInfo(k, tuple(str(d) for d in v), "bf16") for k, v in shapes.items()},
                  frozenset())


def test_matmul_flops_fold_leading_dims_and_transposes():
    table = values(x=(2, 8, 64), w=(32, 64), y=(2, 8, 32), dy=(2, 8, 32))
    forward = node_cost(table, Node("f0", "op", "matmul", ("x", "w"), ("y",),
                                    (("transpose", "NT"),)))
    assert forward.flops == 2 * 16 * 32 * 64
    backward = Node("b0", "op", "matmul_backward", ("dy", "x", "w"), ("dx", "dw"),
                    (("transpose", "NT"),))
    assert node_cost(table, backward).flops == 2 * forward.flops
    assert node_cost(table, backward, "lora").flops == forward.flops  # frozen: no d_W
    tn = values(a=(64, 16), w=(64, 32), y=(16, 32))
    assert node_cost(tn, Node("f0", "op", "matmul", ("a", "w"), ("y",),
                              (("transpose", "TN"),))).flops == 2 * 16 * 32 * 64


def test_attention_flops_causal_half_and_backward():
    table = values(q=(1, 8, 128, 64), k=(1, 2, 128, 64), v=(1, 2, 128, 64), o=(1, 8, 128, 64))
    full = node_cost(table, Node("f0", "op", "flash_attention", ("q", "k", "v"), ("o",),
                                 (("causal", False),)))
    causal = node_cost(table, Node("f0", "op", "flash_attention", ("q", "k", "v"), ("o",),
                                   (("causal", True),)))
    assert full.flops == 4 * 8 * 128 * 128 * 64 and causal.flops == full.flops / 2
    back = node_cost(table, Node("b0", "op", "flash_attention_backward",
                                 ("o", "q", "k", "v"), (), (("causal", True),)))
    assert back.flops == 2.5 * causal.flops and back.kind == "attention_backward"


def test_views_are_free_and_elementwise_ops_move_bytes():
    table = values(x=(4, 256), y=(4, 256))
    assert node_cost(table, Node("f0", "op", "transpose", ("x",), ("y",))) == Cost()
    silu = node_cost(table, Node("f0", "op", "silu", ("x",), ("y",)))
    assert (silu.flops, silu.bytes) == (0, 2 * 4 * 256 * 2)
    assert silu.seconds(H200) == pytest.approx(silu.bytes / (4.8e12 * 0.8))
    assert Cost(1e12, 0).seconds(H100) == pytest.approx(1 / (989 * 0.78))
    # a GEMM in whole waves of 256 x 128 tiles over 132 SMs: 264 tiles are 2 full waves,
    # 265 a third wave for one tile
    full = 2 * (264 * 256 * 128) * 1024
    assert Cost(full, 0, gemms=((264 * 256, 128, 1024),)).seconds(H100) == pytest.approx(
        full / (989e12 * 0.78))
    assert Cost(full, 0, gemms=((265 * 256, 128, 1024),)).seconds(H100) == pytest.approx(
        1.5 * full / (989e12 * 0.78))
    assert Cost(1e12, 0, "attention").seconds(H100) == pytest.approx(1 / (989 * 0.54))
    rope = node_cost(table, Node("f0", "op", "rope", ("x",), ("y",)))
    assert rope.seconds(H200) == pytest.approx(rope.bytes / (4.8e12 * 0.35))


def test_weight_gradient_counts_every_leading_row():
    """d_W = d_y^T x contracts over B and T both: 2 * B * T * N * K (a `TN` matmul)."""
    table = values(dy=(2, 8, 32), x=(2, 8, 64), dw=(32, 64))
    cost = node_cost(table, Node("b0", "op", "matmul", ("dy", "x"), ("dw",),
                                 (("transpose", "TN"),)))
    assert cost.flops == 2 * 2 * 8 * 32 * 64 and cost.gemms == ((32, 64, 16),)


def test_attention_rate_scales_with_head_dim_and_keys():
    assert attention_scale(128, 2048) == pytest.approx(1.0)
    assert attention_scale(128, 8192) == pytest.approx(1.0)  # no faster than measured
    assert attention_scale(64, 1024) == pytest.approx(0.356 / 0.54, rel=0.02)  # TinyLlama
    assert attention_scale(128, 1024) == pytest.approx(429 / 530, rel=0.02)  # 8B, T 2048


def test_concat_of_parts_made_for_it_is_free():
    x, y = ValueInfo("x", ("4", "8"), "bf16"), ValueInfo("y", ("4", "8"), "bf16")
    nodes = [Node("n0", "op", "silu", ("a",), ("x",)), Node("n1", "op", "silu", ("a",), ("y",)),
             Node("n2", "op", "concat", ("x", "y"), ("z",), (("dim", -1),))]
    joined = Function("f", "F", "", (), (), (ValueInfo("a", ("4", "8"), "bf16"),), ("z",),
                      (x, y), tuple(nodes))
    assert node_cost(value_table(Graph("m", "f", ""), joined), nodes[2]) == Cost()
    saved = replace(joined, saved=("x",))  # the backward reads x: a buffer of its own
    assert node_cost(value_table(Graph("m", "f", ""), saved), nodes[2]).bytes > 0
    shared = replace(joined, nodes=tuple(nodes) + (Node("n3", "op", "silu", ("x",), ("w",)),))
    assert node_cost(value_table(Graph("m", "f", ""), shared), nodes[2]).bytes > 0


def test_step_time_and_devices(graph):
    h100, h200 = step_seconds(graph, H100), step_seconds(graph, H200)
    assert 0 < h200["step_s"] < h100["step_s"]  # more HBM bandwidth, same FLOP/s
    assert step_seconds(graph, H100, "lora")["backward_s"] < h100["backward_s"]


# ====================================================================== simulation
def test_keeping_everything_is_the_memory_plan(graph):
    for training in ("full", "lora"):
        problem = make_problem(graph, None, training)
        plan = plan_step(graph)
        peak = no_recompute(problem).peak_bytes
        if training == "full":
            assert peak == plan.summary()["arena_bytes"]
        assert peak - sum(problem.fixed_bytes.values()) == plan.summary()["arena_bytes"] - sum(
            plan.regions[r].arena for r in ("weights", "gradients", "optimizer_state"))


def test_swap_schedule_hides_or_stalls():
    link = 1e9
    hidden = SwapItem("a", 0, 10 ** 6, 0.0, 0.001, 1.0, 1.1)
    assert swap_schedule([hidden], 0.5, link)[0] == 0
    late = SwapItem("b", 1, 10 ** 8, 0.0, 0.49, 0.51, 0.6)  # 0.1 s out, 0.1 s in
    stall, times = swap_schedule([late], 0.5, link)
    assert stall == pytest.approx(0.59 + 0.1 - 0.51) and times["b"][0] == pytest.approx(0.59)


# ====================================================================== the scheduler
def test_sweep_is_feasible_monotone_and_under_budget(problem, lowest):
    top, bottom = no_recompute(problem).peak_bytes, lowest.minimum_peak
    assert bottom < top
    overheads = []
    for i in range(8):
        budget = round(top - (top - bottom) * i / 7)
        result = plan_budget(problem, budget)
        assert result.feasible and result.outcome.peak_bytes <= budget
        overheads.append(result.outcome.overhead_s)
        again = prefix(problem, lowest, budget)  # a larger budget stops the same loop sooner
        assert (again.recompute, again.swap) == (result.recompute, result.swap)
    assert overheads[0] == 0 < overheads[-1]


def test_infeasible_budget_names_the_lowest_peak(problem, lowest):
    result = plan_budget(problem, lowest.minimum_peak - 1)
    assert not result.feasible and result.minimum_peak == lowest.minimum_peak
    data = summary(problem, result)
    assert data["feasible"] is False and data["minimum_peak_bytes"] > data["budget_bytes"]


def test_planning_is_deterministic(graph, problem):
    budget = (no_recompute(problem).peak_bytes + plan_budget(problem, 0).minimum_peak) // 2
    first = summary(problem, plan_budget(problem, budget))
    again = make_problem(graph, declarations(LLAMA), "lora")
    assert json.dumps(first, sort_keys=True) == \
        json.dumps(summary(again, plan_budget(again, budget)), sort_keys=True)


def test_overhead_counts_recompute_and_stalls(problem, lowest):
    outcome = lowest.outcome
    assert outcome.overhead_s == pytest.approx(outcome.recompute_s + outcome.stall_s)
    assert outcome.recompute_s > 0 and lowest.recompute


# ====================================================================== the command
def plan_cli(*extra):
    return CliRunner().invoke(modulec, ["plan", str(LLAMA), "--shape", "B=2", "--shape", "T=64",
                                        *(f"--set={k}={v}" for k, v in SMALL.items()), *extra])


def test_cli_budget_json():
    result = plan_cli("--memory-budget", "60MiB", "--format", "json", "--training", "lora")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"predicted_peak_bytes", "predicted_overhead_s", "budget_bytes", "feasible",
            "decisions"} <= set(data)
    assert data["feasible"] and data["predicted_peak_bytes"] <= data["budget_bytes"] == 60 * 2**20
    assert {"keep", "recompute", "swap", "by_tensor"} <= set(data["decisions"])


def test_cli_budget_text_and_infeasible():
    ok = plan_cli("--memory-budget", "60MiB", "--training", "lora", "--device", "h200")
    assert ok.exit_code == 0 and "predicted peak" in ok.output and "overhead" in ok.output
    bad = plan_cli("--memory-budget", "1MiB")
    assert bad.exit_code == 1 and "cannot be met" in bad.output
    assert "Traceback" not in bad.output and "internal compiler error" not in bad.output


def test_cli_rejects_bad_sizes_and_policies():
    assert plan_cli("--memory-budget", "lots").exit_code == 2
    assert plan_cli("--memory-budget", "1GiB", "--recompute-policy", "x=sometimes").exit_code == 2
    assert plan_cli("--memory-budget", "1GiB", "--recompute-policy", "doc").exit_code == 0


def test_planning_does_not_depend_on_hash_seeds(tmp_path):
    import os
    import subprocess
    import sys

    outputs = []
    for seed in ("1", "2"):
        args = [sys.executable, "-m", "modulec", "plan", str(LLAMA), "--format", "json",
                "--shape", "B=2", "--shape", "T=64", "--memory-budget", "60MiB",
                "--training", "lora", *(f"--set={k}={v}" for k, v in SMALL.items())]
        done = subprocess.run(args, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] and json.loads(outputs[0])["feasible"]
