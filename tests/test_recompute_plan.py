"""Recompute intent (the §7.2.0 ladder, @checkpoint, policies per training mode) and replay
segments, on the Graph IR of small models (modulec.plan.recompute, modulec.plan.replay)."""

from pathlib import Path

import pytest

from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.budget import baseline, make_problem, plan_budget
from modulec.plan.recompute import DOC_POLICIES, KEEP, RECOMPUTE, declarations
from modulec.plan.simulate import evaluate

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
SMALL = {"d_model": "256", "num_heads": "4", "num_kv_heads": "2", "d_ff": "512",
         "vocab_size": "1000", "n_layers": "4"}

BLOCK = """block Tiny(d: int):
  \"\"\"x -> matmul -> h -> silu -> a -> matmul -> out.\"\"\"

  params:
    w1: [d, d]
    w2: [d, d]
{header}
  forward:
    in: x: [B, T, d]
    out: [B, T, d]

    graph:
      x -> matmul(w1, transpose=NT) -> h{h}
      h -> silu() -> a
      a -> matmul(w2, transpose=NT) -> out

    save: [x, a]

model M(d: int = 64, n: int = 3):
  \"\"\"A stack of Tiny blocks.\"\"\"

  params:
    blocks: [n] x Tiny(d)

  forward:
    in: x: [B, T, d]
    out: y: [B, T, d]

    graph:
      x -> StackedBlocks(blocks, n) -> y{flow}
"""


def tiny(tmp_path: Path, header: str = "", h: str = "", flow: str = "", **options):
    path = tmp_path / "tiny.module"
    path.write_text(BLOCK.format(header=header, h=h, flow=flow))
    result = build(BuildRequest(path, shapes={"B": 2, "T": 8}))
    assert result.graph is not None, [d.message for d in result.diagnostics]
    return make_problem(result.graph, declarations(path), **options)


def by_name(problem, name: str) -> list:
    """The intents of the storages named `name`, in instance order."""
    return [problem.intents.by_storage[k] for k in problem.step.saved()
            if name in problem.step.storages[k].names]


def llama(**options):
    graph = build(BuildRequest(LLAMA, settings=SMALL, shapes={"B": 2, "T": 64})).graph
    return make_problem(graph, declarations(LLAMA), **options)


# ====================================================================== the ladder
def test_memory_recompute_annotation_is_a_fixed_recompute(tmp_path):
    problem = tiny(tmp_path, h=" @memory(recompute)")
    assert [(i.kind, i.rung) for i in by_name(problem, "h")] == [(RECOMPUTE, 1)] * 3
    result = plan_budget(problem, 2 ** 40)  # any budget: annotations are honored
    recomputed = {k for k in result.recompute if "h" in problem.step.storages[k].names}
    assert len(recomputed) == 3 and result.feasible


def test_unannotated_storages_are_free_with_the_ladder_as_suggestion(tmp_path):
    problem = tiny(tmp_path)
    intents = by_name(problem, "a")
    assert all(i.kind is None and i.suggested == KEEP and i.rung == 4 for i in intents)
    assert all(i.kind is None for i in by_name(problem, "h"))


def test_memory_save_wins_over_block_checkpoint(tmp_path):
    problem = tiny(tmp_path, header="  @checkpoint\n", h=" @memory(save)")
    assert {(i.kind, i.rung) for i in by_name(problem, "h")} == {(KEEP, 1)}
    assert {(i.kind, i.rung) for i in by_name(problem, "a")} == {(RECOMPUTE, 3)}


def test_block_checkpoint_full_recomputes_inside_and_keeps_the_inputs(tmp_path):
    problem = tiny(tmp_path, header="  @checkpoint(full)\n")
    inside = [i for k, i in problem.intents.by_storage.items()
              if problem.step.storages[k].names != ["out"]]
    assert inside and all(i.kind == RECOMPUTE and i.rung == 3 for i in inside)
    # repetition k's input is repetition k-1's output: kept as the checkpoint boundary
    assert len(problem.intents.forced) == 2


def test_preserve_keeps_and_none_keeps_everything(tmp_path):
    kept = tiny(tmp_path, header="  @checkpoint(preserve=[a])\n")
    assert {(i.kind, i.rung) for i in by_name(kept, "a")} == {(KEEP, 2)}
    assert {i.kind for i in by_name(kept, "h")} == {RECOMPUTE}
    none = tiny(tmp_path, header="  @checkpoint(none)\n")
    assert {i.kind for i in none.intents.by_storage.values()} == {KEEP}
    selective = tiny(tmp_path, header="  @checkpoint(selective)\n")
    assert {i.kind for i in by_name(selective, "h")} == {None}


def test_checkpoint_on_a_flow_covers_the_calls(tmp_path):
    problem = tiny(tmp_path, flow=" @checkpoint")
    inside = [i for k, i in problem.intents.by_storage.items()]
    assert inside and {(i.kind, i.rung) for i in inside} == {(RECOMPUTE, 3)}


def test_honor_lists_fixes_the_module_lists():
    free = llama()
    fixed = llama(binding=5)
    # std's SwiGLU MLP lists gate and up (views of gate_up) under save: a suggestion
    # by default, a fixed keep when the lists bind
    gate_up = [k for k in free.step.saved() if "gate_up" in free.step.storages[k].names]
    assert gate_up
    assert all(free.intents.by_storage[k].kind is None for k in gate_up)
    assert all(free.intents.by_storage[k].suggested == KEEP for k in gate_up)
    assert all(fixed.intents.by_storage[k].kind == KEEP for k in gate_up)


# ====================================================================== policies
@pytest.mark.parametrize("training, allowed", [("full", False), ("lora", True)])
def test_lora_only_policy_depends_on_the_training_mode(tmp_path, training, allowed):
    problem = tiny(tmp_path, training=training, policies={"silu": "lora_only"})
    assert {(i.policy, i.recomputable) for i in by_name(problem, "a")} == \
        {("lora_only", allowed)}
    assert {i.recomputable for i in by_name(problem, "h")} == {True}


@pytest.mark.parametrize("training", ["full", "lora"])
def test_never_is_never_recomputed(tmp_path, training):
    problem = tiny(tmp_path, training=training, policies={"Tiny.a": "never"})
    result = plan_budget(problem, 0)
    assert not any("a" in problem.step.storages[k].names for k in result.recompute)


def test_doc_policies_keep_attention_in_full_training():
    full, lora = llama(policies=DOC_POLICIES), llama(training="lora", policies=DOC_POLICIES)
    attn = [k for k in full.step.saved() if "attn" in full.step.storages[k].names]
    assert attn and not any(full.intents.by_storage[k].recomputable for k in attn)
    assert all(lora.intents.by_storage[k].recomputable for k in attn)
    for problem in (full, lora):
        rstd = [k for k in problem.step.saved() if "ln1_rstd" in problem.step.storages[k].names]
        assert all(problem.intents.by_storage[k].recomputable for k in rstd)


# ====================================================================== replay segments
def test_full_layer_recompute_keeps_only_block_inputs():
    problem = llama()
    outcome = evaluate(problem, baseline(problem, "full_layer"), set())
    kept = outcome.replays.checkpoints
    step = problem.step
    blocks = sorted({k[0][0] for k in problem.candidates if k[0]})
    inputs = {step.envs[(block,)][name] for block in blocks for name in ("x", "residual")}
    assert len(blocks) == 4 and kept == inputs  # each block's two inputs, nothing else
    assert outcome.recompute_s > 0


def test_norm_output_replays_from_saved_statistics():
    problem = llama()
    step = problem.step
    ln2 = next(k for k in step.saved() if "ln2_out" in step.storages[k].names)
    outcome = evaluate(problem, {ln2}, set())
    assert list(outcome.replays.placement) == [(step.storages[ln2].producer, "apply")]
    assert not outcome.replays.checkpoints


def test_attention_core_replays_from_the_qkv_projection():
    problem = llama()
    step = problem.step
    outcome = evaluate(problem, baseline(problem, "attention_core"), set())
    targets = {step.ops[i].node.target for i, _ in outcome.replays.placement}
    # RoPE runs in place inside the kept QKV projection (modulec.plan.in_place): the
    # replay starts at the attention from the rotated q and k; the attention's output is
    # laid out [B, T, H, D], so its contiguous is a view (modulec.plan.layouts)
    assert targets == {"flash_attention"}
    assert not outcome.replays.checkpoints
