"""benchmarks/train_step_dist.py on the CPU: the HF DDP and FSDP2 peers run for real on two
gloo processes at a tiny shape, and the JSON carries every field with finite figures; the
exposed-communication arithmetic on a hand-made trace."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_step_dist import comm_times, kernel_table  # noqa: E402

FIELDS = ("step_s", "step_s_min", "step_s_max", "step_s_b2b", "tokens_per_s",
          "tokens_per_s_per_gpu", "peak_bytes", "mfu_989", "scaling", "loss", "gpus")


def test_hf_peers_on_gloo(tmp_path):
    out = tmp_path / "dist.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/train_step_dist.py"), "--device", "cpu",
           "--shape", "tiny", "--variants", "hf_ddp,hf_fsdp2,modulec_tp2", "--steps", "2",
           "--warmup", "1", "--batch", "2", "--seq", "32", "--timeout", "120",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["gpus"] == 2 and summary["batch_per_gpu"] == 2 and summary["seq"] == 32
    for name in ("hf_ddp", "hf_fsdp2"):
        row = summary["variants"][name]
        assert "error" not in row, row
        assert set(FIELDS) <= set(row), sorted(set(FIELDS) - set(row))
        assert row["gpus"] == 2 and math.isfinite(row["loss"]) and 0 < row["loss"] < 10
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 2 * 32 /
                                                                          row["step_s"])
    assert "step_s" not in summary["variants"]["modulec_tp2"]  # unavailable, or CUDA only
    assert "hf_ddp" in done.stdout and "tok/s/GPU" in done.stdout


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
