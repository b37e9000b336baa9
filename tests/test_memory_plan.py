"""Memory planning (issue 4): lifetimes, alias and in-place sharing, offsets, lower bound,
baselines, memory-aware ordering, determinism."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modulec.plan.memory import (
    BASELINES, SAVED, STRATEGIES, TRANSIENT, WEIGHTS, Block, Buffer, Op, PlanError,
    check_offsets, improve_order, lower_bound, memory_aware_order, peak_live_bytes,
    pinned_edges, plan_memory, reorder, storage, verify,
)
from modulec.plan.memory.offsets import arena_bytes, exact_size_reuse
from modulec.plan.memory.plan import _plan_memory

ROOT = Path(__file__).resolve().parent.parent
K = 1024                                         # a size that is a multiple of 256


def op(i, name, inputs, outputs, kind="other", inplace=False):
    return Op(i, name, tuple(inputs), tuple(outputs), kind, inplace)


def live_at(plan, t):
    return sorted(b.id for r in plan.regions.values() for b in r.blocks if b.start <= t <= b.end)


# ------------------------------------------------------------------ hand-made cases
def test_chain_reuses_two_slots():
    bufs = [Buffer(x, K) for x in "abcd"]
    ops = [op(0, "p", (), "a"), op(1, "f", "a", "b"), op(2, "g", "b", "c"), op(3, "h", "c", "d")]
    plan = plan_memory(ops, bufs)
    verify(plan)
    r = plan.regions[TRANSIENT]
    assert (r.naive_bytes, r.lower_bound_bytes, r.arena_bytes) == (4 * K, 2 * K, 2 * K)
    assert plan.offset("a") == plan.offset("c") != plan.offset("b")
    spans = [(p.first_use, p.last_use) for p in plan.placements.values()]
    assert spans == [(0, 1), (1, 2), (2, 3), (3, 3)]


def test_an_equal_input_gets_an_equal_plan_of_its_own():
    """plan_memory keeps its recent plans (RECENT): the same input again, in new objects,
    gets an equal plan whose dicts are its own; a list for a tuple is planned, not kept."""
    def made():
        bufs = [Buffer(x, K) for x in "abcd"]
        return [op(0, "p", (), "a"), op(1, "f", "a", "b"), op(2, "g", "ab", "c"),
                op(3, "h", "c", "d")], bufs
    first = plan_memory(*made())
    first.placements.clear()
    first.regions[TRANSIENT].block_offsets.clear()
    again = plan_memory(*made())
    assert again == _plan_memory(*made()) and again.placements and again is not first
    unhashable = [Op(0, "p", (), ["a"])]
    assert plan_memory(unhashable, [Buffer("a", K)]).placements["a"].offset == 0


def test_diamond_keeps_both_branches_live():
    bufs = [Buffer("x", 2 * K), Buffer("a", K), Buffer("b", 3 * K), Buffer("y", K)]
    ops = [op(0, "p", (), "x"), op(1, "a", "x", "a"), op(2, "b", "x", "b"),
           op(3, "join", "ab", "y")]
    plan = plan_memory(ops, bufs)
    verify(plan)
    assert live_at(plan, 2) == ["a", "b", "x"]
    assert plan.lower_bound_bytes == plan.arena_bytes == 6 * K   # x + a + b at op 2


def test_views_share_and_extend_their_source():
    bufs = [Buffer("qkv", 3 * K), Buffer("k", K, alias_of="qkv", offset_in_source=K),
            Buffer("kk", K // 2, alias_of="k", offset_in_source=K // 2),
            Buffer("o", K), Buffer("z", 4 * K)]
    ops = [op(0, "mm", (), ["qkv"]), op(1, "split", ["qkv"], ["k"], "view"),
           op(2, "slice", ["k"], ["kk"], "view"), op(3, "other", (), ["z"]),
           op(4, "use", ["kk", "z"], ["o"])]
    plan = plan_memory(ops, bufs)
    verify(plan)
    base = plan.offset("qkv")
    assert plan.offset("k") == base + K and plan.offset("kk") == base + K + K // 2
    assert plan.placements["kk"].block == "qkv"
    assert {b.id: (b.start, b.end) for b in plan.regions[TRANSIENT].blocks}["qkv"] == (0, 4)
    assert plan.regions[TRANSIENT].naive_bytes == 3 * K + K + 4 * K   # views own nothing
    assert plan.lower_bound_bytes == 8 * K                            # qkv + z + o at op 4


def test_view_storage_belongs_to_the_source_region():
    bufs = [Buffer("s", K, SAVED), Buffer("v", K, TRANSIENT, alias_of="s")]
    plan = plan_memory([op(0, "p", (), ["s"]), op(1, "view", ["s"], ["v"], "view")], bufs)
    assert plan.placements["v"].region == SAVED and list(plan.regions) == [SAVED]


def test_inplace_elementwise_chain_shares_one_block():
    bufs = [Buffer(x, K) for x in ("x", "e", "r", "s")]
    ops = [op(0, "p", (), ["x"]), op(1, "exp", ["x"], ["e"], "elementwise", True),
           op(2, "relu", ["e"], ["r"], "elementwise", True), op(3, "sum", ["r"], ["s"])]
    plan = plan_memory(ops, bufs)
    verify(plan)
    assert plan.inplace == {"e": "x", "r": "e"}
    assert {plan.placements[b].block for b in "xer"} == {"x"}
    assert plan.regions[TRANSIENT].lower_bound_bytes == 2 * K


@pytest.mark.parametrize("case", ["input_lives_on", "other_size", "not_ok", "not_elementwise",
                                  "other_region", "pinned_input"])
def test_inplace_only_when_allowed(case):
    size_y = K // 2 if case == "other_size" else K
    region_y = SAVED if case == "other_region" else TRANSIENT
    pin = (0, 3) if case == "pinned_input" else None
    bufs = [Buffer("x", K, pinned_lifetime=pin), Buffer("y", size_y, region_y), Buffer("z", K)]
    kind = "other" if case == "not_elementwise" else "elementwise"
    ops = [op(0, "p", (), [] if pin else ["x"]), op(1, "f", ["x"], ["y"], kind, case != "not_ok"),
           op(2, "g", ["y"] + (["x"] if case == "input_lives_on" else []), ["z"])]
    plan = plan_memory(ops, bufs)
    verify(plan)
    assert plan.inplace == {}


def test_inplace_two_outputs_take_distinct_inputs():
    bufs = [Buffer(x, K) for x in ("a", "b", "da", "db", "z")]
    ops = [op(0, "p", (), ["a", "b"]),
           op(1, "rope_bwd", ["a", "b"], ["da", "db"], "elementwise", True),
           op(2, "z", ["da", "db"], ["z"])]
    assert plan_memory(ops, bufs).inplace == {"da": "a", "db": "b"}


def test_saved_tensors_live_into_the_backward():
    bufs = [Buffer("w", K, WEIGHTS, pinned_lifetime=(0, 5)), Buffer("act", K, SAVED),
            Buffer("h", 2 * K), Buffer("dh", 2 * K), Buffer("dx", K)]
    ops = [op(0, "fwd1", ["w"], ["act"]), op(1, "fwd2", ["act", "w"], ["h"]),
           op(2, "loss_bwd", ["h"], ["dh"]), op(3, "bwd2", ["dh", "act"], ["dx"]),
           op(4, "bwd1", ["dx", "w"], []), op(5, "adam", ["w"], [])]
    plan = plan_memory(ops, bufs)
    verify(plan)
    assert (plan.placements["act"].first_use, plan.placements["act"].last_use) == (0, 3)
    assert plan.placements["w"].last_use == 5
    assert {r.region: r.lower_bound_bytes for r in plan.regions.values()} == \
        {WEIGHTS: K, SAVED: K, TRANSIENT: 4 * K}
    assert plan.single_arena_lower_bound_bytes == K + K + 4 * K


def test_lower_bound_is_peak_of_aligned_live_bytes():
    blocks = [Block("a", 0, TRANSIENT, 256, 256, 0, 2), Block("b", 1, TRANSIENT, 512, 256, 1, 1),
              Block("c", 2, TRANSIENT, 1024, 512, 2, 4), Block("d", 3, TRANSIENT, 256, 256, 3, 4)]
    assert lower_bound(blocks) == max(256, 256 + 512, 256 + 1024, 1024 + 256)
    bufs = [Buffer("x", 100, alignment=256), Buffer("y", 300, alignment=64)]
    plan = plan_memory([op(0, "p", (), ["x"]), op(1, "q", ["x"], ["y"])], bufs)
    assert plan.lower_bound_bytes == 256 + 320 and plan.naive_bytes == 256 + 320


def test_exact_size_reuse_reuses_only_exact_sizes():
    blocks = [Block("a", 0, TRANSIENT, 256, 256, 0, 0), Block("b", 1, TRANSIENT, 512, 256, 1, 1),
              Block("c", 2, TRANSIENT, 256, 256, 2, 2)]
    offsets = exact_size_reuse(blocks)
    assert offsets == {"a": 0, "b": 256, "c": 0}
    assert arena_bytes(blocks, offsets) == 768 > lower_bound(blocks) == 512


def test_plan_keeps_the_smallest_strategy():
    bufs = [Buffer(f"t{i}", s) for i, s in enumerate([3 * K, K, 2 * K, K, 3 * K, 2 * K])]
    ops = [op(0, "a", (), ["t0", "t1"]), op(1, "b", ["t0"], ["t2"]),
           op(2, "c", ["t1", "t2"], ["t3"]), op(3, "d", ["t3"], ["t4"]),
           op(4, "e", ["t4", "t2"], ["t5"])]
    r = plan_memory(ops, bufs).regions[TRANSIENT]
    assert r.arena_bytes == min(r.strategies.values()) == r.strategies[r.strategy]
    assert r.arena_bytes <= min(r.baselines.values()) and set(r.baselines) == set(BASELINES)


# ------------------------------------------------------------------ verify and input errors
def test_verify_reports_overlap_and_misalignment():
    bufs = [Buffer("a", K), Buffer("b", K)]
    plan = plan_memory([op(0, "p", (), ["a", "b"]), op(1, "q", ["a", "b"], [])], bufs)
    offsets = plan.regions[TRANSIENT].block_offsets
    offsets["b"] = offsets["a"]
    with pytest.raises(PlanError, match="'a'.*'b'.*overlap while both live"):
        verify(plan)
    offsets["b"] = K + 128
    with pytest.raises(PlanError, match="not a multiple of 256"):
        verify(plan)


@pytest.mark.parametrize("ops, bufs, message", [
    ([op(0, "f", ["nope"], [])], [], "unknown buffer 'nope'"),
    ([op(0, "f", [], ["a"]), op(1, "g", [], ["a"])], [Buffer("a", 1)], "produced twice"),
    ([], [Buffer("a", K), Buffer("v", K, alias_of="a", offset_in_source=1)], "outside its source"),
    ([op(0, "f", ["a"], []), op(1, "g", [], ["a"])], [Buffer("a", 1)], "read at op #0 before"),
    ([op(1, "f", [], []), op(1, "g", [], [])], [], "not increasing"),
    ([], [Buffer("a", 1, alignment=48)], "power of two"),
])
def test_bad_input_is_rejected(ops, bufs, message):
    with pytest.raises(PlanError, match=message):
        plan_memory(ops, bufs)


# ------------------------------------------------------------------ random schedules
SIZES = [0, 64, 100, 256, 1000, 1024, 4096]


@st.composite
def schedules(draw, max_ops=14):
    """Random DAGs in schedule order: fresh outputs, reads of earlier ones, views, pinned."""
    buffers = [Buffer("w", draw(st.sampled_from(SIZES)), WEIGHTS, pinned_lifetime=(0, max_ops))]
    ops, produced = [], []
    for i in range(draw(st.integers(1, max_ops))):
        pool = produced + ["w"]
        inputs = draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
        if produced and draw(st.integers(0, 4)) == 0:
            src = draw(st.sampled_from(produced))
            size = next(b.size_bytes for b in buffers if b.id == src)
            length = draw(st.integers(0, size))
            buffers.append(Buffer(f"v{i}", length, alias_of=src,
                                  offset_in_source=draw(st.integers(0, size - length))))
            ops.append(op(i, f"view{i}", [src], [f"v{i}"], "view"))
            produced.append(f"v{i}")
            continue
        outs = [f"t{i}_{k}" for k in range(draw(st.integers(0, 2)))]
        for name in outs:
            buffers.append(Buffer(name, draw(st.sampled_from(SIZES)),
                                  draw(st.sampled_from([TRANSIENT, TRANSIENT, SAVED])),
                                  alignment=draw(st.sampled_from([64, 256, 512]))))
        ops.append(op(i, f"op{i}", inputs, outs, draw(st.sampled_from(["elementwise", "other"])),
                      draw(st.booleans())))
        produced += outs
    return ops, buffers


@settings(derandomize=True, max_examples=150, deadline=None)
@given(schedules())
def test_every_strategy_is_valid_on_random_schedules(schedule):
    ops, bufs = schedule
    shared = storage(ops, bufs)
    for region in {b.region for b in shared.blocks}:
        blocks = [b for b in shared.blocks if b.region == region]
        bound = lower_bound(blocks)
        for name, strategy in {**STRATEGIES, **BASELINES}.items():
            offsets = strategy(blocks)
            check_offsets(blocks, offsets, arena_bytes(blocks, offsets))
            assert arena_bytes(blocks, offsets) >= bound, name
    plan = plan_memory(ops, bufs)
    verify(plan)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.naive_bytes
    assert plan.single_arena_lower_bound_bytes <= plan.lower_bound_bytes


# ------------------------------------------------------------------ ordering
def peak_of(ops, bufs, order):
    return peak_live_bytes(reorder(ops, order), bufs)


def optimal_peak(ops, bufs):
    producer = {b: i for i, o in enumerate(ops) for b in o.outputs}
    orders = (p for p in itertools.permutations(range(len(ops)))
              if all(p.index(producer[b]) < p.index(i)
                     for i in p for b in ops[i].inputs if b in producer))
    return min(peak_of(ops, bufs, list(p)) for p in orders)


def fan_out(k=3):
    """x feeds k branches, each expand (big) then reduce (small); the given (bad) order
    expands all first."""
    bufs = [Buffer("x", K)] + [Buffer(f"big{j}", 8 * K) for j in range(k)] + \
        [Buffer(f"small{j}", 256) for j in range(k)] + [Buffer("y", 256)]
    ops = [op(0, "x", (), ["x"])]
    ops += [op(1 + j, f"expand{j}", ["x"], [f"big{j}"]) for j in range(k)]
    ops += [op(1 + k + j, f"reduce{j}", [f"big{j}"], [f"small{j}"]) for j in range(k)]
    ops.append(op(1 + 2 * k, "concat", [f"small{j}" for j in range(k)], ["y"]))
    return ops, bufs


def stale_reader():
    """t is read by A and B; once A ran, B frees t. With B's score left stale (it allocates
    more than E), E would run first, while t is still live: the given order."""
    bufs = [Buffer("t", 10 * K), Buffer("a", 256), Buffer("b", 4 * K), Buffer("e", 3 * K),
            Buffer("z", 256)]
    ops = [op(0, "P", (), ["t"]), op(1, "A", ["t"], ["a"]), op(2, "E", ["a"], ["e"]),
           op(3, "B", ["t"], ["b"]), op(4, "Z", ["a", "b", "e"], ["z"])]
    return ops, bufs


@pytest.mark.parametrize("example", [fan_out, stale_reader])
def test_memory_aware_order_beats_the_bad_order(example):
    ops, bufs = example()
    order = memory_aware_order(ops, bufs)
    assert peak_of(ops, bufs, order) < peak_live_bytes(ops, bufs)
    assert peak_of(ops, bufs, order) == optimal_peak(ops, bufs)
    assert improve_order(ops, bufs) == reorder(ops, order)


def test_memory_aware_order_follows_extra_edges():
    ops, bufs = fan_out(2)
    order = memory_aware_order(ops, bufs, after={3: {2}})     # reduce0 after expand1
    assert order.index(2) < order.index(3)
    with pytest.raises(PlanError, match="cycle"):
        memory_aware_order(ops, bufs, after={1: {3}})


def test_pinned_edges_keep_accumulation_before_the_optimizer():
    bufs = [Buffer("g", K, pinned_lifetime=(0, 2)), Buffer("x", K)]
    ops = [op(0, "x", (), ["x"]), op(1, "acc", ["x", "g"], []), op(2, "adam", ["g"], [])]
    assert pinned_edges(ops, bufs) == {2: {1}}
    assert memory_aware_order(ops, bufs, pinned_edges(ops, bufs)) == [0, 1, 2]


@settings(derandomize=True, max_examples=100, deadline=None)
@given(schedules(max_ops=10))
def test_ordering_is_topological_and_never_worse(schedule):
    ops, bufs = schedule
    for defer in (False, True):
        order = memory_aware_order(ops, bufs, defer_allocations=defer)
        position = {b: order.index(i) for i, o in enumerate(ops) for b in o.outputs}
        assert all(position[b] < order.index(i)
                   for i, o in enumerate(ops) for b in o.inputs if b in position)
    better = improve_order(ops, bufs)
    assert peak_live_bytes(better, bufs) <= peak_live_bytes(ops, bufs)
    verify(plan_memory(better, bufs))


# ------------------------------------------------------------------ determinism
def test_same_input_same_plan():
    ops, bufs = fan_out(4)
    first, second = plan_memory(ops, bufs), plan_memory(list(ops), list(bufs))
    assert first.summary() == second.summary() and first.placements == second.placements


SCRIPT = """
import json, sys
sys.path.insert(0, {bench!r})
from memory_plan import synthetic_transformer
from modulec.plan.memory import plan_memory, memory_aware_order, pinned_edges
ops, bufs = synthetic_transformer(2, 256, 512, 64, 1, 4, 1000, 2, kv_heads=2, experts=4, top_k=2)
plan = plan_memory(ops, bufs)
order = memory_aware_order(ops, bufs, pinned_edges(ops, bufs))
print(json.dumps([plan.summary(), {{str(k): p.offset for k, p in plan.placements.items()}}, order]))
"""


def test_plan_is_identical_across_hash_seeds():
    script = SCRIPT.format(bench=str(ROOT / "benchmarks"))
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2", "3")}
    assert len(outputs) == 1 and json.loads(outputs.pop())[0]["arena_bytes"] > 0
