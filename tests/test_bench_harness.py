"""benchmarks/harness.py, what the step benchmarks share: a fake variant run in a child
process (its JSON row, a crash, a timeout that kills the child's whole session and a
worker in a session of its own, as torchrun starts them), the timing loop on the CPU, the
error rows, the deadline, the command lines, the fixed-width table and the energy reading."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (MIN_VARIANT_S, PEAK, Column, Deadline, add_rates,  # noqa: E402
                                command, forward_args, header, launch, table_rows, timed,
                                variant_row, versus_best)

VARIANT = """
import subprocess, sys, time
from benchmarks.harness import timed, variant_row, write_json

kind, result = sys.argv[1], sys.argv[2]
print("the variant's own output")
if kind == "crash":
    raise RuntimeError("boom in the variant")
if kind.startswith("hang"):  # a worker of its own (as torch.compile starts), then no end;
    # hang_session: the worker in a session of its own, as torchrun starts its workers
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=kind == "hang_session")
    open(result + ".pid", "w").write(str(worker.pid))
    time.sleep(60)
write_json(result, variant_row(lambda: dict(timed(lambda: time.sleep(0.001), 1, 3, "cpu"),
                                            loss=2.5), device="cpu"))
"""


def fake(tmp_path: Path, kind: str, timeout: float = 20) -> tuple[dict, Path]:
    script = tmp_path / "variant.py"
    script.write_text(textwrap.dedent(VARIANT))
    result, log = tmp_path / f"{kind}.json", tmp_path / f"{kind}.log"
    return launch([sys.executable, str(script), kind, str(result)], result, timeout, log), log


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "\nState:\tZ" in status.read_text()


def test_a_variant_in_its_own_process_gives_its_json_row(tmp_path):
    row, log = fake(tmp_path, "ok")
    assert set(row) == {"step_s", "step_s_min", "step_s_max", "loss"}
    assert 0.001 <= row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
    assert "the variant's own output" in log.read_text()


def test_a_crashed_variant_is_an_error_row_with_its_output(tmp_path):
    row, log = fake(tmp_path, "crash")
    assert row["error"].startswith("exit status 1: the variant's own output")
    assert row["error"].strip().splitlines()[-1] == "RuntimeError: boom in the variant"
    assert "Traceback" in log.read_text()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("kind", ["hang", "hang_session"])
def test_past_the_timeout_the_whole_session_is_killed(tmp_path, kind):
    """The worker dies too, in the child's session or in one of its own (torchrun's);
    the latter, left alive, would also hold the output pipe for its 60 s."""
    began = time.perf_counter()
    row, _ = fake(tmp_path, kind, timeout=1.0)
    assert row == {"error": "timed out after 1.0 s"}
    assert time.perf_counter() - began < 10
    worker = int((tmp_path / f"{kind}.json.pid").read_text())
    deadline = time.perf_counter() + 3
    while not gone(worker) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert gone(worker)


def test_error_rows():
    class OutOfMemoryError(RuntimeError):
        pass

    def oom():
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def boom():
        raise ValueError("boom")

    assert variant_row(oom, device="cpu") == {
        "error": "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"}
    with pytest.raises(ValueError):
        variant_row(boom, device="cpu")
    assert variant_row(boom, device="cpu", all_errors=True) == {"error": "ValueError: boom",
                                                                "oom": False}
    assert variant_row(oom, device="cpu", all_errors=True)["oom"]
    assert variant_row(lambda: {"step_s": 1.0}, device="cpu") == {"step_s": 1.0}


def test_timed_on_the_cpu_counts_its_warmup_apart():
    calls = []
    row = timed(lambda: calls.append(1), 2, 5, "cpu")
    assert len(calls) == 7 and row["step_s_min"] <= row["step_s"] <= row["step_s_max"]


def test_forward_args_leaves_unset_ones_out():
    args = type("A", (), {"batch": 4, "hf_steps": 2, "layers": None})()
    assert forward_args(args, "batch", "hf_steps", "layers") == ["--batch", "4",
                                                                  "--hf-steps", "2"]


def test_table():
    columns = [Column("tokens/s", 10, "tokens_per_s", ".0f"),
               Column("peak GiB", 10, "peak_bytes", ".2f", 2**-30),
               Column("MFU989", 8, "mfu_989", ".1%"),
               Column("trained", 9, "trained", ",d"),
               Column("pred", 6, "pred", ".1f", missing="")]
    rows = {"modulec": {"step_s": 0.5, "peak_bytes": 3 * 2**30, "trained": 12345, "pred": 2.0},
            "hf_eager": {"step_s": 1.0},
            "hf_compile": {"error": "Traceback ...\nRuntimeError: " + "x" * 200 + "\n\n"}}
    add_rates(rows, 1000, flops=PEAK / 1000)
    assert rows["modulec"]["tokens_per_s"] == 2000
    assert rows["modulec"]["mfu_989"] == pytest.approx(2.0)
    assert "mfu_gemm" not in rows["modulec"] and "tokens_per_s" not in rows["hf_compile"]
    assert header(columns, 12, notes=True) == \
        "variant       tokens/s  peak GiB  MFU989  trained  pred  notes"
    lines = table_rows(rows, columns, 12, error_width=20, note=lambda name, r: name[:2])
    assert lines == [
        "modulec           2000      3.00  200.0%   12,345   2.0  mo",
        "hf_eager          1000         -  100.0%        -  hf",
        "hf_compile    failed: RuntimeError: xxxxxx"]
    assert versus_best(rows) == ["modulec / best HF (hf_eager): 2.00x"]
    assert versus_best({"modulec": rows["modulec"]}) == []


def test_table_computed_cells_and_rows_not_measured():
    columns = [Column("GPUs", 5, "gpus", "d"),
               Column("DPxTP", 6, "dp", "", value=lambda r: f"{r['dp']}x{r['tp']}"),
               Column("loss", 7, "loss", ".2f")]
    rows = {"zero1_tp2": {"gpus": 4, "dp": 2, "tp": 2, "loss": 1.5},
            "late": {"unavailable": "not run: 12 s left of --deadline 150", "gpus": 4},
            "crash": {"error": "Traceback\nValueError: boom", "gpus": 2}}
    assert table_rows(rows, columns, 10) == ["zero1_tp2     4   2x2   1.50",
                                             "late        not run: 12 s left of --deadline 150",
                                             "crash       failed: ValueError: boom"]
    gpus_first = lambda name, r, why: f"{name:<10}{r['gpus']:>5}  {why}"  # noqa: E731
    assert table_rows(rows, columns, 10, failed=gpus_first)[1:] == [
        "late          4  not run: 12 s left of --deadline 150",
        "crash         2  ValueError: boom"]


def test_deadline_cuts_timeouts_and_refuses_a_short_remainder():
    assert Deadline(None).timeout(900) == 900
    deadline = Deadline(150)
    assert deadline.timeout(100) == 100 and deadline.timeout(None) in (149, 150)
    deadline.began -= 150 - MIN_VARIANT_S - 5  # 25 s left
    assert deadline.timeout(100) in (24, 25)
    deadline.began -= 10  # 15 s left: not started
    assert deadline.timeout(100) is None
    assert deadline.not_run()["unavailable"] in ("not run: 14 s left of --deadline 150",
                                                 "not run: 15 s left of --deadline 150")


def test_command_one_process_or_torchrun():
    assert command("b.py") == [sys.executable, "b.py"]
    assert command("b.py", 4) == [sys.executable, "-m", "torch.distributed.run",
                                  "--standalone", "--nproc-per-node", "4", "b.py"]



@pytest.mark.cuda
def test_timed_peak_and_gemm_ceiling_on_the_gpu():
    """The CUDA-event path: a 1024^2 matmul's step times ordered, its peak memory counted,
    the GEMM ceiling a positive rate."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from benchmarks.harness import gemm_ceiling

    a = torch.randn(1024, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    row = variant_row(lambda: timed(lambda: a @ a, 2, 5))
    assert 0 < row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
    assert row["peak_bytes"] >= 2 * a.numel() * 4
    assert gemm_ceiling(1024) > 1e12


def test_alternated_times_every_side_each_round_and_summarizes_each_side():
    """An A/B's timing loop (benchmarks/harness.py `alternated`, used by gpu/step_ab.py and
    gpu/dist_probe.py --ab; the timed runs faked): each round times every side once, in
    order, so both sides meet the same drift; per side the median, min and max of its
    own times."""
    from benchmarks.harness import alternated, ms_summary

    order, clock = [], iter([5.0, 1.0, 7.0, 2.0, 6.0, 3.0])
    runs = {"0": lambda: order.append("0"), "1": lambda: order.append("1")}
    times = alternated(runs, 3, lambda run: (run(), next(clock))[1])
    assert order == ["0", "1"] * 3
    assert times == {"0": [5.0, 7.0, 6.0], "1": [1.0, 2.0, 3.0]}
    assert ms_summary(times) == {"0": {"median_ms": 6.0, "min_ms": 5.0, "max_ms": 7.0},
                                 "1": {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0}}


def test_paired_change_takes_each_rounds_difference_and_brackets_its_median():
    """An A/B's change replay by replay (benchmarks/harness.py `paired_change`): a drift
    common to both sides (here 10 ms over the rounds, far more than the change) cancels
    in each round's difference; the interval holds the median difference, is as narrow as
    the differences' spread, and is the same for the same times (a fixed seed)."""
    from benchmarks.harness import paired_change

    drift = [0.5 * i for i in range(21)]
    noise = [0.1 * ((7 * i) % 5 - 2) for i in range(21)]  # -0.2 .. +0.2 ms
    times = {"0": [120 + d for d in drift], "1": [119.4 + d + e for d, e in zip(drift, noise)]}
    change = paired_change(times, "0", "1")
    low, high = change["ci95_ms"]
    assert change["median_diff_ms"] == pytest.approx(-0.6)
    assert -0.8 <= low <= -0.6 <= high <= -0.4
    assert paired_change(times, "0", "1") == change
    same = paired_change({"0": times["0"], "1": times["0"]}, "0", "1")
    assert same == {"median_diff_ms": 0.0, "ci95_ms": (0.0, 0.0)}


def test_graph_gaps_counts_idle_time_where_no_stream_runs():
    """benchmarks/gpu/graph_gaps.py: nodes overlapping on two streams are busy once; a gap
    is time where none runs; the last replay starts after the last long idle stretch."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from graph_gaps import last_replay, summarize

    def node(name, ts, dur, cat="kernel"):
        return dict(name=name, ts=ts, dur=dur, cat=cat)
    replay = [node("gemm", 1000, 10), node("nccl", 1005, 20), node("norm", 27, 3),
              node("memset", 40, 1, "gpu_memset")]
    replay[2]["ts"], replay[3]["ts"] = 1027, 1040
    nodes = [node("earlier", 0, 5), *replay]
    assert last_replay(nodes) == replay
    summary = summarize(replay, top=2)
    assert (summary["span_ms"], summary["busy_ms"], summary["gaps_ms"]) == \
        pytest.approx((0.041, 0.029, 0.012))  # busy: 1000-1025, 1027-1030, 1040-1041
    assert summary["gaps"] == 2 and summary["nodes"] == 4
    assert summary["by_category"] == {"kernel": 3, "gpu_memset": 1}
    assert [g["gap_us"] for g in summary["largest"]] == [10.0, 2.0]
    assert summary["largest"][0]["after"] == "norm" and summary["top_names"][0]["name"] == "nccl"


def test_graph_gaps_sums_the_nodes_time_by_kind():
    """graph_gaps.py's `by_kind`: each node counted once, under the first kind its name
    names (cuBLAS's split-K reduce with the GEMMs, cuDNN's attention kernels together,
    LoRA's own kernels, fills and memsets), the largest kind first; unknown names: other."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from graph_gaps import by_kind, kind_of

    names = {"nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN": "gemm",
             "void cublasLt::splitKreduce_kernel<32, 16>": "gemm",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": "attention",
             "void cudnn::fusion::fmha_reduce_head<true>": "attention",
             "void modulec::skinny_nt_backward_kernel<32, true>": "lora",
             "modulec::(anonymous namespace)::finish_kernel(float*)": "lora",
             "void modulec::rms_backward_kernel<bf16, 8>": "norm",
             "void modulec::swiglu_forward_kernel<bf16>": "activation",
             "modulec::fill_kernel(char*)": "fill", "Memset (Device)": "fill",
             "Memcpy DtoD (Device -> Device)": "copy", "void at::native::reduce_kernel": "other"}
    assert {n: kind_of(n) for n in names} == names
    nodes = [dict(name=n, dur=d) for n, d in (
        ("nvjet_a", 600.0), ("nvjet_b", 300.0), ("cudnn_x_sdpa", 250.0),
        ("void modulec::swiglu_backward_kernel", 98.0), ("something", 2.0))]
    assert by_kind(nodes) == {"gemm": {"ms": 0.9, "count": 2},
                              "attention": {"ms": 0.25, "count": 1},
                              "activation": {"ms": 0.098, "count": 1},
                              "other": {"ms": 0.002, "count": 1}}


def test_card_power_reads_the_energy_counter_around_the_block(monkeypatch):
    """card_power reads the card's energy counter (mJ) before and after the block: the
    joules between and the mean power over the block's wall time; with_energy makes a
    step's joules of them. Off the GPU (or without NVML) nothing is measured."""
    import benchmarks.harness as harness

    counter = iter([1_000_000, 1_084_000])  # 84 J
    monkeypatch.setattr(harness, "_energy_counter", lambda: lambda: next(counter))
    with harness.card_power("cuda") as power:
        time.sleep(0.05)
    assert power["joules"] == pytest.approx(84.0)
    assert 0 < power["power_w"] <= 84.0 / 0.05
    row = harness.with_energy({"step_s": 0.12}, power, steps=2)
    assert row["joules_per_step"] == pytest.approx(42.0) and row["power_w"] == power["power_w"]
    with harness.card_power("cpu") as none:
        pass
    assert none == {} and harness.with_energy({"step_s": 0.12}, none, 2) == {"step_s": 0.12}
