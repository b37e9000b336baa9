"""benchmarks/sim_70b.py: the simulated step adds up as docs/distributed.md states it."""

import importlib.util
import sys

import pytest

from modulec.paths import REPO_DIR


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("sim_70b", REPO_DIR / "benchmarks" /
                                                  "sim_70b.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_70b"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SMALL = dict(n_layers=8, d_model=256, num_heads=8, num_kv_heads=4, d_ff=512,
             vocab_size=1024, head_dim=32)


def test_the_step_is_pipeline_plus_exposed_dp_plus_adamw(sim):
    setup = sim.Setup(nodes=2, gpus_per_node=4, tp=2, pp=2, seq=128, microbatches=8,
                      model=tuple(SMALL.items()))
    r = sim.simulate_step(setup)
    assert setup.dp == 2 and r["setup"]["gpus"] == 8
    assert r["step_s"] * 1e3 == pytest.approx(r["pipeline_ms"] + r["dp_exposed_ms"] +
                                              r["adamw_ms"])
    assert r["tokens_per_step"] == 2 * 8 * 1 * 128
    assert r["bubble_fraction"] >= r["ideal_bubble_fraction"] - 1e-9
    assert [s["layers"] for s in r["stages"]] == [4, 4]
    # the TP all-reduces are on top of the cost model's compute
    assert all(s["forward_ms"] > s["compute_forward_ms"] for s in r["stages"])
    assert 0 < r["mfu"] < 1


def test_parameters_of_llama3_70b(sim):
    assert sim.parameters(sim.Setup()) == pytest.approx(70.55e9, rel=1e-3)


def test_ring_times(sim):
    assert sim.all_reduce_s(450e9, 8, 450e9) == pytest.approx(2 * 7 / 8)
    assert sim.ring_half_s(50e9, 16, 50e9) == pytest.approx(15 / 16)
