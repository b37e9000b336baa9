"""benchmarks/compare_runs.py: two runs' losses compared step by step after the warmup."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import compare_runs  # noqa: E402


def write_run(folder: Path, losses: dict, evals: dict) -> Path:
    folder.mkdir()
    lines = []
    for step, loss in losses.items():
        record = {"step": step, "loss": loss, "lr": 1e-3}
        if step in evals:
            record["eval_loss"] = evals[step]
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_within_tolerance_after_warmup_only(tmp_path, capsys):
    a = write_run(tmp_path / "bf16", {1: 10.0, 2: 8.0, 3: 6.0, 4: 5.0}, {4: 5.5})
    # step 1 is 20% off but inside the warmup; later steps are 0.5% off at most
    b = write_run(tmp_path / "fp8", {1: 12.0, 2: 8.04, 3: 6.01, 4: 5.0}, {4: 5.52})
    assert compare_runs.main([str(a), str(b), "--after", "1", "--every", "1"]) == 0
    out = capsys.readouterr().out
    assert "largest difference 0.50% at step 2" in out
    assert "within 1%" in out and "NOT" not in out


def test_one_step_past_tolerance_fails_and_is_named(tmp_path, capsys):
    a = write_run(tmp_path / "a", {1: 10.0, 2: 8.0, 3: 6.0}, {3: 6.0})
    b = write_run(tmp_path / "b", {1: 10.0, 2: 8.0, 3: 6.0}, {3: 6.2})
    out_json = tmp_path / "cmp.json"
    assert compare_runs.main([str(a), str(b), "--after", "0", "--json", str(out_json)]) == 1
    result = json.loads(out_json.read_text())
    assert result["eval_loss"]["max_at"] == 3 and not result["within"]
    assert "NOT within" in capsys.readouterr().out


def test_unreadable_run_is_exit_2(tmp_path, capsys):
    assert compare_runs.main([str(tmp_path / "missing"), str(tmp_path / "other")]) == 2
    assert "error:" in capsys.readouterr().err


def test_windows_of_log_every_compare_and_mismatched_windows_are_exit_2(tmp_path, capsys):
    """--log-every runs compare at their logged steps; records of one step averaging
    different numbers of steps (`window`, 1 where absent) are refused."""
    def windowed(folder, records):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return folder
    a = windowed(tmp_path / "a", [{"step": 2, "loss": 5.0, "window": 2},
                                  {"step": 4, "loss": 4.0, "window": 2},
                                  {"step": 5, "loss": 3.0, "window": 1}])
    b = windowed(tmp_path / "b", [{"step": 2, "loss": 5.0, "window": 2},
                                  {"step": 4, "loss": 4.02, "window": 2},
                                  {"step": 5, "loss": 3.0}])
    assert compare_runs.main([str(a), str(b), "--after", "0", "--every", "1"]) == 0
    assert "3 steps after step 0, largest difference 0.50% at step 4" in \
        capsys.readouterr().out
    each = write_run(tmp_path / "each", {s: 5.0 for s in range(1, 6)}, {})
    assert compare_runs.main([str(a), str(each)]) == 2
    assert "step 2: run A's record averages 2 step(s), run B's 1" in capsys.readouterr().err
