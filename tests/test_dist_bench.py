"""benchmarks/train_step_dist.py on the CPU: the HF DDP and FSDP2 peers run for real on two
gloo processes at a tiny shape, and the JSON carries every field with finite figures;
modulec's DP 2 x TP 2 layout on four (the CPU trainer); the variant names and the layouts
they are refused for; tokens/s of a TP row; the table of the committed GPU runs; the
exposed-communication arithmetic on a hand-made trace."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dist_measure import comm_times, kernel_table  # noqa: E402
from benchmarks.dist_modulec import Layout, parse_variant  # noqa: E402
from benchmarks import train_step_dist  # noqa: E402
from benchmarks.train_step_dist import LLAMA3_70B, SHAPES, derive, table  # noqa: E402

FIELDS = ("step_s", "step_s_min", "step_s_max", "step_s_b2b", "tokens_per_s",
          "tokens_per_s_per_gpu", "peak_bytes", "mfu_989", "scaling", "loss", "gpus")


def run_benchmark(capsys, *args: str) -> str:
    """benchmarks/train_step_dist.py's parent run in this process, its stdout returned; each
    variant is still launched with torchrun, as the script launches it. A parent process of
    its own imported torch and transformers and wrote the checkpoint: ~8 s of CPU of a
    ~30 s test on the 2-core machine (docs/decisions.md, "CI time budget")."""
    with mock.patch.object(sys, "argv", ["train_step_dist.py", *args]):
        train_step_dist.main()  # a failure to start raises (SystemExit from argparse)
    return capsys.readouterr().out


def test_hf_peers_on_gloo(tmp_path, capsys):
    out = tmp_path / "dist.json"
    stdout = run_benchmark(capsys, "--device", "cpu", "--shape", "tiny", "--variants",
                           "hf_ddp,hf_fsdp2", "--steps", "2", "--warmup", "1", "--batch",
                           "2", "--seq", "32", "--timeout", "120", "--json", str(out))
    summary = json.loads(out.read_text())
    assert summary["gpus"] == 2 and summary["batch_per_gpu"] == 2 and summary["seq"] == 32
    for name in ("hf_ddp", "hf_fsdp2"):
        row = summary["variants"][name]
        assert "error" not in row, row
        assert set(FIELDS) <= set(row), sorted(set(FIELDS) - set(row))
        assert row["gpus"] == 2 and math.isfinite(row["loss"]) and 0 < row["loss"] < 10
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 2 * 32 /
                                                                          row["step_s"])
    assert "hf_ddp" in stdout and "tok/s/GPU" in stdout


def test_modulec_dp_x_tp_on_gloo(tmp_path, capsys):
    """DP 2 x TP 2 on four processes: each TP pair trains one batch, so a step is B x T x 2
    tokens; both pairs report the loss of the same model on their own batch."""
    out = tmp_path / "dist.json"
    stdout = run_benchmark(capsys, "--device", "cpu", "--shape", "tiny", "--gpus", "4",
                           "--variants", "modulec_zero1_tp2", "--steps", "2", "--warmup",
                           "1", "--batch", "2", "--seq", "32", "--timeout", "120", "--json",
                           str(out))
    row = json.loads(out.read_text())["variants"]["modulec_zero1_tp2"]
    assert "error" not in row, row
    assert (row["gpus"], row["dp"], row["tp"]) == (4, 2, 2)
    assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10
    assert row["tokens_per_s"] == pytest.approx(2 * 32 * 2 / row["step_s"])
    assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 4)
    assert " 2x2 " in stdout


def test_variant_names_and_the_layouts_refused():
    tiny, shape8b = SHAPES["tiny"], SHAPES["llama3-8b"]
    assert parse_variant("modulec_1gpu_fp8", 4) == Layout(1, fp8=True)
    assert parse_variant("modulec_zero2", 4) == Layout(4, 1, 2)
    assert parse_variant("modulec_zero1_tp2", 4, shape8b) == Layout(4, 2, 1)
    assert parse_variant("modulec_zero1_tp2", 4, shape8b).dp == 2
    assert parse_variant("modulec_zero0_tp4_fp8", 4, LLAMA3_70B) == Layout(4, 4, 0, True)
    assert parse_variant("modulec_zero1_tp2_sp_fp8", 4, shape8b) == Layout(4, 2, 1, True, True)
    # the A/B of the TP backward overlap (--no-tp-overlap)
    assert parse_variant("modulec_zero0_tp2_nooverlap", 2, shape8b) == Layout(2, 2, 0,
                                                                              overlap=False)
    assert parse_variant("modulec_zero1_tp2_sp_nooverlap_fp8", 4, shape8b) == Layout(
        4, 2, 1, True, True, False)
    refused = {"modulec_zero3_tp4": (4, None, "leaves one data-parallel rank"),
               "modulec_zero1_tp3": (4, None, "does not divide the 4 GPUs"),
               "modulec_zero0_tp4": (4, tiny, "num_kv_heads = 2"),
               "modulec_zero1_tp1": (4, None, "plain data parallel"),
               "modulec_zero4": (4, None, "0, 1, 2 or 3"),
               "modulec_zero2": (1, None, "several GPUs"),
               "modulec_tp2": (2, None, "unknown variant"),
               "modulec_zero1_sp": (2, None, "unknown variant"),
               "modulec_zero2_nooverlap": (2, None, "unknown variant")}
    for name, (gpus, shape, why) in refused.items():
        with pytest.raises(ValueError, match=why):
            parse_variant(name, gpus, shape)


def test_tokens_of_a_tensor_parallel_row_count_its_data_parallel_ranks():
    args = SimpleNamespace(batch=4, seq=1000, device="cuda")
    rows = {"modulec_1gpu": {"step_s": 1.0, "gpus": 1, "tp": 1, "dp": 1},
            "modulec_zero2": {"step_s": 1.0, "gpus": 4, "tp": 1, "dp": 4},
            "modulec_zero1_tp2": {"step_s": 1.0, "gpus": 4, "tp": 2, "dp": 2},
            "hf_fsdp2": {"step_s": 2.0, "gpus": 4}}
    derive(rows, args, flops=1.0)
    assert rows["modulec_zero2"]["scaling"] == pytest.approx(1.0)
    assert rows["modulec_zero1_tp2"]["tokens_per_s"] == pytest.approx(8000)
    assert rows["modulec_zero1_tp2"]["scaling"] == pytest.approx(0.5)
    assert rows["modulec_zero1_tp2"]["over_1gpu_s"] is None  # not one GPU's step per rank
    assert rows["modulec_zero2"]["over_1gpu_s"] == pytest.approx(0.0)
    assert rows["hf_fsdp2"]["tokens_per_s"] == pytest.approx(8000)


def test_the_table_of_the_committed_gpu_runs():
    """The table the device scripts grep: each committed run's JSON in today's layout
    (the DPxTP and wall columns; older runs have fewer), printed again, gives the lines of
    its committed table."""
    runs = [run for run in sorted((ROOT / "benchmarks/gpu").glob(
        "results-*train_step_dist-*.json")) if "DPxTP" in run.with_suffix(".txt").read_text()]
    assert len(runs) >= 5
    for run in runs:
        summary = json.loads(run.read_text())
        args = SimpleNamespace(shape=summary["shape"], batch=summary["batch_per_gpu"],
                               seq=summary["seq"], device="cuda")
        lines = table(summary["variants"], args, summary["model"]).splitlines()
        assert run.with_suffix(".txt").read_text().splitlines()[:len(lines)] == lines, run


def test_exposed_communication_arithmetic():
    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa
    trace = [kernel("gemm", 0, 10), kernel("ncclDevKernel_AllReduce", 5, 10),
             kernel("ncclDevKernel_ReduceScatter", 30, 4), kernel("attn", 32, 1),
             {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    total, exposed, seen = comm_times(trace)
    assert (total, seen) == (14, 4)
    assert exposed == 5 + 3  # 10..15 of the all-reduce, 30..32 and 33..34 of the other


def test_kernel_table_splits_busy_time_by_stream():
    def kernel(name, start, dur, stream):
        return {"cat": "kernel", "name": name, "ts": start, "dur": dur,
                "args": {"stream": stream}}

    # two steps: a GEMM on the compute stream, an NCCL kernel half overlapping it
    events = [kernel("gemm", 0, 1000, 7), kernel("ncclReduceScatter", 500, 1000, 20),
              kernel("gemm", 3000, 1000, 7), kernel("ncclReduceScatter", 3500, 1000, 20),
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    table = kernel_table(events, steps=2)
    assert table["span_ms"] == 2.25  # 0 .. 4500 us over two steps
    assert table["any_stream_busy_ms"] == 1.5  # 3000 us of the union over two steps
    assert table["stream_busy_ms"] == {"20": 1.0, "7": 1.0}
    assert table["top"][0] == {"name": "gemm", "ms": 1.0, "calls": 1, "streams": ["7"]}
    assert kernel_table([], steps=1) == {}


def test_the_ratio_over_several_same_run_measurements(tmp_path, capsys):
    """benchmarks/dist_ratio.py on the four committed FA4 runs: each run's ratio, the
    median, and the conservative pairing (the peer's fastest run against our slowest)."""
    from benchmarks.dist_ratio import main

    runs = sorted(str(p) for p in (ROOT / "benchmarks/gpu").glob(
        "results-h100x2-train_step_dist-fa4-d1*.json"))
    assert len(runs) == 4
    out = tmp_path / "ratio.json"
    assert main(runs + ["--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    ratios = [round(r["ratio"], 2) for r in summary["rows"]]
    assert ratios == [1.42, 1.34, 1.5, 1.3]
    assert round(summary["summary"]["median"], 2) == 1.38
    assert round(summary["summary"]["conservative"], 2) == 1.3
    assert main(runs + ["--target", "1.4"]) == 1
    assert main(runs + ["--peer", "hf_ddp"]) == 2
    assert "no hf_ddp row" in capsys.readouterr().err
