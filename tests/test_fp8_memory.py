"""What the GPU step's FP8 recipe holds beside the memory plan (modulec.plan.fp8_memory;
decisions.md, "FP8 on the GPU", "What the FP8 buffers cost"): the count for a tiny Llama
against a hand count from its shapes, `modulec plan --precision fp8` (with and without a
budget), and a budgeted build that must plan around them. The GPU check of the count
against torch.cuda.max_memory_allocated is tests/test_cuda_fp8_memory.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.lower.build import BuildRequest, build
from modulec.lower.build_plan import PlanOptions
from modulec.paths import REPO_DIR
from modulec.plan.budget import make_problem, no_recompute, plan_budget
from modulec.plan.fp8_memory import FP8_FIXED, fp8_memory

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
# d_model 32, 2 heads of 16 and 2 KV heads: q, k, v 32 rows each; d_ff 48
TINY = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "2",
        "num_kv_heads": "2", "d_ff": "48"}
B, T = 2, 16
D, FF, LAYERS, QKV = 32, 48, 2, 96


def built(derive_written: bool, precision="fp8", budget=None):
    request = BuildRequest(LLAMA, settings=dict(TINY), shapes={"B": B, "T": T},
                           derive_written=derive_written)
    request.precision = precision
    if budget is not None:
        request.planning = PlanOptions(budget=budget, device="h200-noswap")
    result = build(request)
    assert result.graph is not None, [d.message for d in result.diagnostics]
    return result


@pytest.fixture(scope="module")
def written():
    return built(False)


def test_the_count_is_a_hand_count_of_the_shapes(written):
    """Per layer: each covered weight in two layouts (forward x W^T reads W, the dgrad
    W^T); x^T of the forward inputs the backward reads as saved values; the largest cast
    buffers of one function; the histories."""
    rows = B * T
    weights = QKV * D + D * D + 2 * FF * D + D * FF  # qkv, out, gate+up, down
    m = fp8_memory(written.graph, written.document["metadata"]["precision"])
    assert m.weights == LAYERS * 2 * weights
    # std's written backwards: the attention's x and its output (the out projection's
    # input), the MLP's x; its hidden (the down projection's input) is made again
    assert m.held == LAYERS * 3 * rows * D
    # the attention backward's d(qkv), both layouts (dgrad plain, wgrad transposed), x^T
    # held; without it held, x^T cast there too
    assert m.transient == 2 * rows * QKV
    assert m.transient_recast == 2 * rows * QKV + rows * D
    # a row per operand key at most: 4 forward matmuls and 8 written backward ones a layer,
    # 2 operands each, 48 rows -> 64 allocated; history 16 + pending + window, fp32
    assert m.scales == 64 * (16 + 2) * 4
    assert m.outside_plan(True) == m.weights + m.held + m.transient + m.scales
    assert m.outside_plan(False) == m.weights + m.transient_recast + m.scales


def test_the_derived_backward_holds_the_down_projection_input_too():
    result = built(True)
    m = fp8_memory(result.graph, result.document["metadata"]["precision"])
    assert m.held == LAYERS * (3 * D + FF) * B * T
    assert m.weights == LAYERS * 2 * (QKV * D + D * D + 3 * FF * D)


def test_no_recipe_counts_nothing():
    result = built(False, precision=None)
    assert "precision" not in result.document["metadata"]
    assert fp8_memory(result.graph, None).outside_plan(True) == 0
    problem = make_problem(result.graph, precision=None)
    assert FP8_FIXED not in problem.fixed_bytes


def test_the_planner_problem_counts_them(written):
    section = written.document["metadata"]["precision"]
    plain, fp8 = (make_problem(written.graph, precision=s, fp8_held=True)
                  for s in (None, section))
    extra = fp8_memory(written.graph, section).outside_plan(True)
    assert fp8.fixed_bytes[FP8_FIXED] == extra
    assert no_recompute(fp8).peak_bytes == no_recompute(plain).peak_bytes + extra


def plan_json(*extra):
    args = ["plan", str(LLAMA), "--format", "json", "--shape", f"B={B}", "--shape", f"T={T}"]
    for k, v in TINY.items():
        args += ["--set", f"{k}={v}"]
    out = CliRunner().invoke(modulec, args + list(extra))
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_plan_with_precision_prints_the_fp8_buffers(written):
    plain, fp8 = plan_json(), plan_json("--precision", "fp8")
    assert "fp8_buffers" not in plain
    m = fp8_memory(written.graph, written.document["metadata"]["precision"])
    assert fp8["fp8_buffers"]["total_bytes"] == m.outside_plan(True) > 0
    assert fp8["arena_bytes"] == plain["arena_bytes"]
    args = ["plan", str(LLAMA), "--shape", f"B={B}", "--shape", f"T={T}", "--precision", "fp8"]
    text = CliRunner().invoke(modulec, args + [a for k, v in TINY.items()
                                               for a in ("--set", f"{k}={v}")])
    assert text.exit_code == 0 and "FP8 buffers beside the plan" in text.stdout


def test_plan_budget_counts_them_without_the_kept_transposes(written):
    """Under a budget the GPU step keeps no wgrad x^T (fp8_step.Casts.keep_transposed)."""
    plain, fp8 = (plan_json("--memory-budget", "1GiB", *extra)
                  for extra in ((), ("--precision", "fp8")))
    m = fp8_memory(written.graph, written.document["metadata"]["precision"])
    assert fp8["fixed_bytes"][FP8_FIXED] == m.outside_plan(False)
    assert fp8["predicted_peak_bytes"] == plain["predicted_peak_bytes"] + m.outside_plan(False)


def test_plan_refuses_precision_with_data_parallel():
    args = ["plan", str(LLAMA), "--shape", "B=2", "--shape", "T=16", "--precision", "fp8",
            "--dp", "2"]
    out = CliRunner().invoke(modulec, args)
    assert out.exit_code == 2 and "not counted yet" in out.output


def test_a_budgeted_build_plans_around_them(written):
    """A budget the bf16 plan meets keeping everything: with the recipe's buffers the
    build must recompute to meet it."""
    section = written.document["metadata"]["precision"]
    problem = make_problem(written.graph)
    lowest, keep_all = plan_budget(problem, 0).minimum_peak, no_recompute(problem).peak_bytes
    extra = fp8_memory(written.graph, section).outside_plan(False)
    low = max(keep_all, lowest + extra)  # the bf16 plan keeps all, the FP8 one can fit
    assert low < keep_all + extra
    budget = (low + keep_all + extra) // 2
    plain, fp8 = built(False, None, budget), built(False, "fp8", budget)
    replays = [[op for ops in r.document["schedule"]["functions"].values() for op in ops
                if op.get("kind") == "recompute"] for r in (plain, fp8)]
    assert not replays[0] and replays[1]


def test_a_budget_below_them_says_so():
    request = BuildRequest(LLAMA, settings=dict(TINY), shapes={"B": B, "T": T},
                           precision="fp8", planning=PlanOptions(budget=1000,
                                                                 device="h200-noswap"))
    result = build(request)
    assert result.graph is None and "with the FP8 step's buffers" in result.failure
