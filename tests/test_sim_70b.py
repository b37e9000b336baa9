"""benchmarks/sim_70b.py: the simulated step adds up as docs/distributed.md states it."""

import importlib.util
import json
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
    # the reduce-scatter overlaps the backward but is paid all the same (measured)
    assert r["dp_exposed_ms"] == pytest.approx(r["dp_reduce_scatter_ms"] + r["dp_all_gather_ms"]
                                               + 2 * (4 + 3) * 0.11)
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


def test_a_cut_on_one_node_adds_up(sim):
    """The 70B stack cut to N layers on TP 4 (issue 20): 2 all-reduces forward and 2
    backward per layer of B x T x d bf16, and the vocab-parallel embedding's sum and the
    head input's gradient, timed as rings; the step their sum with the cost model's
    compute and AdamW; more layers, a longer step."""
    cuts = {n: sim.predict_cut(sim.Cut(layers=n, tp=4, batch=1, seq=256, zero=0))
            for n in (1, 2)}
    for n, r in cuts.items():
        assert r["tp_all_reduces"] == 4 * n + 2
        assert r["tp_bytes"] == (4 * n + 2) * 1 * 256 * 8192 * 2
        assert r["tp_ms"] == pytest.approx(  # at the measured share of NVLink (0.3)
            sim.all_reduce_s(r["tp_bytes"], 4, 450e9 * sim.TP_EFFICIENCY) * 1e3)
        assert r["loss_ms"] == pytest.approx(256 * 128256 // 4 * 4 / (0.5 * 3.35e12) * 1e3)
        # the backward's 2 a layer + the head's are overlapped (tp_overlap): at most their
        # half of the ring time hides, behind the weight gradients' GEMMs
        assert 0 < r["tp_hideable_ms"] <= r["tp_ms"] / 2 + 1e-9
        assert r["step_s"] * 1e3 == pytest.approx(
            r["compute_forward_ms"] + r["compute_backward_ms"] + r["tp_ms"] +
            r["dp_ms"] + r["loss_ms"] + r["adamw_ms"])
        assert r["tokens_per_step"] == 256 and r["cut"]["gpus"] == 4
    assert cuts[2]["step_s"] > cuts[1]["step_s"]
    assert cuts[2]["compute_backward_ms"] > cuts[1]["compute_backward_ms"]
    # a rank holds a quarter of each layer's matmuls, of the embedding and of the head
    per_layer = cuts[2]["parameters_per_rank"] - cuts[1]["parameters_per_rank"]
    assert per_layer == (8192 * 80 * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672) // 4 + 2 * 8192
    assert cuts[1]["parameters_per_rank"] - per_layer == 2 * 128256 * 8192 // 4 + 8192


def test_a_cut_on_h200_and_under_data_parallel(sim):
    h100 = sim.predict_cut(sim.Cut(layers=1, tp=2, dp=2, zero=1, batch=1, seq=256))
    h200 = sim.predict_cut(sim.Cut(layers=1, tp=2, dp=2, zero=1, batch=1, seq=256,
                                   device="h200"))
    assert h100["adamw_ms"] / h200["adamw_ms"] == pytest.approx(4.8 / 3.35)
    assert h100["tokens_per_step"] == 2 * 256  # a TP pair shares its batch
    # ZeRO 1: the gradients reduce-scattered and the weights all-gathered over DP 2
    grads = 2 * h100["parameters_per_rank"]
    assert h100["dp_backward_ms"] == pytest.approx(2 * sim.ring_half_s(grads, 2, 450e9) * 1e3)
    # hidden or not, the collectives cost their ring time + 0.11 ms each: 2 a bucket, one
    # bucket a layer and 3 for the entry parameters (embedding, final norm, LM head)
    assert h100["dp_ms"] == pytest.approx(h100["dp_backward_ms"] + 2 * (1 + 3) * 0.11)
    with pytest.raises(ValueError, match="more than the 8 GPUs"):
        sim.predict_cut(sim.Cut(layers=1, tp=8, dp=2))


def test_the_cut_command_line(sim, capsys):
    sim.main(["--layers", "1", "--tp", "4", "--dp", "1", "--pp", "1", "--batch", "1",
              "--seq", "128", "--device", "h200", "--zero", "0"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("llama3-70b cut to 1 layers")
    result = json.loads(lines[-1])
    assert result["cut"]["device"] == "h200" and result["tp_all_reduces"] == 4 + 2
    with pytest.raises(SystemExit):
        sim.main(["--layers", "2", "--tp", "4", "--pp", "2"])
    sim.main(["--layers", "1", "--tp", "4", "--seq", "128", "--nvlink", "225"])
    slower = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert slower["tp_ms"] == pytest.approx(2 * result["tp_ms"])
