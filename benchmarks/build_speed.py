"""`modulec build` of an 80-layer Llama-2-70B-sized model: wall time and IR size.

Target (issue 4): ≤ 1 s on 2 cores, and an IR of a few MB. The Graph IR is hierarchical
(one block function called 80 times), so the work does not grow with the layer count.
Prints a table and one JSON line.

`--chain 1000,2000,4000,8000,16000` instead builds a model whose forward is one chain of
that many silu ops (issue 16: build time linear in graph length) and prints the time per
op at each length; the target is a time per op flat within 2x across the sweep.
"""

from __future__ import annotations

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
MODULEC = ROOT / ".venv" / "bin" / "modulec"
SIZES = ["d_model=8192", "n_layers=80", "num_heads=64", "num_kv_heads=8", "d_ff=28672"]


def run_once(output: Path) -> float:
    command = [str(MODULEC) if MODULEC.exists() else sys.executable, *([] if MODULEC.exists()
               else ["-m", "modulec"]), "build", str(ROOT / "std" / "models" / "llama.module"),
               "-o", str(output), "--shape", "B=1", "--shape", "T=4096"]
    for setting in SIZES:
        command += ["--set", setting]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=WARM_ENV)
    return time.perf_counter() - start


def chain_module(length: int) -> str:
    lines = ["model Chain(d: int = 64):", "  params:", "    w: [d, d]", "  forward:",
             "    in: x: [B, d]", "    out: y: [B, d]", "    graph:",
             "      x -> matmul(w, transpose=NT) -> h0"]
    lines += [f"      h{i} -> silu() -> h{i + 1}" for i in range(length)]
    return "\n".join(lines + [f"      h{length} -> y", ""])


def chain_sweep(lengths: list[int]) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for length in lengths:
            source = Path(folder) / f"chain{length}.module"
            source.write_text(chain_module(length))
            command = [str(MODULEC) if MODULEC.exists() else sys.executable,
                       *([] if MODULEC.exists() else ["-m", "modulec"]), "build", str(source),
                       "-o", str(Path(folder) / "chain.ir"), "--shape", "B=2"]
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, env=WARM_ENV)
            seconds = time.perf_counter() - start
            rows.append({"ops": length, "seconds": round(seconds, 2),
                         "ms_per_op": round(1000 * seconds / length, 3)})
            print(f"{length:>7} ops {seconds:>8.2f} s {rows[-1]['ms_per_op']:>8.3f} ms/op",
                  flush=True)
    per_op = [r["ms_per_op"] for r in rows]
    print(json.dumps({"benchmark": "build_speed_chain", "rows": rows,
                      "spread": round(max(per_op) / min(per_op), 2),
                      "flat_within_2x": max(per_op) <= 2 * min(per_op)}))
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--chain":
        return chain_sweep([int(n) for n in sys.argv[2].split(",")])
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "llama70b.ir"
        run_once(output)  # warm the LALR cache
        times = [run_once(output) for _ in range(5)]
        size = output.stat().st_size
    best, median = min(times), statistics.median(times)
    print(f"{'model':22} {'layers':>6} {'best s':>8} {'median s':>9} {'IR bytes':>10}")
    print(f"{'Llama-2-70B sizes':22} {80:>6} {best:>8.3f} {median:>9.3f} {size:>10}")
    print(json.dumps({"benchmark": "build_speed", "model": "Llama-2-70B", "layers": 80,
                      "best_s": round(best, 3), "median_s": round(median, 3), "ir_bytes": size,
                      "target_s": 1.0, "meets_target": median <= 1.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
