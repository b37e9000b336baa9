"""One variant's speed against a peer's over several same-run measurements
(`benchmarks/train_step_dist.py --json` files, each one run holding both rows), since a
peer's median step can move more between runs than the ratio's margin: HF FSDP2 +
torch.compile measured 152.7-175.7 ms on one warm two-H100 machine in four runs, modulec's
ZeRO-2 117.3-117.6 (docs/distributed-measured.md).

    python benchmarks/dist_ratio.py RUN.json [RUN.json ...] [--ours modulec_zero2]
        [--peer hf_fsdp2_compile] [--target 1.35] [--json out.json]

Prints each run's step times and ratio (peer step / our step: our speed-up), then the
median ratio, the smallest, and the ratio against the peer's fastest run and our slowest
(the most conservative pairing). Exit status 0 when the median reaches --target, 1 when it
does not, 2 for unreadable input or a run missing either row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def step_ms(run: dict, variant: str, path: str) -> float:
    row = run.get("variants", {}).get(variant)
    if not row or "step_s" not in row:
        raise ValueError(f"{path}: no {variant} row with a step time"
                         + (f" ({row['error']})" if row and "error" in row else ""))
    return 1e3 * row["step_s"]


def pairs(paths: list[str], ours: str, peer: str) -> list[dict]:
    out = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        mine, theirs = step_ms(run, ours, path), step_ms(run, peer, path)
        out.append({"run": path, "ours_ms": mine, "peer_ms": theirs, "ratio": theirs / mine})
    return out


def summary(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows]
    return {"runs": len(rows), "median": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios),
            "conservative": min(r["peer_ms"] for r in rows) / max(r["ours_ms"] for r in rows)}


def report(rows: list[dict], s: dict, ours: str, peer: str, target: float) -> str:
    lines = [f"{'run':48} {ours + ' ms':>18} {peer + ' ms':>22} {'ratio':>7}"]
    lines += [f"{Path(r['run']).name:48} {r['ours_ms']:18.1f} {r['peer_ms']:22.1f} "
              f"{r['ratio']:6.2f}x" for r in rows]
    met = "reaches" if s["median"] >= target else "misses"
    lines.append(f"median {s['median']:.2f}x over {s['runs']} runs ({met} {target:.2f}x); "
                 f"smallest {s['min']:.2f}x, largest {s['max']:.2f}x; the peer's fastest run "
                 f"against our slowest: {s['conservative']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--ours", default="modulec_zero2")
    p.add_argument("--peer", default="hf_fsdp2_compile")
    p.add_argument("--target", type=float, default=1.35)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        rows = pairs(args.runs, args.ours, args.peer)
    except (OSError, ValueError, KeyError) as error:  # JSONDecodeError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    s = summary(rows)
    print(report(rows, s, args.ours, args.peer, args.target))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": s}, indent=2))
    return 0 if s["median"] >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
