"""Issue 16 item 1: no cache file is ever loaded, so a planted pickle cannot run."""

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class _Payload:
    """Unpickling this creates the marker file (what an attacker would plant)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(folder: Path, marker: Path) -> None:
    data = pickle.dumps(_Payload(str(marker)))
    for name in ("grammar-0123456789abcdef.lark-cache", "trees/x.pickle"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for cached in ("modulec-lalr/grammar.lark-cache", "modulec-lalr/trees/y.pickle"):
        (folder / cached).parent.mkdir(parents=True, exist_ok=True)
        (folder / cached).write_bytes(data)


def test_planted_pickles_do_not_run_and_check_still_works(tmp_path):
    marker = tmp_path / "PWNED"
    planted = tmp_path / "cache"
    _plant(planted, marker)
    env = dict(os.environ, MODULEC_CACHE_DIR=str(planted), XDG_CACHE_HOME=str(planted))
    done = subprocess.run([sys.executable, "-m", "modulec", "check", "std/"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no problems found" in done.stdout
    assert not marker.exists()


def test_parser_has_no_disk_cache_or_pickle():
    source = (REPO / "modulec" / "syntax" / "parser.py").read_text()
    assert "import pickle" not in source and "cache=" not in source
    offenders = [p for p in (REPO / "modulec").rglob("*.py")
                 if "import pickle" in p.read_text() or "pickle.load" in p.read_text()]
    assert offenders == []
