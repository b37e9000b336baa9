"""Schedule IR (issue 4, item 8): streams and sync points, recompute segments, swap ops and
the activation layout, as `modulec build` writes them, and `modulec ir verify` on them."""

import copy
import json
from collections import Counter

import pytest
from click.testing import CliRunner

from modulec.cli.build_cmd import verify_document
from modulec.cli.main import modulec
from modulec.ir.serialize import dumps
from modulec.ir.verify_schedule import _walk
from modulec.lower.build import BuildRequest, build
from modulec.lower.build_plan import PlanOptions
from modulec.lower.schedule import print_schedule
from modulec.paths import REPO_DIR
from modulec.plan.budget import make_problem, parse_size, plan_budget, summary
from modulec.plan.from_graph import plan_step
from modulec.plan.recompute import declarations

LLAMA = REPO_DIR / "examples" / "llama.module"  # TinyLlama, 22 layers
SHAPES = {"B": 1, "T": 2048}
BUDGET = "17GiB"  # feasible, and it needs recompute and swaps both


def built(path=LLAMA, shapes=SHAPES, **options):
    result = build(BuildRequest(path, shapes=shapes, planning=PlanOptions(**options)))
    assert result.document is not None, (result.failure, [d.message for d in result.diagnostics])
    return result


@pytest.fixture(scope="module")
def budgeted():
    return built(budget=parse_size(BUDGET))


@pytest.fixture(scope="module")
def planned(budgeted):
    """What `modulec plan --memory-budget` decides for the same graph."""
    problem = make_problem(budgeted.graph, declarations(LLAMA))
    result = plan_budget(problem, parse_size(BUDGET))
    return problem, result, summary(problem, result)


def executions(document) -> list:
    return list(_walk(document["schedule"], _graph(document)))


def _graph(document):
    from modulec.ir.serialize import graph_from_data

    return graph_from_data(document["graph"])


def all_ops(document):
    return [op for ops in document["schedule"]["functions"].values() for op in ops]


# ====================================================================== the planner's decisions
def test_swaps_and_replays_match_the_plan(budgeted, planned):
    _, result, report = planned
    ran = Counter(op.get("kind") for _, _, op, _ in executions(budgeted.document))
    swaps = report["decisions"]["swap"]["count"]
    assert swaps > 0 and ran["swap_out"] == swaps and ran["swap_in"] == swaps
    assert ran["recompute"] == len(result.outcome.replays.placement) > 0
    assert ran["record_event"] == 2 * swaps and ran["wait_event"] == 2 * swaps


def test_layout_decisions_count_as_the_plan_reports(budgeted, planned):
    report = planned[2]["decisions"]
    counted = Counter()
    for record in budgeted.document["schedule"]["layout"]["functions"]:
        for value in record["values"]:
            if "view_of" not in value:
                for kind, first, last in value["decisions"]:
                    counted[kind] += last - first + 1
    assert counted["swap"] == report["swap"]["count"]
    assert counted["recompute"] == report["recompute"]["count"]


def test_swapped_values_leave_after_their_last_forward_use_and_return_before_the_first_backward(
        budgeted):
    order = {}
    for _, _, op, running in executions(budgeted.document):
        if op.get("kind") in ("swap_out", "swap_in"):
            key = (op["function"], op["value"], running + op["instance"])
            order.setdefault(key, []).append((op["kind"], op["phase"]))
    assert order and all(kinds == [("swap_out", "forward"), ("swap_in", "backward")]
                         for kinds in order.values())


def test_recompute_ops_run_in_the_backward_before_a_backward_op(budgeted):
    graph = budgeted.graph
    for name, ops in budgeted.document["schedule"]["functions"].items():
        for index, op in enumerate(ops):
            if op.get("kind") == "recompute":
                assert graph.function(name).gradient_of, name
                assert op["phase"] == "recompute" and op["stream"] == 0
                assert any(o.get("kind") is None for o in ops[index + 1:])
                replayed = graph.function(op["function"])
                assert op["node"] in {n.id for n in replayed.nodes}


def test_the_plan_without_a_budget_keeps_everything():
    document = built().document
    assert not any(op.get("kind") for op in all_ops(document))
    rows = [v for r in document["schedule"]["layout"]["functions"] for v in r["values"]]
    assert rows and all(v["decisions"][0][0] == "keep" and len(v["decisions"]) == 1
                        for v in rows)


def test_checkpoint_annotation_gives_segments_without_a_budget(tmp_path):
    document = built(REPO_DIR / "examples" / "mistral.module", {"B": 1, "T": 256}).document
    kinds = Counter(op.get("kind") for op in all_ops(document))
    assert kinds["recompute"] > 0 and kinds["swap_out"] == 0
    path = tmp_path / "m.ir"
    path.write_text(dumps(document))
    assert verify_document(path) == []


# ====================================================================== streams and sync
def test_every_op_has_a_stream_and_copies_run_on_stream_1(budgeted):
    ops = all_ops(budgeted.document)
    assert all(isinstance(op["stream"], int) for op in ops)
    for op in ops:
        if op.get("kind") in ("swap_out", "swap_in"):
            assert op["stream"] == 1
        elif op.get("kind") in (None, "recompute"):
            assert op["stream"] == 0


def test_each_swap_is_fenced_by_events(budgeted):
    """ready: compute -> copy before the swap_out; prefetched: copy -> compute before use."""
    for ops in budgeted.document["schedule"]["functions"].values():
        for index, op in enumerate(ops):
            if op.get("kind") == "swap_out":
                record, wait = ops[index - 2], ops[index - 1]
                assert (record["kind"], record["stream"]) == ("record_event", 0)
                assert (wait["kind"], wait["stream"]) == ("wait_event", 1)
                assert record["event"] == wait["event"] == f"ready:{op['function']}/{op['value']}"
            if op.get("kind") == "swap_in":
                record = ops[index + 1]
                assert (record["kind"], record["stream"]) == ("record_event", 1)
                assert record["event"] == f"prefetched:{op['function']}/{op['value']}"


# ====================================================================== layout
def test_layout_follows_the_memory_plan(budgeted):
    layout = budgeted.document["schedule"]["layout"]
    plan = plan_step(budgeted.graph)
    assert layout["regions"]["saved_activations"] == plan.regions["saved_activations"].arena
    records = sorted((r["saved"]["base"], r["saved"]["base"] + r["saved"]["stride"]
                      * r["instances"]) for r in layout["functions"])
    assert all(a[1] <= b[0] for a, b in zip(records, records[1:]))
    block = next(r for r in layout["functions"] if r["function"] == "DenseTransformerBlock#1")
    assert block["instances"] == 22
    placed = plan.placements["DenseTransformerBlock#1"]
    for value in block["values"]:
        assert value["offset"] + value["bytes"] <= block["saved"]["stride"]
        assert (value["offset"], value["bytes"]) == (placed[value["value"]].offset,
                                                    placed[value["value"]].size_bytes)
        assert value["shape"] and value["dtype"]


def test_swapped_values_have_host_slots(budgeted):
    for record in budgeted.document["schedule"]["layout"]["functions"]:
        swapped = [v for v in record["values"] if "view_of" not in v
                   and any(k == "swap" for k, _, _ in v["decisions"])]
        slots = sorted((v["host_offset"], v["host_offset"] + v["bytes"]) for v in swapped)
        assert all(a[1] <= b[0] for a, b in zip(slots, slots[1:]))
        assert all(end <= record["host"]["stride"] for _, end in slots)


# ====================================================================== text, determinism
def test_printed_schedule_shows_streams_segments_swaps_and_waits(budgeted):
    text = print_schedule(budgeted.document["schedule"])
    assert " s1  swap_out  " in text and " s1  swap_in  " in text
    assert " s0  wait_event  " in text and "event prefetched:" in text
    assert "recompute s0" in text and "replays " in text and "when i in " in text
    assert "layout (saved_activations " in text


def test_budget_builds_are_byte_identical(budgeted):
    assert dumps(built(budget=parse_size(BUDGET)).document) == dumps(budgeted.document)


def test_cli_build_with_budget(tmp_path):
    out = tmp_path / "x.ir"
    result = CliRunner().invoke(modulec, ["build", str(LLAMA), "-o", str(out), "--shape",
                                          "B=1", "--shape", "T=2048", "--memory-budget",
                                          BUDGET])
    assert result.exit_code == 0, result.output
    assert verify_document(out) == []
    too_small = CliRunner().invoke(modulec, ["build", str(LLAMA), "--shape", "B=1",
                                             "--shape", "T=2048", "--memory-budget", "12GiB"])
    assert too_small.exit_code == 1 and "cannot be met" in too_small.stderr
    unsized = CliRunner().invoke(modulec, ["build", str(LLAMA), "--memory-budget", "12GiB"])
    assert unsized.exit_code == 1 and "--shape" in unsized.stderr


@pytest.mark.parametrize("path", sorted((REPO_DIR / "examples").glob("*.module"))
                         + sorted((REPO_DIR / "std" / "models").glob("*.module")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_model_builds_a_verified_schedule(path, tmp_path):
    document = built(path, {"B": 1, "T": 64}).document
    out = tmp_path / "m.ir"
    out.write_text(dumps(document))
    assert verify_document(out) == []
    assert document["schedule"]["layout"]["functions"]


# ====================================================================== the verifier
def _edited(document, change):
    document = copy.deepcopy(document)
    change(document["schedule"])
    return document


def _drop(schedule, test):
    for name, ops in schedule["functions"].items():
        schedule["functions"][name] = [op for op in ops if not test(op)]


def _first(schedule, test):
    return next(op for ops in schedule["functions"].values() for op in ops if test(op))


def broken_schedules(document):
    kind = lambda k: lambda op: op.get("kind") == k  # noqa: E731
    yield "record", lambda s: _drop(s, lambda op: op.get("kind") == "record_event"
                                    and op["event"].startswith("prefetched:")), "not recorded"
    yield "swap_out", lambda s: _drop(s, kind("swap_out")), "without a swap_out"
    yield "stream", lambda s: _first(s, kind("swap_in")).update(stream=0), "stream 0"
    yield "compute stream", lambda s: _first(s, kind(None)).update(stream=1), "stream 1"
    yield "forward recompute", lambda s: s["functions"]["DenseTransformerBlock#1"].append(
        copy.deepcopy(_first(s, kind("recompute")))), "forward function"
    yield "last recompute", lambda s: s["functions"]["CausalSelfAttention#1.backward"].append(
        copy.deepcopy(_first(s, kind("recompute")))), "no op after it"
    yield "replayed node", lambda s: _first(s, kind("recompute")).update(node="f999"), \
        "not a forward node"
    yield "instances", lambda s: _first(s, lambda op: op.get("instances")).update(
        instances=[[0, 99]]), "go past instance"
    yield "unknown kind", lambda s: _first(s, kind("swap_in")).update(kind="teleport"), \
        "unknown kind"
    yield "overlap", _overlap, "overlap in transient_activations"
    yield "layout", lambda s: s["layout"]["functions"][1]["saved"].update(base=0), \
        "overlap"
    yield "ops not a list", lambda s: s["functions"].update({"TinyLlama#1": 3}), \
        "expected a list of ops"
    yield "op not an object", lambda s: s["functions"]["TinyLlama#1"].append("x"), \
        "expected an object"
    yield "bad buffer", lambda s: _first(s, lambda op: "buffers" in op)["buffers"].append(
        ["v", "r", -1, "x"]), "`buffers` must be"
    yield "not an object", lambda s: s.clear() or s.update(functions=[]), "expected an object"


def _overlap(schedule):
    """Two transient values of the entry, live at once, given the same bytes."""
    ops = schedule["functions"]["TinyLlama#1"]
    first, second = ops[0]["buffers"][0], ops[1]["buffers"][0]
    second[2] = first[2]


@pytest.fixture(scope="module")
def broken(budgeted):
    return [(case, _edited(budgeted.document, change), message)
            for case, change, message in broken_schedules(budgeted.document)]


def test_verifier_rejects_broken_schedules(broken, tmp_path):
    for case, document, message in broken:
        path = tmp_path / f"{case}.ir"
        path.write_text(json.dumps(document))
        problems = verify_document(path)
        assert problems and any(message in p for p in problems), (case, problems)


def test_verifier_cli_has_no_traceback_on_a_hostile_schedule(budgeted, tmp_path):
    document = copy.deepcopy(budgeted.document)
    document["schedule"]["functions"]["TinyLlama#1"][0] = {"kernel": 5, "phase": [],
                                                            "stream": "x", "buffers": 7}
    path = tmp_path / "h.ir"
    path.write_text(json.dumps(document))
    result = CliRunner().invoke(modulec, ["ir", "verify", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "`kernel` must be a string" in result.stderr
