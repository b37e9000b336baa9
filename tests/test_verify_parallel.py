"""`modulec ir verify` on the distributed and pipeline sections (issue 17): a built
document is valid, and each kind of damage a hand edit can do is reported by name."""

import copy
import json

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.ir.serialize import graph_from_data
from modulec.ir.verify_parallel import parameter_shapes, verify_parallel
from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.distributed import DataParallel
from modulec.plan.pipeline import Pipeline

PIPELINED = REPO_DIR / "tests" / "data" / "pipeline_llama.module"


@pytest.fixture(scope="module", params=[0, 1, 2, 3])
def document(request):
    result = build(BuildRequest(PIPELINED, shapes={"B": 2, "T": 8},
                                distributed=DataParallel(2, request.param),
                                pipeline=Pipeline(microbatches=4)))
    assert result.document is not None
    return result.document


def problems(document, change=None):
    edited = copy.deepcopy(document)
    if change is not None:
        change(edited["schedule"])
    return verify_parallel(edited["schedule"], graph_from_data(edited["graph"]))


def test_a_built_document_is_valid(document):
    assert problems(document) == []


def test_parameter_paths_of_sliced_calls():
    result = build(BuildRequest(PIPELINED, shapes={"B": 2, "T": 8}))
    shapes = parameter_shapes(result.graph)
    assert shapes["blocks[3].attention.qkv_weight"] == [64, 32]
    assert shapes["lm_head"] == [64, 32] and "blocks[4].ln1.weight" not in shapes


def _blocks(schedule):
    return next(b for b in schedule["distributed"]["buckets"] if b["path"] == "blocks[{i}]")


def _set(getter, key, value):
    def change(schedule):
        getter(schedule)[key] = value
    return change


DAMAGE = {
    "missing parameter": (_set(lambda s: _blocks(s)["params"][0], "name", "ln9.weight"),
                          "`blocks[0].ln9.weight` is not a parameter of the graph"),
    "wrong shape": (_set(lambda s: _blocks(s)["params"][2], "shape", [32, 64]),
                    "`blocks[0].attention.qkv_weight` has shape [64, 32] in the graph, "
                    "[32, 64] in the bucket"),
    "misaligned": (_set(lambda s: _blocks(s)["params"][1], "offset", 130),
                   "`ln2.weight` at offset 130, not a multiple of 128"),
    "overlapping": (_set(lambda s: _blocks(s)["params"][3], "offset", 2048),
                    "`attention.out_weight` at offset 2048 overlaps the parameter before it"),
    "bad shard": (_set(_blocks, "shard", 100), "shard 100 x dp 2 != numel"),
    "numel vs dp": (lambda s: _blocks(s).update(numel=_blocks(s)["numel"] + 128,
                                                 shard=_blocks(s)["shard"] + 64),
                    "is not a multiple of dp x align = 256"),
    "past the end": (_set(_blocks, "numel", 256), "past numel 256"),
    "twice": (lambda s: s["distributed"]["buckets"].append(
        copy.deepcopy(s["distributed"]["buckets"][0])), "is also in bucket"),
    "bad zero": (_set(lambda s: s["distributed"], "zero", 5), "`zero` must be 0, 1, 2 or 3"),
    "bad mesh": (_set(lambda s: s["distributed"]["mesh"], "dp", 0), "`mesh` must be"),
    "unknown kind": (_set(lambda s: s["distributed"]["ops"][0], "kind", "broadcast"),
                     "unknown kind `broadcast`"),
    "unknown trigger": (_set(lambda s: s["distributed"]["ops"][0], "on", "whenever"),
                        "unknown trigger `whenever`"),
    "bad stream": (_set(lambda s: s["distributed"]["ops"][0], "stream", 7),
                   "stream 7 is neither the compute nor the comm stream"),
    "wait before record": (lambda s: s["distributed"]["ops"].remove(next(
        op for op in s["distributed"]["ops"] if op["kind"] == "record_event"
        and op.get("event") == "grads")),
        "wait_event `grads` of instance 1 was never recorded before"),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_damage_to_the_distributed_section_is_reported(document, name):
    change, message = DAMAGE[name]
    found = problems(document, change)
    assert any(message in p for p in found), found
    assert all(p.startswith("schedule.distributed: ") for p in found)


def _entry(schedule):
    return next(b for b in schedule["distributed"]["buckets"] if b["name"] == "lm_head")


def _first_op(**match):
    def find(schedule):
        return next(op for op in schedule["distributed"]["ops"]
                    if all(op.get(k) == v for k, v in match.items()))
    return find


def _move_after_copy_in(schedule, op) -> None:
    ops = schedule["distributed"]["ops"]
    ops.remove(op)
    ops.insert(ops.index(next(o for o in ops if o["kind"] == "copy_in")) + 1, op)


ZERO3_DAMAGE = {
    "no windows": (lambda s: _entry(s).pop("windows"), "an entry bucket's `windows` must list"),
    "unknown window": (_set(_entry, "windows", ["later"]), "must list some of start, end"),
    "at off forward_begin": (_set(_first_op(at="last"), "on", "backward_begin"),
                             "`at` (first or last) is for an entry bucket's forward_begin"),
    "release of a layer": (_set(_first_op(kind="release"), "only", "layered"),
                           "`release` is for entry buckets"),
    "shared slot on a layer": (_set(_blocks, "gradient_slot", "x"),
                               "`gradient_slot` 'x': a name, on an entry bucket only"),
    "previous on a record": (_set(_first_op(previous="gradient_slot"), "kind", "record_event"),
                             "`previous` (gradient_slot) is for a wait_event"),
    "no wait for the slot": (lambda s: s["distributed"]["ops"].remove(
        _first_op(previous="gradient_slot")(s)), "but no wait_event `reduced` with `previous"),
    "slot wait after the copy": (lambda s: _move_after_copy_in(
        s, _first_op(previous="gradient_slot")(s)), "comes before gradients_ready's copy_in"),
    "slot wait on grads": (_set(_first_op(previous="gradient_slot"), "event", "grads"),
                           "but no wait_event `reduced` with `previous"),
    "gather before its buffer": (lambda s: s["distributed"]["ops"].remove(_first_op(
        kind="record_event", event="allocated", window="end")(s)),
        "bucket `lm_head`: at forward_begin of instance 0, wait_event `allocated`"),
}


@pytest.fixture(scope="module")
def zero3():
    return build(BuildRequest(PIPELINED, shapes={"B": 2, "T": 8},
                              distributed=DataParallel(2, 3))).document


def test_zero3_gathers_each_entry_bucket_in_the_windows_of_its_reads(zero3):
    """The untied embedding before the layers, the head and final norm after them."""
    windows = {b["name"]: b.get("windows") for b in zero3["schedule"]["distributed"]["buckets"]}
    assert windows["embedding"] == ["start"] and windows["lm_head"] == ["end"]
    assert windows["final_norm.weight"] == ["end"]
    slots = {b["name"]: b.get("gradient_slot")
             for b in zero3["schedule"]["distributed"]["buckets"]}
    assert slots["embedding"] == slots["lm_head"] == "lm_head+embedding"
    assert slots["final_norm.weight"] is None


@pytest.mark.parametrize("name", ZERO3_DAMAGE)
def test_damage_to_zero3_gather_windows_is_reported(zero3, name):
    change, message = ZERO3_DAMAGE[name]
    found = problems(zero3, change)
    assert any(message in p for p in found), found


def _ops(stage):
    return lambda s: s["pipeline"]["ops"][stage]


def _drop_first(stage, kind):
    def change(schedule):
        ops = schedule["pipeline"]["ops"][stage]
        ops.remove(next(op for op in ops if op["kind"] == kind))
    return change


def _recv_gradients_first(schedule):
    ops = schedule["pipeline"]["ops"][0]
    recv = next(op for op in ops if op["kind"] == "recv")
    ops.remove(recv)
    ops.insert(0, recv)


def _move_a_layer(schedule):
    first, second = schedule["pipeline"]["stages"]
    first["units"][-1]["layers"][1] = 0   # stage 0 keeps block 0 only: block 1 is lost


PIPE_DAMAGE = {
    "unmatched send": (_drop_first(0, "send"), "activations from stage 0 to 1: sent [1, 2, 3]"),
    "missing backward": (_drop_first(1, "backward"), "the backward of micro-batches [0] never "
                         "runs"),
    "wrong peer": (_set(lambda s: next(o for o in s["pipeline"]["ops"][1]
                                       if o["kind"] == "send"), "peer", 2),
                   "peer 2: gradients are send to stage 0"),
    "wrong stream": (_set(lambda s: s["pipeline"]["ops"][0][0], "stream", 2),
                     "op 0 (forward 0): stream 2, expected 0"),
    "backward first": (lambda s: s["pipeline"]["ops"][1].insert(
        0, {"kind": "backward", "microbatch": 3, "phase": "steady", "stream": 0}),
        "op 0 (backward 3): the backward before its forward"),
    "layers lost": (_move_a_layer, "not the entry's forward nodes in order"),
    "deadlock": (_recv_gradients_first, "deadlocks: stage 0 waits at recv gradients of "
                 "micro-batch 0 from stage 1; stage 1 waits at recv activations"),
    "stage count": (lambda s: s["pipeline"]["ops"].pop(), "1 op lists for 2 stages"),
}


@pytest.mark.parametrize("name", PIPE_DAMAGE)
def test_damage_to_the_pipeline_section_is_reported(document, name):
    change, message = PIPE_DAMAGE[name]
    found = problems(document, change)
    assert any(message in p for p in found), found


def test_ir_verify_reports_them_without_a_traceback(document, tmp_path):
    path = tmp_path / "model.ir"
    edited = copy.deepcopy(document)
    edited["schedule"]["distributed"]["buckets"] = "nonsense"
    edited["schedule"]["pipeline"]["ops"] = [[{"kind": 3}], None]
    path.write_text(json.dumps(edited))
    result = CliRunner().invoke(modulec, ["ir", "verify", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "schedule.distributed: `buckets` and `ops` must be lists" in result.output
    assert "schedule.pipeline:" in result.output
