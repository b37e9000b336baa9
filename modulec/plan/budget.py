"""Budget planning (issue 4): keep / recompute / swap per activation under a memory budget.

`make_problem` gathers what the scheduler needs from a built Graph IR: the flattened step
and its costs on a device (timeline, cost, devices), user intent and policies per saved
activation (recompute), the fixed regions and transient arenas of the step's memory plan
(from_graph). `plan_budget` runs MuTWO's scheduler (mutwo) and `summary` reports it.
`baseline` evaluates the classic strategies at their own memory: full per-layer
recompute, and Megatron-style selective recompute of the attention core.

Training modes: `full` (every weight trains: gradients and AdamW state for all) and
`lora` (base weights frozen: gradients and optimizer state only for rank-`lora_rank`
adapters on every matmul weight below the entry function, bf16 weights and gradients,
12 bytes of optimizer state per adapter parameter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from modulec.ir.graph import Graph
from modulec.plan.devices import H100, Device
from modulec.plan.fp8_memory import fixed as fp8_fixed
from modulec.plan.from_graph import plan_step
from modulec.plan.memory import GRADIENTS, OPTIMIZER_STATE, TRANSIENT, WEIGHTS
from modulec.plan.mutwo import Schedule, fixed_decisions, schedule
from modulec.plan.recompute import KEEP, RECOMPUTE, SWAP, Intent, Intents, intents
from modulec.plan.simulate import Outcome, evaluate
from modulec.plan.timeline import Step, flatten

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ATTENTION_CORE = ("rope", "qk_norm", "qk_norm_rope", "flash_attention", "contiguous")


@dataclass
class Problem:
    graph: Graph
    step: Step
    device: Device
    training: str
    intents: Intents
    fixed_bytes: dict
    transient_forward: int
    transient_backward: int
    compute_s: float
    candidates: set = field(default_factory=set)
    order: dict = field(default_factory=dict)

    @property
    def forced(self) -> set:
        return self.intents.forced


def parse_size(text: str) -> int:
    """`20GiB`, `512MiB`, `80GB`, `1.5 TiB`, `1000000` (bytes) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(text), re.I)
    if match is None:
        raise ValueError(f"`{text}` is not a size (examples: 20GiB, 512MiB, 80GB)")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").lower()])


def make_problem(graph: Graph, decls: dict | None = None, training: str = "full",
                 device: Device = H100, policies: dict | None = None, binding: int = 3,
                 lora_rank: int = 16, precision: dict | None = None,
                 fp8_held: bool = False, fixed_bytes: dict | None = None) -> Problem:
    """`precision`: the program's metadata `precision` (an FP8 recipe): the buffers the GPU
    step's FP8 GEMMs hold beside the plan join the fixed bytes (modulec.plan.fp8_memory;
    `fp8_held`: with the wgrad's x^T kept from the forward, as a step without a budget or
    recompute decisions keeps it). `fixed_bytes`: the state one rank holds when it is not
    the whole model's (data parallel: modulec.plan.distributed.planner_fixed_bytes)."""
    if training not in ("full", "lora"):
        raise ValueError(f"training mode `{training}`: expected full or lora")
    step = flatten(graph, device, training)
    plan = plan_step(graph)
    saved = step.saved()
    found = intents(step, graph, decls, training, policies, binding) if decls is not None \
        else Intents({k: Intent(None, 7, "") for k in saved})
    for key in saved:  # a replay of its producer would not redo the op that wrote over it
        if step.storages[key].in_place:
            found.by_storage[key] = replace(found.by_storage[key], recomputable=False)
    forward, backward = step.seconds()
    own = dict(fixed_bytes) if fixed_bytes is not None else \
        _fixed(graph, plan, training, lora_rank)
    fixed = own | fp8_fixed(graph, precision, fp8_held)
    problem = Problem(graph, step, device, training, found, fixed,
                      _arena(plan, graph.entry), _arena(plan, graph.backward),
                      forward + backward, set(saved), {k: i for i, k in enumerate(saved)})
    return problem


def _arena(plan, name: str) -> int:
    regions = plan.functions.get(name, {}).get("regions", [])
    return next((r["arena_bytes"] for r in regions if r["region"] == TRANSIENT), 0)


def _fixed(graph: Graph, plan, training: str, rank: int) -> dict:
    fixed = {name: plan.regions[name].arena for name in (WEIGHTS, GRADIENTS, OPTIMIZER_STATE)}
    if training == "lora":
        adapters = _adapter_parameters(graph, plan.invocations, rank)
        fixed[WEIGHTS] += 2 * adapters
        fixed[GRADIENTS] = 2 * adapters
        fixed[OPTIMIZER_STATE] = 12 * adapters
    return fixed


def _adapter_parameters(graph: Graph, invocations: dict, rank: int) -> int:
    total = 0
    for function in graph.functions:
        if function.gradient_of or function.name == graph.entry:
            continue
        for node in function.nodes:
            weight = function.value(node.inputs[1]) if node.target == "matmul" and \
                len(node.inputs) > 1 and node.inputs[1].startswith("param:") else None
            if weight is not None and len(weight.shape) == 2:
                total += invocations.get(function.name, 0) * rank * sum(
                    int(d) for d in weight.shape)
    return total


# ====================================================================== plans
def plan_budget(problem: Problem, budget: int) -> Schedule:
    return schedule(problem, budget)


def no_recompute(problem: Problem) -> Outcome:
    """Everything kept that intent allows to keep (its fixed decisions still apply)."""
    return evaluate(problem, *fixed_decisions(problem))


def ladder(problem: Problem) -> tuple[set, set]:
    """The decisions of the ladder alone, suggestions included (no budget)."""
    recompute, swap = fixed_decisions(problem)
    for key, intent in problem.intents.by_storage.items():
        if intent.kind is None and intent.suggested == RECOMPUTE and intent.recomputable:
            recompute.add(key)
        elif intent.kind is None and intent.suggested == SWAP:
            swap.add(key)
    return recompute, swap


def baseline(problem: Problem, name: str) -> set:
    """Recomputed storages of a classic strategy: `full_layer` (every activation of a
    block, so only the blocks' inputs stay) or `attention_core` (the attention's
    post-projection activations: q/k after RoPE (and QK-norm, or the fused qk_norm_rope)
    where RoPE does not run in place (modulec.plan.in_place), the attention output and its
    log-sum-exp, its contiguous copy; replayed from the kept QKV projection)."""
    step = problem.step
    if name == "full_layer":
        return {k for k in problem.candidates if k[0]}
    if name == "attention_core":
        attention = {op.function for op in step.ops if op.node.target == "flash_attention"}
        return {k for k in problem.candidates if step.storages[k].function in attention
                and step.ops[step.storages[k].producer].node.target in ATTENTION_CORE}
    raise ValueError(f"unknown baseline `{name}`")


# ====================================================================== reports
def summary(problem: Problem, result: Schedule) -> dict:
    outcome = result.outcome
    keep_all = no_recompute(problem)
    own = evaluate(problem, *ladder(problem))
    data = {
        "budget_bytes": result.budget, "feasible": result.feasible,
        "predicted_peak_bytes": outcome.peak_bytes,
        "predicted_overhead_s": outcome.overhead_s,
        "overhead_percent": 100 * outcome.overhead_s / problem.compute_s,
        "recompute_s": outcome.recompute_s, "swap_stall_s": outcome.stall_s,
        "compute_s": problem.compute_s, "training": problem.training,
        "device": problem.device.summary(),
        "no_recompute_peak_bytes": keep_all.peak_bytes,
        "ladder": {"peak_bytes": own.peak_bytes, "overhead_s": own.overhead_s},
        "minimum_peak_bytes": result.minimum_peak,
        "fixed_bytes": dict(problem.fixed_bytes),
        "peak": outcome.peak_at,
        "decisions": decisions(problem, result.recompute, result.swap, outcome),
        "notes": list(problem.intents.notes),
    }
    return data


def decisions(problem: Problem, recompute: set, swap: set, outcome: Outcome) -> dict:
    """Counts and bytes per kind, and per tensor (one row per value of a function)."""
    step = problem.step
    checkpoints = outcome.replays.checkpoints
    kinds = {KEEP: [0, 0], RECOMPUTE: [0, 0], SWAP: [0, 0], "fixed_by_intent": [0, 0]}
    rows: dict = {}
    for key in step.saved():
        storage = step.storages[key]
        kind = KEEP if key in checkpoints else RECOMPUTE if key in recompute else \
            SWAP if key in swap else KEEP
        kinds[kind][0] += 1
        kinds[kind][1] += storage.bytes
        if problem.intents.by_storage[key].kind is not None:
            kinds["fixed_by_intent"][0] += 1
            kinds["fixed_by_intent"][1] += storage.bytes
        module = problem.graph.function(storage.function).module
        names = list(dict.fromkeys(storage.names)) or [key[1]]
        row = rows.setdefault((module, key[1]), {"function": module, "tensor": names[0],
                                                 "views": names[1:],
                                                 "bytes_each": storage.bytes, KEEP: 0,
                                                 RECOMPUTE: 0, SWAP: 0})
        row[kind] += 1
    extra = [k for k in checkpoints if k not in problem.candidates]
    return {**{k: {"count": c, "bytes": b} for k, (c, b) in kinds.items()},
            "implicit_checkpoints": {"count": len(extra),
                                     "bytes": sum(step.storages[k].bytes for k in extra)},
            "replayed_ops": len(outcome.replays.placement),
            "by_tensor": list(rows.values())}
