"""`modulec build` and `modulec plan` with --dp / --zero / --tp / --pp / --microbatches
(issue 17): the sections they write and print, and bad settings as clear errors."""

import json

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.paths import REPO_DIR

LLAMA = str(REPO_DIR / "examples" / "llama.module")  # TinyLlama
PIPELINED = str(REPO_DIR / "tests" / "data" / "pipeline_llama.module")
TINY = ["--shape", "B=2", "--shape", "T=8"]


def run(*args):
    return CliRunner().invoke(modulec, [str(a) for a in args])


def test_build_writes_the_distributed_section(tmp_path):
    out = tmp_path / "model.ir"
    result = run("build", PIPELINED, *TINY, "--dp", 2, "--zero", 3, "-o", out)
    assert result.exit_code == 0, result.output
    schedule = json.loads(out.read_text())["schedule"]
    assert schedule["distributed"]["mesh"] == {"dp": 2, "tp": 1, "pp": 2}
    assert schedule["distributed"]["zero"] == 3
    assert len(schedule["pipeline"]["stages"]) == 2
    assert run("ir", "verify", out).exit_code == 0


def test_zero_defaults_to_two_and_needs_dp(tmp_path):
    out = tmp_path / "model.ir"
    assert run("build", LLAMA, *TINY, "--dp", 2, "-o", out).exit_code == 0
    assert json.loads(out.read_text())["schedule"]["distributed"]["zero"] == 2
    result = run("build", LLAMA, *TINY, "--zero", 1)
    assert result.exit_code == 2 and "--zero needs --dp N" in result.output


@pytest.mark.parametrize("args, message", [
    (["--dp", 2, "--zero", 4], "'--zero': `4`: expected a ZeRO stage 0, 1, 2 or 3, or auto"),
    (["--dp", 0], "'--dp': 0 is not in the range x>=1"),
    (["--pp", 0], "'--pp': 0 is not in the range x>=1"),
    (["--microbatches", 0], "'--microbatches': 0 is not in the range x>=1"),
    (["--dp", 1, "--zero", 1, "--pp", 2], "--zero 1 with --pp shards each stage's optimizer "
                                          "state over --dp N > 1 pipelines"),
])
def test_bad_settings_are_usage_errors(args, message):
    result = run("build", LLAMA, *TINY, *args)
    assert result.exit_code == 2 and message in result.output


def test_tp_must_divide_the_heads():
    result = run("build", LLAMA, *TINY, "--tp", 3)
    assert result.exit_code == 1
    # each sharded parameter whose dim does not split is named with the dim and its value
    assert "`qkv_weight` cannot split across tp_size 3: dim 0 part `num_heads` = 32 is not " \
        "divisible by tp_size 3" in result.output
    assert "`up_weight` cannot split across tp_size 3: dim 0 part `d_ff` = " in result.output


def test_pipeline_settings_against_the_model_are_errors():
    result = run("build", PIPELINED, *TINY, "--pp", 3)
    assert result.exit_code == 1
    assert "`--pp 3` but the model's @partition annotations make 2 stages" in result.output
    result = run("build", LLAMA, *TINY, "--pp", 40)
    assert result.exit_code == 1 and "40 pipeline stages, but the forward has only" in \
        result.output


def test_emit_schedule_prints_both_sections():
    result = run("build", PIPELINED, *TINY, "--dp", 2, "--zero", 2, "--microbatches", 4,
                 "--emit", "schedule")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "distributed (dp 2 x tp 1 x pp 2, ZeRO-2" in text
    assert "  op gradients_ready s2  reduce_scatter what gradients" in text
    assert "pipeline (2 stages, 4 micro-batches, 1f1b, partition split; mesh dp 2 x pp 2 " \
        "x tp 1) {" in text
    # the two pipelines' gradients: one all-reduce per bucket (a layer, an entry
    # parameter) over each stage's data-parallel group, after its last backward
    assert "  ops 0: F0 a0>1 | F1 a1>1 g0<1 B0 F2 a2>1 g1<1 B1 F3 a3>1 g2<1 B2 | g3<1 B3 " \
        "| AR0 AR1 AR2" in text
    assert "    bucket 0 blocks[1]  numel 7744: blocks[1].ln1.weight +0:32, " in text
    # the blocks carry the compute dtype (`float`: bf16 on the GPU, the plan counts 2 bytes)
    assert "  boundary 0 -> 1: %3 [2, 8, 32] float, %4 [2, 8, 32] float" in text


def test_emit_pipeline_prints_the_simulated_timeline():
    result = run("build", LLAMA, "--shape", "B=1", "--shape", "T=2048", "--pp", 2,
                 "--microbatches", 8, "--emit", "pipeline")
    assert result.exit_code == 0, result.output
    assert "2 stages (balanced split), 8 micro-batches, 1F1B" in result.output
    assert "simulated step:" in result.output and "bubble" in result.output
    assert result.output.count("stage 0 |") == 1
    assert "`torchrun --nproc-per-node 2 -m modulec train --pp 2` runs it" in result.output


def test_plan_dp_zero3_prints_the_per_gpu_prediction():
    result = run("plan", LLAMA, "--shape", "B=4", "--shape", "T=2048", "--dp", 2, "--zero", 3,
                 "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["data_parallel"]
    one, rank = report["one_gpu"], report["per_rank"]
    assert (report["dp"], report["zero"]) == (2, 3)
    # moments, low halves and compute weights are sharded two ways (the entry's too:
    # gathered into buffers in the step), beside them the two gather slots
    assert rank["optimizer_state"] == pytest.approx(one["optimizer_state"] / 2, rel=0.01)
    assert rank["weights"] == pytest.approx(one["weights"] / 2, rel=0.01)
    assert rank["gather_slots"] > 0
    assert rank["activations"] == one["activations"] > 0
    assert rank["total"] < 0.6 * one["total"]
    text = run("plan", LLAMA, "--shape", "B=4", "--shape", "T=2048", "--dp", 2, "--zero", 3)
    assert "per-GPU memory: TinyLlama, data parallel 2 ranks, ZeRO-3" in text.output
    # the model state halves; the slots (two layers' gradients and gathered weights, the
    # LM head's and embedding's gradients in one shared slot) are not sharded
    assert rank["model_state"] == rank["weights"] + rank["optimizer_state"]
    # derived from TinyLlama's published sizes, not copied from the output: 1,100,048,384
    # parameters, a layer's 44,044,288, the vocabulary's 32000 x 2048; model state 12 B a
    # parameter (bf16 weight 2 + the master's low half 2 + two fp32 moments 8)
    params, layer, vocab, d = 1_100_048_384, 44_044_288, 32000 * 2048, 2048
    assert one["model_state"] == 12 * params and rank["model_state"] == 6 * params
    # bf16 slots: two layers' gradients, the head's and embedding's one shared slot, the
    # final norm's; two layers' gathered weights
    assert rank["gradient_buffers"] == one["gradient_buffers"] == 2 * (2 * layer + vocab + d)
    assert rank["gather_slots"] == 2 * 2 * layer
    fixed = 6 * params + 2 * (2 * layer + vocab + d) + 2 * 2 * layer
    assert rank["total"] == fixed and one["total"] == 12 * params + one["gradient_buffers"]
    gib = lambda count: f"{count / 2 ** 30:.2f} GiB"  # noqa: E731
    assert (f"model state per GPU: {gib(6 * params)} against {gib(12 * params)} on one GPU "
            "(0.50x)") in text.output
    assert f"fixed state {gib(fixed)} against {gib(one['total'])}" in text.output


def test_plan_zero0_holds_as_much_as_one_gpu_plus_buffers():
    result = run("plan", LLAMA, *TINY, "--dp", 4, "--zero", 0, "--format", "json")
    report = json.loads(result.output)["data_parallel"]
    assert report["per_rank"]["weights"] == report["one_gpu"]["weights"]
    assert report["per_rank"]["optimizer_state"] == report["one_gpu"]["optimizer_state"]


def test_plan_pp_prints_the_timeline_as_json():
    result = run("plan", PIPELINED, *TINY, "--microbatches", 8, "--format", "json")
    assert result.exit_code == 0, result.output
    # diagnostics come first, one JSON line each (W006: no runtime runs a pipeline yet)
    pipeline = json.loads(result.output.splitlines()[-1])["pipeline"]
    assert pipeline["microbatches"] == 8 and len(pipeline["stages"]) == 2
    assert 0 < pipeline["bubble_fraction"] < 1
    assert pipeline["ideal_bubble_fraction"] == pytest.approx(1 / 9)
    assert [row["in_flight"] for row in pipeline["memory"]] == [2, 1]


def test_pp_needs_every_size_but_partition_alone_builds_without():
    result = run("build", PIPELINED, "--pp", 2)
    assert result.exit_code == 1 and "the pipeline needs every size" in result.output
    assert run("build", PIPELINED).exit_code == 0  # no sizes: no pipeline section


def test_emit_pipeline_without_sizes_is_a_usage_error():
    result = run("build", LLAMA, "--emit", "pipeline")
    assert result.exit_code == 2 and "--emit pipeline: `" in result.output
    assert "give the free dims sizes with --shape" in result.output


def _auto(budget: str) -> tuple[str, dict]:
    result = run("plan", LLAMA, "--shape", "B=1", "--shape", "T=256", "--dp", 2,
                 "--zero", "auto", "--memory-budget", budget, "--format", "json")
    assert result.exit_code == 0, result.output
    note = next(line for line in result.stderr.splitlines() if line.startswith("note:"))
    return note, json.loads(result.stdout)


def test_zero_auto_takes_zero3_when_only_its_state_fits_the_budget():
    """TinyLlama on 2 ranks holds 7.6 GiB of fixed state with ZeRO-2, 6.7 with ZeRO-3 (7.0
    with its entry buffers at the peak): a 7.3 GiB budget fits ZeRO-3 alone, and the plan
    counts that rank's state as fixed."""
    note, plan = _auto("7.3GiB")
    assert note.startswith("note: ZeRO-3 chosen: ZeRO-2's lowest predicted peak")
    assert plan["feasible"] and plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    fixed = plan["fixed_bytes"]
    assert fixed["gather_slots"] > 0  # the rank's ZeRO-3 state, not one GPU's fp32 state
    assert fixed["entry_buffers"] > 0  # the head's and final norm's gathered weights
    assert sum(fixed.values()) < 7.3 * 2 ** 30


def test_zero_auto_keeps_zero2_when_it_fits():
    note, plan = _auto("20GiB")
    assert note.startswith("note: ZeRO-2 chosen: it fits 20.00 GiB")
    assert plan["fixed_bytes"]["gather_slots"] == 0


def test_zero_auto_needs_a_budget():
    result = run("build", LLAMA, *TINY, "--dp", 2, "--zero", "auto")
    assert result.exit_code == 2 and "--zero auto chooses the stage that fits" in result.output


def test_plan_tp_counts_one_ranks_slices_of_the_vocabulary_too():
    """std Llama under --tp 2: every matrix is split, the embedding and LM head too
    (`@shard(vocab)`), so the plan's weights drop by half of all the matrices' bytes;
    the norms (and fixed buffers) stay whole."""
    def regions(tp: int) -> dict:
        result = run("plan", REPO_DIR / "std" / "models" / "llama.module", "--set", "n_layers=2",
                     "--set", "d_model=32", "--set", "num_heads=4", "--set", "num_kv_heads=2",
                     "--set", "d_ff=48", "--set", "vocab_size=64", "--shape", "B=2",
                     "--shape", "T=6", "--tp", tp, "--format", "json")
        assert result.exit_code == 0, result.output
        return {r["region"]: r["arena_bytes"] for r in json.loads(result.output)["regions"]}

    one, two = regions(1), regions(2)
    table = 64 * 32  # embedding and lm_head, each [vocab, d_model]
    layer = (32 + 16 + 16) * 32 + 32 * 32 + 2 * 48 * 32 + 32 * 48  # qkv, o, gate/up, down
    split = 2 * table + 2 * layer  # elements; half of them leave each rank
    assert one["weights"] - two["weights"] == split // 2 * 2  # bf16 compute copies
    assert one["optimizer_state"] - two["optimizer_state"] == split // 2 * 12  # fp32 x 3
