"""The pipeline section's `shared` entries (modulec/plan/pipeline_shared.py): a parameter
two stages read (Llama's tied head reads the embedding) or two paths name (GPT-2's
`lm_head: tied_to(wte)`), the all-reduces that sum its copies' gradients, their text,
their simulated time, and `modulec ir verify`'s checks of them."""

from __future__ import annotations

import copy

import pytest

from modulec.ir.verify_parallel import verify_pipeline
from modulec.lower.build import BuildRequest, build
from modulec.lower.schedule_text_parallel import print_pipeline
from modulec.plan.pipeline import Pipeline
from modulec.plan.pipeline_sim import simulate
from tests.runtime_models import TINY


def _built(name: str, **options):
    path, settings = TINY[name]
    result = build(BuildRequest(path, settings={k: str(v) for k, v in settings.items()},
                                shapes={"B": 1, "T": 8},
                                pipeline=Pipeline(2, 2, **options)))
    assert result.document is not None, [d.message for d in result.diagnostics]
    return result.document["schedule"]["pipeline"], result.graph


def _shared_ops(section) -> list:
    return [[(op["kind"], op["shared"], op["group"], op["reduce"]) for op in ops
             if op.get("group") == "shared"] for ops in section["ops"]]


@pytest.fixture(scope="module")
def tied():
    return _built("llama_tied")


def test_a_parameter_two_stages_read_is_one_entry_summed_on_both(tied):
    section, graph = tied
    assert section["shared"] == [{"param": "embedding", "paths": ["embedding"],
                                  "stages": [0, 1], "shape": [64, 32], "numel": 2048,
                                  "bytes": 4096}]
    assert _shared_ops(section) == [[("all_reduce", 0, "shared", "sum")]] * 2
    assert all(ops[-1].get("group") == "shared" for ops in section["ops"])  # after B
    assert verify_pipeline(section, graph) == []
    text = print_pipeline(section)
    assert "  shared 0 embedding [64, 32]: a copy on stages 0, 1\n" in text
    assert "| SAR0" in text
    untied = _built("llama")[0]
    assert untied["shared"] == [] and _shared_ops(untied) == [[], []]
    assert simulate(section).step_s > simulate(untied).step_s  # the sum waits for both


def test_a_tied_path_is_its_targets_entry_and_bucket():
    """GPT-2's head `tied_to(wte)` on the last stage: one entry named by the target, and
    under DP x PP (ZeRO-1) each stage buckets `wte` (not `lm_head`); the sum comes after
    the buckets' all-reduces and before the optimizer step."""
    section, graph = _built("example_gpt2", dp=2, zero=1)
    [entry] = section["shared"]
    assert (entry["param"], entry["paths"], entry["stages"]) == ("wte", ["wte", "lm_head"],
                                                                 [0, 1])
    buckets = [[r["path"] for b in s["grad_buckets"] for r in b["params"]]
               for s in section["stages"]]
    assert "wte" in buckets[0] and "wte" in buckets[1] and "lm_head" not in buckets[1]
    for ops in section["ops"]:
        kinds = [(op["kind"], op.get("group")) for op in ops if op["phase"] != "steady"
                 and op["kind"] in ("all_reduce", "optimizer_step")]
        assert kinds[-2:] == [("all_reduce", "shared"), ("optimizer_step", None)]
        assert kinds[:-2] == [("all_reduce", "dp")] * (len(kinds) - 2)
    assert verify_pipeline(section, graph) == []
    assert "shared 0 wte (wte, lm_head) [64, 32]: a copy on stages 0, 1" in \
        print_pipeline(section)


def test_the_verifier_checks_the_entries_and_their_sums(tied):
    section, graph = tied

    def problems(change) -> list[str]:
        damaged = copy.deepcopy(section)
        change(damaged)
        return verify_pipeline(damaged, graph)

    assert problems(lambda s: s.update(shared=[])) == [
        "`embedding` is held by stages [0, 1] but is in no `shared` entry"]
    assert problems(lambda s: s["shared"][0].update(stages=[0])) == [
        "shared 0: `stages` [0], but stages [0, 1] read embedding"]
    assert problems(lambda s: s["ops"][1].pop()) == [
        "stage 1: shared all-reduces [], expected [0] (each trained entry of two stages "
        "or more it holds, in order)"]
    assert problems(lambda s: s["ops"][0][-1].update(reduce="avg")) == [
        "stage 0: shared 0: expected an all_reduce of gradients, reduce sum, stream 2, "
        "not ('all_reduce', 'gradients', 'avg', 2)"]
    assert problems(lambda s: s["ops"][0].insert(0, s["ops"][0].pop())) == [
        "stage 0: shared 0: its all_reduce must follow the last backward and the buckets' "
        "all-reduces and come before the optimizer step"]
    assert problems(lambda s: s.pop("shared")) == [
        "`shared` must be a list (rebuild with this modulec: a parameter two stages read "
        "is one of its entries)"]
