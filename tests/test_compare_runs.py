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
