"""What a GPU training step's state costs, and the planner budget that stands for a
memory budget on it: the fixed bytes the step holds (masters, moments, frozen copies,
this rank's share under data parallel), the fixed bytes the budget planner counts, and
their difference (runtime/cuda/step.py TrainStep.from_module plans with it)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from runtime.cuda.param_dtypes import stored_dtypes
from runtime.model import parameter_shapes
from runtime.program import ModuleSource, Program


def frozen_paths(program: Program) -> set[str]:
    """The parameters a step does not train (no master, moments or gradient): `@frozen`
    ones and, with LoRA, all but the adapters (runtime.train.param_groups)."""
    from runtime.train.param_groups import frozen_parameters

    return frozen_parameters(program)


def runtime_fixed_bytes(program: Program, optimizer: str = "auto",
                        clipped: bool = False) -> int:
    """This step's fixed state: with the fused optimizer, the fp32 master split into the
    bf16 compute copy and its int16 low half, plus two fp32 moments (12 bytes per trained
    parameter); optimizer='torch': fp32 master, `.grad` and moments plus the compute copy
    (18); a frozen one (LoRA's base) holds its bf16 compute copy alone (2). Under data
    parallel, this rank's share of the trained ones (rank_fixed_bytes) and ZeRO-3's entry
    buffers held at the peak (entry_buffer_bytes: made in the step, outside the arena, so
    its budget leaves room for them as the planner's does). `clipped` (global
    gradient-norm clipping, one micro-batch a step): the fused step holds every bf16
    gradient to the backward's end (2 bytes a trained parameter), and under ZeRO each
    rank its reduced part of every bucket instance (step_optim.clipped_held_bytes).
    With LoRA on one process, the spare columns and rows the one-GEMM paths lay beside
    and after frozen weights, their d_x's scratches (runtime/cuda/lora_kcat.py) and the
    fused projections' block-diagonal B slots (runtime/cuda/stacked_blocks.py)."""
    frozen = frozen_paths(program)
    shapes = parameter_shapes(program.graph)
    stored = stored_dtypes(program, torch.bfloat16)  # `@dtype(fp32)`: 4 bytes, frozen too
    fixed = sum(math.prod(s) * stored[p].itemsize // 2 for p, s in shapes.items() if p in frozen)
    section = program.document.get("schedule", {}).get("distributed")
    if section is not None:  # data parallel: what this rank holds of the trained ones
        from modulec.plan.distributed import entry_buffer_bytes, rank_fixed_bytes

        from runtime.cuda.step_optim import clipped_held_bytes

        held = clipped_held_bytes(section) if clipped else 0
        return rank_fixed_bytes(section)["total"] + entry_buffer_bytes(section) + \
            fixed * 2 + held
    trained = sum(math.prod(s) for p, s in shapes.items() if p not in frozen)
    held = 2 * trained if clipped and optimizer != "torch" else 0
    sides = 0
    if optimizer != "torch":  # the regions' layout: LoRA's one-GEMM side columns
        from runtime.cuda.lora_kcat import (dx_scratch_bytes, one_gemm_sides,
                                            one_gemm_tails, side_bytes)

        from runtime.cuda.stacked_blocks import block_slot_bytes

        tails = one_gemm_tails(program, shapes, frozen)
        sides = side_bytes(shapes, one_gemm_sides(program, shapes, frozen), tails=tails) + \
            dx_scratch_bytes(program, shapes, tails) + block_slot_bytes(program, shapes)
    return trained * (18 if optimizer == "torch" else 12) + fixed * 2 + held + sides


def planner_fixed_bytes(program: Program) -> int:
    """What the budget planner counts as fixed for full training: its weights, gradients
    and optimizer-state regions (modulec.plan.budget._fixed); under data parallel the
    compiler counts the rank's own (modulec.plan.distributed.planner_fixed_bytes)."""
    from modulec.plan.budget import _fixed
    from modulec.plan.from_graph import plan_step

    section = program.document.get("schedule", {}).get("distributed")
    if section is not None:
        from modulec.plan.distributed import planner_fixed_bytes as rank_planner_fixed

        return sum(rank_planner_fixed(program.graph, section).values())

    return sum(_fixed(program.graph, plan_step(program.graph), "full", 0).values())


def planner_budget(program: Program, budget: int, optimizer: str = "auto",
                   clipped: bool = False) -> int:
    """The planner budget that stands for `budget` bytes on this step: the planner's fixed
    state (fp32 weights and gradients, AdamW moments) differs from this step's (no fp32
    gradients; bf16 compute copies; `clipped`: the gradients global clipping holds), so
    the difference is added. An FP8 recipe's buffers are in neither: the planner's
    problem counts them itself, as the step holds them (modulec.plan.fp8_memory, from the
    program's metadata `precision`; the build plans with them), so they leave the budget's
    room for activations and do not change the difference."""
    return budget + planner_fixed_bytes(program) - runtime_fixed_bytes(program, optimizer,
                                                                       clipped)


def budget_programs(path, settings: dict, inputs: dict, share: float,
                    derive_written: bool = False, device_name: str = "h200-noswap"):
    """(program, budgeted program, planner result) for a budget `share` of the way from
    the planner's lowest reachable peak up to its keep-all peak (tests and diagnostics)."""
    from modulec.lower.build_plan import PlanOptions
    from modulec.plan.budget import make_problem, no_recompute, plan_budget
    from modulec.plan.devices import device

    plain = ModuleSource(Path(path), dict(settings), derive_written=derive_written)
    program = plain.program_for(inputs)
    problem = make_problem(program.graph, None, "full", device(device_name),
                           precision=program.metadata.get("precision"))
    lowest, peak = plan_budget(problem, 0).minimum_peak, no_recompute(problem).peak_bytes
    budget = int(lowest + share * (peak - lowest))
    planned = ModuleSource(Path(path), dict(settings), derive_written=derive_written,
                           planning=PlanOptions(budget=budget, device=device_name))
    return program, planned.program_for(inputs), (problem, plan_budget(problem, budget))
