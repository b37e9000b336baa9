"""The device scripts' shared shell (benchmarks/gpu/stages.sh): `pack_out` folds more
than the 8 files the device tool brings back from $OUT into one archive, and leaves 8 or
fewer alone; `run_stages` refuses an unknown stage before running any."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "stages.sh"


def _bash(script: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'OUT="{out}"; source "{STAGES}"; {script}'],
                          capture_output=True, text=True, timeout=60)


def test_more_than_eight_files_are_packed_into_one_archive(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for k in range(9):
        (out / f"f{k}.txt").write_text(f"log {k}\n")
    (out / "sub" / "deep.json").write_text("{}")
    done = _bash("pack_out", out)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in out.iterdir()] == ["logs.tgz"]  # the files and empty folder gone
    with tarfile.open(out / "logs.tgz") as archive:
        names = sorted(n.lstrip("./") for n in archive.getnames())
        assert names == sorted([f"f{k}.txt" for k in range(9)] + ["sub/deep.json"])
        assert archive.extractfile("./f3.txt").read() == b"log 3\n"


def test_eight_files_come_back_as_they_are(tmp_path):
    for k in range(8):
        (tmp_path / f"f{k}.txt").write_text("x")
    done = _bash("pack_out", tmp_path)
    assert done.returncode == 0 and not (tmp_path / "logs.tgz").exists()
    assert len(list(tmp_path.iterdir())) == 8


def test_run_stages_packs_after_its_stages_unless_told_not_to(tmp_path):
    script = ('stage_many() { for k in $(seq 1 10); do echo $k > "$OUT/s$k.log"; done; }; '
              'run_stages many')
    assert _bash(script, tmp_path).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["logs.tgz"]
    kept = tmp_path / "kept"
    kept.mkdir()
    assert _bash("NO_PACK=1; " + script, kept).returncode == 0
    assert len(list(kept.iterdir())) == 10


def test_an_unknown_stage_stops_before_any_runs(tmp_path):
    done = _bash('stage_a() { touch "$OUT/ran"; }; run_stages a nope', tmp_path)
    assert done.returncode == 2 and "unknown stage 'nope'" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_no_device_script_passes_pytest_a_second_quiet_flag():
    """pyproject's addopts already says `-q`; a second one (-qq) drops pytest's closing
    "N passed, M skipped" line, the count a device call's note reports."""
    import re

    scripts = sorted(STAGES.parent.glob("*.sh"))
    assert scripts
    quiet = [f"{s.name}: {line.strip()}" for s in scripts for line in s.read_text().splitlines()
             if re.search(r"pytest\b.*\s-q\b", line)]
    assert not quiet, quiet
