"""CPU check of a budgeted step's memory (issue 6): run the GPU step's interpreter
(`_StepInterpreter`: early release, keep_only_saved, `_kept`) on a tiny llama in float64
on the CPU and compare the storages it holds when the forward ends with the budget
planner's activations alive at the backward's start (modulec.plan.simulate), value by
value. Prints what the runtime holds that the planner counts as released.

    python benchmarks/gpu/budget_held.py [share ...]
"""
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def held_vs_planned(share: float, name: str = "llama"):
    from modulec.plan.simulate import _events, _replay_uses, _timeline
    from runtime.cuda.step import _StepInterpreter, budget_programs
    from runtime.cuda.train_kernels import train_kernels
    from runtime.decisions import Decisions
    from runtime.model import Model
    from runtime_models import TINY, token_inputs

    path, settings = TINY[name]
    model = Model.from_module(path, settings=settings, dtype=torch.float64).init_random(seed=1)
    inputs = token_inputs(model, batch=2, seq=16)
    program, planned, (problem, result) = budget_programs(path, settings, inputs, share,
                                                          derive_written=True)
    decisions = Decisions.from_schedule(planned.document["schedule"])

    # planner: storages alive as the backward starts
    outcome = result.outcome
    windows, _, _, _ = _timeline(problem, outcome.replays)
    uses = _replay_uses(problem.step, outcome.replays, windows)
    events = _events(problem, outcome, uses, windows, set())
    bs = outcome.backward_start
    step = problem.step
    planner = Counter()  # kept (not replayed) storages produced by the backward's start
    for key in problem.candidates | outcome.replays.checkpoints:
        s = step.storages[key]
        if key in outcome.replays.closures:
            continue
        if outcome.start[s.producer] <= bs:
            planner[(s.function.split(".")[-1], "/".join(s.names) or key[1])] += s.bytes // 2
    level = sum(d for t, _, d in sorted(events) if t <= bs)

    # runtime: storages held by the frame tree when the forward ends
    run = _StepInterpreter(planned.graph, model.params, torch.float64, check_finite=False,
                           kernels=train_kernels("cpu"), keep_only_saved=True,
                           decisions=decisions)
    (out,), frame = run.forward([inputs["token_ids"]])
    owners = defaultdict(set)
    sizes = {}
    stack = [frame]
    while stack:
        f = stack.pop()
        stack += f.children.values()
        for v, t in f.env.items():
            if isinstance(t, torch.Tensor) and t.numel() > 1 and any(t.stride()):
                ptr = t.untyped_storage().data_ptr()
                owners[ptr].add((f.function.name.split(".")[-1], v, f.instance))
                sizes[ptr] = t.untyped_storage().nbytes() // 8
    held = Counter()
    for ptr, who in owners.items():
        fn, v, _ = min(who)
        held[(fn, v, tuple(sorted({w[1] for w in who}))[:4])] += sizes[ptr]
    print(f"share {share}: planner activations at backward start {level // 2} elements "
          f"(bf16 bytes/2); runtime holds {sum(held.values())} elements")
    return planner, held, decisions


if __name__ == "__main__":
    for share in [float(s) for s in sys.argv[1:]] or [0.3, 0.05]:
        planner, held, decisions = held_vs_planned(share)
        print(" planner (function, value): elements")
        for k, n in sorted(planner.items()):
            print("   ", k, n)
        print(" runtime (function, value, sharing values): elements")
        for k, n in sorted(held.items()):
            print("   ", k, n)
        print(" recompute decisions:", sorted({(f.split('.')[-1], v) for (f, v) in decisions.table}))
