"""What `modulec build` asks of the planners: the memory plan (buffers and the activation
layout), and keep / recompute / swap decisions for the Schedule IR.

Decisions come from the budget planner with `--memory-budget` (modulec.plan.budget,
MuTWO's scheduler, as `modulec plan --memory-budget` reports them), and otherwise from
user intent alone: the binding rungs of the §7.2.0 ladder (`@memory`, `@checkpoint`;
with `--honor-lists` the modules' `save:` / `recompute:` lists too). A model with no such
intent keeps everything and costs no planning (the flattened step is never built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.syntax import ast as A
from modulec.syntax.walk import field_names

MEMORY_ANNOTATIONS = ("memory", "checkpoint")


@dataclass
class PlanOptions:
    budget: int | None = None          # bytes; None: no budget
    training: str = "full"             # full | lora
    device: str = "h100"
    policies: dict = field(default_factory=dict)  # pattern -> always | lora_only | never
    honor_lists: bool = False
    # bytes the caller added to its own budget to make `budget` (the planner counts more as
    # fixed than a training step holds): messages subtract it, so they show the user's
    budget_offset: int = 0
    # data parallel: what one rank holds (modulec.plan.distributed.planner_fixed_bytes),
    # counted as fixed in place of the planner's one-GPU estimate
    fixed_bytes: dict | None = None
    # the program's metadata `precision` (an FP8 recipe): the GPU step's FP8 buffers join
    # the fixed bytes (modulec.plan.fp8_memory; under a budget the step keeps no wgrad x^T)
    precision: dict | None = None


class PlanFailure(Exception):
    """The budget cannot be met, or cannot be planned (unsized dims): the message says."""


def plan_for_build(graph, resolver, options: PlanOptions):
    """(memory plan or None, decisions or None); PlanFailure when a budget fails."""
    from modulec.plan.from_graph import ShapeUnknown, plan_step

    try:
        plan = plan_step(graph)
    except ShapeUnknown as exc:
        if options.budget is not None:
            raise PlanFailure(f"--memory-budget needs every size: {exc}") from None
        return None, None
    from modulec.plan.recompute import declarations_of

    decls = declarations_of(resolver)
    if options.budget is None and not options.honor_lists and \
            not _memory_intent(graph, decls):
        return plan, None
    return plan, _decided(graph, decls, options)


def _decided(graph, decls: dict, options: PlanOptions):
    from modulec.lower.decided import decide
    from modulec.plan.budget import make_problem, plan_budget
    from modulec.plan.devices import device
    from modulec.plan.mutwo import fixed_decisions
    from modulec.plan.simulate import evaluate

    problem = make_problem(graph, decls, options.training, device(options.device),
                           options.policies, binding=5 if options.honor_lists else 3,
                           precision=options.precision, fixed_bytes=options.fixed_bytes)
    if options.budget is None:
        recompute, swap = fixed_decisions(problem)
        return decide(problem, recompute, swap, evaluate(problem, recompute, swap))
    result = plan_budget(problem, options.budget)
    if not result.feasible:
        raise PlanFailure(_infeasible(options.budget, result.minimum_peak, problem,
                                      options.budget_offset))
    return decide(problem, result.recompute, result.swap, result.outcome)


def _infeasible(budget: int, lowest: int, problem, offset: int = 0) -> str:
    """In the caller's terms: the planner's budget, peak and fixed bytes less `offset`."""
    from modulec.plan.units import gib_text as gib
    fixed = sum(problem.fixed_bytes.values()) - offset
    # a real option of every caller: `build`/`train --lora`, `lora=` in Python
    hint = (", or train LoRA adapters only (`--lora`, or `lora={}` in Python)"
            if problem.training == "full" else "")
    from modulec.plan.fp8_memory import FP8_FIXED

    fp8 = problem.fixed_bytes.get(FP8_FIXED, 0)
    what = "weights, gradients and optimizer state" + (
        f" with the FP8 step's buffers ({gib(fp8)})" if fp8 else "")
    return (f"the memory budget {gib(budget - offset)} cannot be met: the lowest predicted "
            f"peak is {gib(lowest - offset)} ({what} alone: "
            f"{gib(fixed)}); raise the budget to at least {gib(lowest - offset)}{hint}")


def _memory_intent(graph, decls: dict) -> bool:
    """Whether a module the graph instantiates carries `@memory` or `@checkpoint`: only
    then can user intent change a decision without a budget."""
    modules = {f.module for f in graph.functions}
    return any(_has_annotation(decls[m]) for m in sorted(modules) if m in decls)


def _has_annotation(node) -> bool:
    """Whether the tree under `node` holds a `@memory` or `@checkpoint` (not looking
    inside annotations)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, A.Annotation):
            if node.name in MEMORY_ANNOTATIONS:
                return True
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        else:
            names = field_names(node)
            if names is not None:
                stack.extend(getattr(node, name) for name in names if name != "span")
    return False


# ZeRO-3's extra all-gathers (each layer's weights twice a step), as a share of the step's
# compute: 1.1% measured on two H100s (docs/distributed.md, TinyLlama: 120.0 against 118.7 ms)
ZERO3_GATHER_COST = 0.011


def choose_zero(graph, resolver, options: PlanOptions, sections: dict) -> tuple[int, str]:
    """`--zero auto` under a budget: ZeRO-2, the fastest stage measured, unless only ZeRO-3's
    smaller fixed state fits or it saves more recompute than its gathers cost. `sections`:
    the distributed section of stages 2 and 3. Returns the stage and why, in words."""
    from modulec.plan.budget import make_problem, plan_budget
    from modulec.plan.devices import device
    from modulec.plan.distributed import planner_fixed_bytes
    from modulec.plan.recompute import declarations_of
    from modulec.plan.units import gib_text as gib

    decls, results = declarations_of(resolver), {}
    for zero in (2, 3):
        problem = make_problem(graph, decls, options.training, device(options.device),
                               options.policies, binding=5 if options.honor_lists else 3,
                               precision=options.precision,
                               fixed_bytes=planner_fixed_bytes(graph, sections[zero]))
        results[zero] = plan_budget(problem, options.budget)
    two, three = results[2], results[3]
    budget = gib(options.budget - options.budget_offset)
    if not two.feasible:
        return 3, (f"ZeRO-3 chosen: ZeRO-2's lowest predicted peak "
                   f"{gib(two.minimum_peak - options.budget_offset)} exceeds the budget {budget}")
    saved = _overhead(two) - _overhead(three) if three.feasible else 0.0
    if saved > ZERO3_GATHER_COST * problem.compute_s:
        return 3, (f"ZeRO-3 chosen: its smaller fixed state saves {saved * 1e3:.1f} ms of "
                   f"recompute a step under {budget}, more than its all-gathers cost")
    return 2, (f"ZeRO-2 chosen: it fits {budget} with {_overhead(two) * 1e3:.1f} ms of "
               "recompute and swap stalls; ZeRO-3 would save less than its all-gathers cost")


def _overhead(result) -> float:
    return result.outcome.recompute_s + result.outcome.stall_s
