"""benchmarks/gpu/lora_peers.py on the CPU at the tiny shape: modulec's variant builds its
LoRA program and predicts (its adapters counted against the closed form), a variant that
cannot run (Liger-Kernel needs triton and a GPU) is reported as failed while the run goes
on; the variant names, the speedup arithmetic and the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.lora_peers import (SHAPES, derive, flops_per_token, hf_options,  # noqa: E402
                                       table)
from tests.dist_testing import needs_gpus  # noqa: E402


def adapter_count(shape: dict, rank: int) -> int:
    """r x (in + out) for q, k, v, o, gate, up, down in every layer."""
    d, ff = shape["d_model"], shape["d_ff"]
    kv = d // shape["num_heads"] * shape["num_kv_heads"]
    per_layer = (d + d) * 2 + (d + kv) * 2 + (d + ff) * 3
    return shape["n_layers"] * rank * per_layer


def test_failed_variant_reported_and_modulec_predicts(tmp_path):
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/lora_peers.py"), "--device", "cpu",
           "--shape", "tiny", "--variants", "modulec,hf_peft_liger", "--steps", "1",
           "--warmup", "1", "--seq", "16", "--timeout", "120", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["variants"]
    ours = rows["modulec"]
    assert ours["trained_params"] == adapter_count(SHAPES["tiny"], 16)
    assert ours["fixed_bytes"] < ours["predicted_peak_bytes"] and "skipped" in ours
    assert "error" in rows["hf_peft_liger"]  # no triton / no GPU here
    assert "hf_peft_liger" in done.stdout and "failed:" in done.stdout
    assert (tmp_path / "lora.json.hf_peft_liger.log").exists()


def test_variant_names():
    assert hf_options("hf_peft") == {"compile": None, "liger": False, "ckpt": False}
    assert hf_options("hf_peft_compile_ckpt") == {"compile": "whole", "liger": False,
                                                  "ckpt": True}
    assert hf_options("hf_peft_liger")["liger"]
    for bad in ("hf_lora", "hf_peft_fast", "hf_peft_compile_compilelayers"):
        with pytest.raises(ValueError):
            hf_options(bad)


def test_speedup_against_the_fastest_peer():
    args = type("A", (), {"batch": 1, "seq": 2048, "rank": 16, "alpha": 32.0, "steps": 10,
                          "rounds": 1, "shape": "llama3-8b", "device": "cuda"})()
    gib = 2**30
    rows = {"modulec": {"step_s": 0.1, "peak_bytes": 20 * gib},
            "hf_peft": {"step_s": 0.2, "peak_bytes": 40 * gib},
            "hf_peft_compile": {"step_s": 0.16, "peak_bytes": 32 * gib},
            "hf_peft_liger": {"error": "RuntimeError: boom\n", "oom": False}}
    shape = SHAPES["llama3-8b"]
    derive(rows, args, flops_per_token(shape, 2048))
    assert rows["modulec"]["tokens_per_s"] == pytest.approx(20480)
    assert rows["modulec"]["speedup_vs_best_hf"] == pytest.approx(1.6)
    assert rows["modulec"]["peak_vs_best_hf"] == pytest.approx(20 / 32)
    text = table(rows, args, shape)
    assert "failed: RuntimeError: boom" in text and "1.600x tokens/s at 0.62x" in text


def test_rounds_keep_each_variants_median_round_and_each_rounds_ratio():
    """--rounds: a variant's row is its round of median step time (a failed round left
    out), each round's step time beside it, and modulec gets each round's ratio to that
    round's fastest HF variant."""
    from benchmarks.gpu.lora_peers import combine_rounds

    rounds = [{"modulec": {"step_s": 0.12, "peak_bytes": 1},
               "hf_peft_compile": {"step_s": 0.156}, "hf_peft": {"step_s": 0.22}},
              {"hf_peft": {"step_s": 0.21}, "hf_peft_compile": {"step_s": 0.150},
               "modulec": {"step_s": 0.125, "peak_bytes": 2}},
              {"modulec": {"step_s": 0.121, "peak_bytes": 3},
               "hf_peft_compile": {"error": "boom"}, "hf_peft": {"step_s": 0.20}}]
    rows = combine_rounds(rounds)
    assert rows["modulec"]["step_s"] == 0.121 and rows["modulec"]["peak_bytes"] == 3
    assert rows["modulec"]["step_s_rounds"] == [0.12, 0.125, 0.121]
    assert rows["hf_peft_compile"]["step_s"] == 0.150  # of the two that ran, the lower middle
    assert rows["hf_peft_compile"]["step_s_rounds"] == [0.156, 0.150, None]
    assert rows["modulec"]["speedup_rounds"] == pytest.approx([1.3, 1.2, 0.20 / 0.121])


def test_rounds_on_the_cpu(tmp_path):
    """Two rounds at the tiny shape (the second in reverse order): each variant's log per
    round, the rounds' ratios in the JSON (modulec only predicts on the CPU: none)."""
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/lora_peers.py"), "--device", "cpu",
           "--shape", "tiny", "--variants", "modulec,hf_peft_liger", "--steps", "1",
           "--warmup", "1", "--seq", "16", "--timeout", "120", "--rounds", "2",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["rounds"] == 2 and "error" in summary["variants"]["hf_peft_liger"]
    assert "speedup_rounds" not in summary["variants"]["modulec"]
    for i in (1, 2):
        assert (tmp_path / f"lora.json.hf_peft_liger.round{i}.log").exists()


@needs_gpus(1)
def test_tiny_on_gpu(tmp_path):
    """The GPU code paths at the tiny shape: modulec's captured LoRA step and HF + PEFT
    (peft from .whl/ via benchmarks/gpu/device_env.sh) give full rows, the same count of
    trained parameters and finite losses near ln(vocab)."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/lora_peers.py"), "--shape", "tiny",
           "--variants", "modulec,hf_peft", "--steps", "3", "--warmup", "2",
           "--timeout", "200", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["variants"]
    for name in ("modulec", "hf_peft"):
        row = rows[name]
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["peak_bytes"] > 0
        assert 5.5 < row["loss_first"] < 7.5 and 5.5 < row["loss_last"] < 7.5
    assert rows["modulec"]["trained_params"] == rows["hf_peft"]["trained_params"]

