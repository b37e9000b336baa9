"""Pipeline parallel (issue 17, item 4): `@partition` stages in the Graph IR, the
`pipeline` section's split, boundaries and 1F1B ops, and its simulated timeline."""

from collections import Counter
from pathlib import Path

import pytest

from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.pipeline import (
    Pipeline, PipelineError, balanced_split, entry_units, one_f_one_b, pipeline_section,
)
from modulec.plan.pipeline_sim import Deadlock, simulate

DATA = Path(__file__).resolve().parent / "data"
PIPELINED = DATA / "pipeline_llama.module"
LLAMA = REPO_DIR / "std" / "models" / "llama.module"
TINY = dict(n_layers="4", d_model="32", num_heads="4", num_kv_heads="2", d_ff="48",
            vocab_size="64", max_seq="64")


def graph_of(path, settings=None, shapes=None):
    result = build(BuildRequest(path, settings=settings or {}, shapes=shapes or {"B": 2, "T": 8}))
    assert result.graph is not None, [d.message for d in result.diagnostics]
    return result.graph


@pytest.fixture(scope="module")
def pipelined():
    return graph_of(PIPELINED)


def test_partition_reaches_every_node_of_its_flow_and_sliced_calls_know_their_blocks(pipelined):
    entry = pipelined.function(pipelined.entry)
    stages = {n.id: dict(n.annotations).get("partition") for n in entry.nodes}
    assert stages == {"f0": ("0",), "f1": None, "f2": ("0",), "f3": ("1",), "f4": None,
                      "f5": ("1",)}
    calls = [(n.attr("instance"), n.attr("first"), n.repeat) for n in entry.nodes
             if n.kind == "call"]
    assert calls == [("blocks", 0, 2), ("blocks", 2, 2)]


def test_stages_follow_the_annotations(pipelined):
    section = pipeline_section(pipelined, Pipeline(microbatches=4))
    assert section["split"] == "partition" and len(section["stages"]) == 2
    first, second = section["stages"]
    assert [u["node"] for u in first["units"]] == ["f0", "f1", "f2"]
    assert first["units"][2]["blocks"] == [0, 1]
    assert second["units"][0]["blocks"] == [2, 3]
    assert "embedding" in first["params"] and "blocks[1].mlp.down_weight" in first["params"]
    assert {"blocks[2].ln1.weight", "final_norm.weight", "lm_head"} <= set(second["params"])
    assert not set(first["params"]) & set(second["params"])


def test_the_boundary_carries_the_residual_stream_both_ways(pipelined):
    [boundary] = pipeline_section(pipelined, Pipeline())["boundaries"]
    assert [(t["value"], t["shape"], t["gradient"]) for t in boundary["tensors"]] == \
        [("%3", [2, 8, 32], True), ("%4", [2, 8, 32], True)]
    assert boundary["activation_bytes"] == boundary["gradient_bytes"] == 2 * 2 * 8 * 32 * 2


def test_pp_must_match_the_annotations(pipelined):
    with pytest.raises(PipelineError, match="make 2 stages"):
        pipeline_section(pipelined, Pipeline(stages=3))


def test_default_microbatches_are_four_per_stage(pipelined):
    assert pipeline_section(pipelined, Pipeline())["microbatches"] == 8


@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 8), (4, 4), (4, 8), (3, 2)])
def test_one_f_one_b(stages, micro):
    ops = [one_f_one_b(s, stages, micro) for s in range(stages)]
    for s, stage_ops in enumerate(ops):
        compute = [(o["kind"], o["microbatch"]) for o in stage_ops
                   if o["kind"] in ("forward", "backward")]
        warmup = min(stages - s - 1, micro)
        assert compute[:warmup] == [("forward", m) for m in range(warmup)]
        assert Counter(k for k, _ in compute) == {"forward": micro, "backward": micro}
        # never more micro-batches in flight than stages ahead (1F1B's memory bound)
        live = peak = 0
        for kind, _ in compute:
            live += 1 if kind == "forward" else -1
            peak = max(peak, live)
        assert peak == min(stages - s, micro)
        assert [o["phase"] for o in stage_ops if o["kind"] == "forward"][:warmup] == \
            ["warmup"] * warmup
    sends = Counter((s, o["peer"], o["what"], o["microbatch"]) for s, stage_ops in enumerate(ops)
                    for o in stage_ops if o["kind"] == "send")
    recvs = Counter((o["peer"], s, o["what"], o["microbatch"]) for s, stage_ops in enumerate(ops)
                    for o in stage_ops if o["kind"] == "recv")
    assert sends == recvs
    assert all(o["stream"] == (2 if o["kind"] in ("send", "recv") else 0)
               for stage_ops in ops for o in stage_ops)


def test_balanced_split_minimises_the_slowest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert balanced_split([1, 1, 1], 3) == [0, 1, 2]
    with pytest.raises(PipelineError, match="only 3 units"):
        balanced_split([1, 1, 1], 4)


def test_pp_splits_a_model_without_annotations_by_layers():
    graph = graph_of(LLAMA, TINY)
    units = entry_units(graph)
    assert [u.block for u in units if u.layer is not None] == [0, 1, 2, 3]
    section = pipeline_section(graph, Pipeline(stages=2, microbatches=4))
    assert section["split"] == "balanced"
    blocks = [u.get("blocks") for s in section["stages"] for u in s["units"] if "blocks" in u]
    assert blocks[0][0] == 0 and blocks[-1][1] == 3
    seconds = [s["forward_s"] + s["backward_s"] for s in section["stages"]]
    assert max(seconds) < sum(seconds)


def _even(stages: int, micro: int, forward=1.0, backward=2.0) -> dict:
    return {"stages": [{"stage": s, "forward_s": forward, "backward_s": backward}
                       for s in range(stages)],
            "boundaries": [{"from": s, "to": s + 1, "activation_bytes": 0,
                            "gradient_bytes": 0} for s in range(stages - 1)],
            "microbatches": micro, "ops": [one_f_one_b(s, stages, micro)
                                           for s in range(stages)]}


@pytest.mark.parametrize("stages, micro", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_equal_stages_on_free_links_have_the_textbook_bubble(stages, micro):
    timeline = simulate(_even(stages, micro), latency_s=0.0)
    assert timeline.step_s == pytest.approx((micro + stages - 1) * 3.0)
    assert timeline.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    assert all(s.busy_s == pytest.approx(micro * 3.0) for s in timeline.stages)


def test_links_add_transfer_time():
    section = _even(2, 4)
    section["boundaries"][0].update(activation_bytes=10**9, gradient_bytes=10**9)
    free = simulate(_even(2, 4), latency_s=0.0).step_s
    assert simulate(section, link_bytes_per_s=1e9, latency_s=0.0).step_s > free + 1.0


def test_a_schedule_that_cannot_finish_is_a_deadlock():
    section = _even(2, 2)
    section["ops"][1] = [o for o in section["ops"][1] if not (
        o["kind"] == "send" and o["microbatch"] == 0)]
    with pytest.raises(Deadlock, match="stage 0 waits at recv gradients of micro-batch 0"):
        simulate(section)


def test_the_simulated_llama_pipeline_from_the_cost_model(pipelined):
    timeline = simulate(pipeline_section(pipelined, Pipeline(microbatches=8)))
    summary = timeline.summary()
    assert 0 < summary["bubble_fraction"] < 1
    assert len(summary["stages"]) == 2 and summary["step_s"] > 0


def test_stages_change_nothing_on_one_device():
    """The reference runtime runs the @partition model (its pipeline section aside) as the
    plain Llama: sliced calls read the right blocks' parameters."""
    torch = pytest.importorskip("torch")
    from runtime.model import Model

    staged = Model.from_module(PIPELINED).init_random(0, std=0.3)
    plain = Model.from_module(LLAMA, settings=TINY | {"eps": "1e-5"})
    assert plain.parameter_shapes() == staged.parameter_shapes()
    plain.params = {k: v.clone() for k, v in staged.params.items()}
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32)
    want = plain.forward(token_ids=tokens)["logits"]
    assert torch.equal(staged.forward(token_ids=tokens)["logits"], want)


def test_stage_memory_holds_its_own_parameters_and_its_micro_batches_in_flight():
    from modulec.plan.distributed import DataParallel
    from modulec.plan.pipeline_memory import stage_memory

    result = build(BuildRequest(REPO_DIR / "examples" / "llama.module",
                                shapes={"B": 1, "T": 2048}, distributed=DataParallel(2, 1),
                                pipeline=Pipeline(4, 16)))
    schedule = result.document["schedule"]
    rows = stage_memory(result.graph, schedule, transient=0)
    assert [r["in_flight"] for r in rows] == [4, 3, 2, 1]
    saved = sum(r["saved_per_microbatch_bytes"] for r in rows)
    assert saved == pytest.approx(schedule["layout"]["regions"]["saved_activations"], rel=0.02)
    assert all(r["activation_bytes"] == r["saved_per_microbatch_bytes"] * r["in_flight"]
               for r in rows)
    # each stage holds about a quarter of the model's state, not all of it
    whole = sum(r["fixed_bytes"] for r in rows)
    assert all(0.1 * whole < r["fixed_bytes"] < 0.4 * whole for r in rows)
    assert rows[0]["per_gpu_bytes"] > rows[-1]["per_gpu_bytes"]


def test_a_named_stage_is_an_error_when_the_pipeline_is_built(tmp_path):
    text = PIPELINED.read_text(encoding="utf-8").replace(
        "x0 @partition(0)", "x0 @partition(first)").replace(
        "model PipelineLlama(", "model PipelineLlama(first: int = 1, ")
    path = tmp_path / "named.module"
    path.write_text(text, encoding="utf-8")
    result = build(BuildRequest(path, search_path=(REPO_DIR,), shapes={"B": 1, "T": 8}))
    assert result.document is None
    assert result.failure == (f"`@partition(first)` at {path}:28: a pipeline stage must be "
                              "an integer literal")


def test_data_parallel_pipelines_all_reduce_each_stages_buckets(pipelined):
    """DP x PP: the section's mesh says dp 2 x pp 2, each stage's gradient buckets (a
    layer, an entry parameter) hold its (trained) parameters once, and its ops end in one all_reduce
    a bucket over its DP group; the verifier checks them, the simulated clock counts them."""
    from modulec.ir.verify_parallel import verify_pipeline

    one = pipeline_section(pipelined, Pipeline(microbatches=4))
    two = pipeline_section(pipelined, Pipeline(microbatches=4, dp=2))
    assert one["mesh"] == {"dp": 1, "pp": 2, "tp": 1} and two["mesh"]["dp"] == 2
    assert "grad_buckets" not in one["stages"][0]
    assert not [o for ops in one["ops"] for o in ops if o["kind"] == "all_reduce"]
    for stage, ops in zip(two["stages"], two["ops"]):
        buckets = stage["grad_buckets"]
        assert sorted(p["path"] for b in buckets for p in b["params"]) == \
            sorted(stage["params"])
        assert [o["bucket"] for o in ops if o["kind"] == "all_reduce"] == \
            list(range(len(buckets)))
        assert ops[-len(buckets):] == [o for o in ops if o["kind"] == "all_reduce"]
    assert [b["name"] for b in two["stages"][1]["grad_buckets"]] == \
        ["lm_head", "final_norm", "blocks[3]", "blocks[2]"]  # backward order
    assert verify_pipeline(two, pipelined) == verify_pipeline(one, pipelined) == []
    assert simulate(two).step_s > simulate(one).step_s
    damaged = dict(two, mesh={"dp": 1, "pp": 2, "tp": 1})
    assert verify_pipeline(damaged, pipelined) == [
        "stage 0: gradient buckets or all_reduce ops with mesh dp 1",
        "stage 1: gradient buckets or all_reduce ops with mesh dp 1"]
    assert verify_pipeline(dict(two, mesh={"dp": 2, "pp": 3, "tp": 1}), pipelined) == [
        "`mesh` says pp 3, but the section has 2 stages"]


def test_zero1_pipelines_own_buckets_and_broadcast_them(pipelined):
    """ZeRO-1 over a stage's DP group: every bucket has an owner (largest first to the
    least loaded replica), the all-reduces are followed by the optimizer step and one
    broadcast a bucket from its owner; the verifier checks owners and order."""
    from modulec.ir.verify_parallel import verify_pipeline

    section = pipeline_section(pipelined, Pipeline(microbatches=4, dp=2, zero=1))
    assert section["zero"] == 1
    buckets = section["stages"][1]["grad_buckets"]
    assert [(b["name"], b["owner"]) for b in buckets] == \
        [("lm_head", 0), ("final_norm", 1), ("blocks[3]", 0), ("blocks[2]", 1)]
    ops = section["ops"][1]
    tail = [(o["kind"], o.get("bucket"), o.get("root")) for o in ops[-9:]]
    assert tail == [("all_reduce", k, None) for k in range(4)] + \
        [("optimizer_step", None, None)] + [("broadcast", k, b["owner"])
                                            for k, b in enumerate(buckets)]
    assert verify_pipeline(section, pipelined) == []
    assert simulate(section).step_s > 0
    ops[-1] = dict(ops[-1], root=0)
    buckets[0]["owner"] = 2
    assert verify_pipeline(section, pipelined) == [
        "stage 1: bucket 0: ZeRO-1 needs an owner in 0..1, not 2",
        "stage 1: broadcast of bucket 0 from 0, its owner is 2",
        "stage 1: broadcast of bucket 3 from 0, its owner is 1"]
    with pytest.raises(ValueError, match="ZeRO 0 or 1"):
        Pipeline(2, dp=2, zero=2)


def test_lora_pipelines_bucket_the_adapters_alone():
    """DP x PP of a LoRA build (ZeRO-1): the frozen base is in no gradient bucket (nothing
    to reduce, nothing to broadcast), each stage's adapters are, each once; the verifier
    refuses a bucket that holds a frozen weight."""
    from modulec.ir.verify_parallel import verify_pipeline
    from modulec.lower.lora import LoraOptions, is_adapter

    result = build(BuildRequest(PIPELINED, shapes={"B": 1, "T": 8},
                                pipeline=Pipeline(microbatches=2, dp=2, zero=1),
                                lora=LoraOptions(rank=4, targets=("qkv", "down"))))
    section = result.document["schedule"]["pipeline"]
    for stage in section["stages"]:
        bucketed = [r["path"] for b in stage["grad_buckets"] for r in b["params"]]
        assert bucketed and sorted(bucketed) == sorted(p for p in stage["params"]
                                                       if is_adapter(p))
    assert verify_pipeline(section, result.graph) == []
    bucket = section["stages"][0]["grad_buckets"][0]
    bucket["params"].append({"path": "embedding", "shape": [64, 32], "offset": bucket["numel"],
                             "numel": 64 * 32})
    bucket["numel"] += 64 * 32
    assert verify_pipeline(section, result.graph) == [
        "stage 0: the gradient buckets do not hold the stage's trained parameters (those "
        "with a gradient), each once"]


def test_zero1_pipelines_plan_each_stages_sharded_state():
    from modulec.plan.pipeline_memory import stage_memory

    fixed = {}
    for zero in (0, 1):
        result = build(BuildRequest(PIPELINED, shapes={"B": 2, "T": 8},
                                    pipeline=Pipeline(microbatches=4, dp=2, zero=zero)))
        assert "distributed" not in result.document["schedule"]
        rows = stage_memory(result.graph, result.document["schedule"], transient=0)
        fixed[zero] = [r["fixed_bytes"] for r in rows]
    # the moments (8 of the 20 bytes a GPU stage holds a parameter) halve: 16 / 20
    assert all(0.75 * a < b < 0.85 * a for a, b in zip(fixed[0], fixed[1]))
