"""Budget planning on Llama-family models (issue 4): a sweep of memory budgets from the
no-recompute peak down to the lowest peak the planner reaches, and MuTWO against the
classic strategies at their own memory.

For each case (model, shape, training mode, device): `modulec build` lowering, then
modulec.plan.budget. The sweep takes ~8 evenly spaced budgets; every row's predicted peak
must be <= its budget (exit status 1 otherwise). The comparison evaluates full per-layer
recompute (keep only each block's inputs) and Megatron-style selective recompute (the
attention core: q/k after RoPE, the attention output and its log-sum-exp, recomputed from
the kept QKV projection) with the same cost model, then plans MuTWO with the budget set
to each one's predicted peak. Prints tables and one JSON line per case.

    python benchmarks/budget_sweep.py [--device h100|h200] [--steps 8] [--case NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.budget import baseline, make_problem, no_recompute, plan_budget
from modulec.plan.devices import device
from modulec.plan.mutwo import prefix
from modulec.plan.recompute import declarations
from modulec.plan.simulate import evaluate

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
TINYLLAMA = {"vocab_size": "32000", "d_model": "2048", "n_layers": "22", "num_heads": "32",
             "num_kv_heads": "4", "d_ff": "5632", "max_seq": "2048"}
CASES = {
    "llama2-7b-lora": ({}, {"B": 1, "T": 4096}, "lora"),
    "tinyllama-full": (TINYLLAMA, {"B": 4, "T": 2048}, "full"),
}
GIB = 2 ** 30


def run_case(name: str, profile, steps: int) -> dict:
    settings, shapes, training = CASES[name]
    graph = build(BuildRequest(LLAMA, settings=settings, shapes=shapes)).graph
    problem = make_problem(graph, declarations(LLAMA), training, profile)
    started = time.perf_counter()
    lowest = plan_budget(problem, 0)
    planning_s = time.perf_counter() - started
    top, bottom = no_recompute(problem).peak_bytes, lowest.minimum_peak
    budgets = [round(top - (top - bottom) * i / (steps - 1)) for i in range(steps)]
    sweep = [_row(problem, prefix(problem, lowest, b)) for b in budgets]
    compare = [_compare(problem, lowest, strategy) for strategy in
               ("full_layer", "attention_core")]
    return {"case": name, "shapes": shapes, "training": training, "device": profile.name,
            "compute_ms": problem.compute_s * 1e3, "planning_s": planning_s,
            "no_recompute_peak_gib": top / GIB, "minimum_peak_gib": bottom / GIB,
            "fixed_gib": sum(problem.fixed_bytes.values()) / GIB,
            "sweep": sweep, "compare": compare}


def _row(problem, result) -> dict:
    outcome = result.outcome
    return {"budget_gib": result.budget / GIB, "peak_gib": outcome.peak_bytes / GIB,
            "feasible": result.feasible and outcome.peak_bytes <= result.budget,
            "overhead_ms": outcome.overhead_s * 1e3,
            "overhead_percent": 100 * outcome.overhead_s / problem.compute_s,
            "recompute": len(result.recompute - outcome.replays.checkpoints),
            "swap": len(result.swap), "stall_ms": outcome.stall_s * 1e3}


def _compare(problem, lowest, strategy: str) -> dict:
    fixed = evaluate(problem, baseline(problem, strategy), set())
    mutwo = prefix(problem, lowest, fixed.peak_bytes)
    return {"strategy": strategy, "peak_gib": fixed.peak_bytes / GIB,
            "overhead_ms": fixed.overhead_s * 1e3,
            "overhead_percent": 100 * fixed.overhead_s / problem.compute_s,
            "mutwo": _row(problem, mutwo)}


def show(result: dict) -> None:
    print(f"\n## {result['case']} {result['shapes']} ({result['training']} training, "
          f"{result['device']}): compute {result['compute_ms']:.1f} ms/step, fixed "
          f"{result['fixed_gib']:.2f} GiB, planned in {result['planning_s']:.1f} s")
    print(f"{'budget GiB':>11} {'peak GiB':>9} {'overhead ms':>12} {'overhead %':>11} "
          f"{'recompute':>10} {'swap':>5} {'stall ms':>9}")
    for row in result["sweep"]:
        print(f"{row['budget_gib']:>11.2f} {row['peak_gib']:>9.2f} {row['overhead_ms']:>12.2f} "
              f"{row['overhead_percent']:>11.1f} {row['recompute']:>10} {row['swap']:>5} "
              f"{row['stall_ms']:>9.2f}")
    print(f"\n{'strategy':<16} {'peak GiB':>9} {'overhead ms':>12} {'%':>6} | "
          f"{'MuTWO peak':>10} {'overhead ms':>12} {'%':>6}")
    for row in result["compare"]:
        m = row["mutwo"]
        print(f"{row['strategy']:<16} {row['peak_gib']:>9.2f} {row['overhead_ms']:>12.2f} "
              f"{row['overhead_percent']:>6.1f} | {m['peak_gib']:>10.2f} "
              f"{m['overhead_ms']:>12.2f} {m['overhead_percent']:>6.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100", choices=("h100", "h200"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    args = parser.parse_args(argv)
    ok = True
    for name in args.case or list(CASES):
        result = run_case(name, device(args.device), args.steps)
        show(result)
        print(json.dumps(result, sort_keys=True))
        ok &= all(r["feasible"] for r in result["sweep"]) and \
            all(r["mutwo"]["feasible"] for r in result["compare"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
