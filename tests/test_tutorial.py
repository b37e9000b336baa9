"""docs/tutorial-hf.md runs as written: its python and bash blocks, in order, in a scratch
folder (the `work/` of the tutorial), from the repository root."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial-hf.md"
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.S)


def _blocks():
    return BLOCK.findall(TUTORIAL.read_text(encoding="utf-8"))


def test_the_tutorial_has_the_steps_a_user_follows():
    kinds = [kind for kind, _ in _blocks()]
    assert kinds.count("bash") >= 1 and kinds.count("python") >= 4
    assert any("modulec run" in code and "--backward" in code for _, code in _blocks())


def test_the_tutorial_runs(tmp_path):
    work = ROOT / "work"
    if work.exists():
        pytest.skip("a `work/` folder exists at the repository root; not touching it")
    modulec = Path(sys.executable).with_name("modulec")
    env = os.environ | {"PATH": f"{modulec.parent}{os.pathsep}{os.environ['PATH']}",
                        "PYTHONPATH": str(ROOT)}
    printed = []
    try:
        for index, (kind, code) in enumerate(_blocks()):
            command = [sys.executable, "-c", code] if kind == "python" else \
                ["bash", "-euo", "pipefail", "-c", code]
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"block {index} ({kind}):\n{code}\n{done.stderr}"
            printed.append(done.stdout)
        assert any(re.search(r"^\d+ gradients match$", out, re.M) for out in printed)
        assert "wrote" in "".join(printed)  # modulec run's summary line
    finally:
        shutil.rmtree(work, ignore_errors=True)
