"""Latency of `modulec check` on a small file, as a user feels it (a fresh process each time).

Runs the `.venv/bin/modulec` console script when present, else `python -m modulec`, 10 times
(`--runs N`), and prints min and median wall time and one JSON line. Target: 0.3 s.
Exit status: 0, unless `modulec check` itself fails on the (valid) file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# as users run it: Python caches the compiled modules (some shells set
# PYTHONDONTWRITEBYTECODE, which makes every run recompile ~170 modules, +0.16 s)
WARM_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TARGET_S = 0.3

SMALL_FILE = '''\
primitive matmul:
  """Matrix multiplication: C = A @ B with optional transpose."""

  params:
    transpose: enum(NN, NT, TN, TT) = NN
    accumulate: bool = false

  forward:
    in: (A: [M, K], B: [K, N])
    out: [M, N]
    impl: kernels.matmul

  backward:
    d_A = matmul(d_C, B, transpose=NT)
    d_B = matmul(A, d_C, transpose=TN)
'''


def command() -> list[str]:
    script = ROOT / ".venv" / "bin" / "modulec"
    return [str(script)] if script.exists() else [sys.executable, "-m", "modulec"]


def run_once(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, env=WARM_ENV, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"check_latency: `{' '.join(argv)}` exited {done.returncode}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--runs", type=int, default=10)
    options.add_argument("file", nargs="?", type=Path, help="file to check (default: built-in)")
    args = options.parse_args(argv)

    with tempfile.TemporaryDirectory() as folder:
        path = args.file or Path(folder) / "small.module"
        if args.file is None:
            path.write_text(SMALL_FILE, encoding="utf-8")
        cmd = command() + ["check", str(path)]
        run_once(cmd)  # warm the OS file cache and the LALR table cache; not counted
        times = [run_once(cmd) for _ in range(max(1, args.runs))]

    best, median = min(times), statistics.median(times)
    print(f"command: {' '.join(cmd[:-1])} <file>   runs: {len(times)}")
    print(f"min {best:.3f} s   median {median:.3f} s   target {TARGET_S} s")
    print(json.dumps({
        "benchmark": "check_latency", "runs": len(times),
        "min_s": round(best, 4), "median_s": round(median, 4),
        "target_s": TARGET_S, "meets_target": median <= TARGET_S,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
