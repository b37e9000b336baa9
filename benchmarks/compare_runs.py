"""Two training runs' losses side by side, step by step (issue 19's FP8 numerics: a run in
FP8 against the same run in bf16, same seed, data and schedule).

    python benchmarks/compare_runs.py RUN_A RUN_B [--after 20] [--tol 0.01] [--every 25]
        [--json out.json]

RUN_A and RUN_B are `modulec train --log-dir` folders (or their metrics.jsonl). For every
step both logged after `--after` (the warmup), the relative difference of B's loss from
A's, |b - a| / |a|, and the same for `eval_loss` where both evaluated. Prints the rows of
every `--every`-th step and of the evaluations, the largest difference of each kind and
whether every one is within `--tol`; exit status 0 when they all are, 1 when one is not,
2 for unreadable input.

Runs logged with `modulec train --log-every K` are compared at their logged steps (the
steps both logged); a record's loss is then its window's mean. Where the two runs' records
of a step average different windows (their `window` field, 1 where absent: e.g. K 10
against K 1), the losses are not comparable: it says which step and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.train.metrics import read_metrics  # noqa: E402


def by_step(records: list[dict], field: str) -> dict[int, float]:
    return {r["step"]: float(r[field]) for r in records
            if isinstance(r.get("step"), int) and isinstance(r.get(field), (int, float))}


def differences(a: dict[int, float], b: dict[int, float], after: int) -> dict[int, tuple]:
    """step -> (a, b, relative difference) on the steps both have, after `after`."""
    return {s: (a[s], b[s], abs(b[s] - a[s]) / abs(a[s]))
            for s in sorted(a.keys() & b.keys()) if s > after and a[s] != 0}


def check_windows(ra: list[dict], rb: list[dict]) -> None:
    """ValueError naming the first step both logged whose records average different
    numbers of steps (`window`, 1 where absent)."""
    wa, wb = ({r["step"]: r.get("window", 1) for r in rs} for rs in (ra, rb))
    for step in sorted(wa.keys() & wb.keys()):
        if wa[step] != wb[step]:
            raise ValueError(f"step {step}: run A's record averages {wa[step]} step(s), "
                             f"run B's {wb[step]} (--log-every differs): the losses are "
                             "not comparable; log both with the same --log-every")


def compare(run_a, run_b, after: int, tol: float) -> dict:
    ra, rb = read_metrics(run_a), read_metrics(run_b)
    check_windows(ra, rb)
    result = {"after": after, "tol": tol}
    for field in ("loss", "eval_loss"):
        diffs = differences(by_step(ra, field), by_step(rb, field), after)
        worst = max(diffs.items(), key=lambda item: item[1][2], default=None)
        result[field] = {"steps": len(diffs), "rows": diffs,
                         "max_rel": worst[1][2] if worst else None,
                         "max_at": worst[0] if worst else None,
                         "within": all(d[2] <= tol for d in diffs.values())}
    result["within"] = result["loss"]["steps"] > 0 and all(
        result[f]["within"] for f in ("loss", "eval_loss"))
    return result


def table(result: dict, every: int, names: tuple[str, str]) -> str:
    lines = [f"{'step':>6} {'kind':<9} {names[0]:>10} {names[1]:>10} {'rel diff':>9}"]
    rows = [(s, "loss", r) for s, r in result["loss"]["rows"].items() if s % every == 0]
    rows += [(s, "eval_loss", r) for s, r in result["eval_loss"]["rows"].items()]
    for step, kind, (a, b, rel) in sorted(rows):
        lines.append(f"{step:>6} {kind:<9} {a:>10.4f} {b:>10.4f} {rel:>8.2%}")
    for field in ("loss", "eval_loss"):
        f = result[field]
        if f["steps"]:
            lines.append(f"{field}: {f['steps']} steps after step {result['after']}, largest "
                         f"difference {f['max_rel']:.2%} at step {f['max_at']}")
    verdict = "within" if result["within"] else "NOT within"
    lines.append(f"every logged step after warmup {verdict} {result['tol']:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--after", type=int, default=20, help="the warmup steps left out")
    parser.add_argument("--tol", type=float, default=0.01)
    parser.add_argument("--every", type=int, default=25, help="print every N-th step")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args(argv)
    try:
        result = compare(args.run_a, args.run_b, args.after, args.tol)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result, args.every, (Path(args.run_a).name, Path(args.run_b).name)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["within"] else 1


if __name__ == "__main__":
    sys.exit(main())
