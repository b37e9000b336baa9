"""Memory planning (issue 4; docs/spec/planner-refactor-notes.md, "Planner").

Input (`model`): `Op`s in schedule order and the `Buffer`s they read and write, each in a
region (weights, gradients, optimizer state, saved / transient activations, workspace).
`plan_memory` resolves views to their sources, shares storage in place for elementwise
ops whose input dies, and assigns offsets per region with several strategies, keeping the
smallest arena; `verify` re-checks a plan. `ordering` reorders a schedule to lower peak
live bytes (lazy re-score). Independent of the Graph and Schedule IRs: lowering a schedule
to `Op`/`Buffer` lists is all that connects them.
"""

from modulec.plan.memory.lifetimes import Block, Storage, storage
from modulec.plan.memory.model import (
    DEFAULT_ALIGNMENT, GRADIENTS, OPTIMIZER_STATE, REGIONS, SAVED, TRANSIENT, WEIGHTS,
    WORKSPACE, Buffer, Op, PlanError,
)
from modulec.plan.memory.offsets import BASELINES, STRATEGIES, check_offsets, lower_bound
from modulec.plan.memory.ordering import (
    improve_order, memory_aware_order, peak_live_bytes, pinned_edges, reorder,
)
from modulec.plan.memory.plan import MemoryPlan, Placement, RegionPlan, plan_memory, verify

__all__ = [
    "BASELINES", "Block", "Buffer", "DEFAULT_ALIGNMENT", "GRADIENTS", "MemoryPlan",
    "OPTIMIZER_STATE", "Op", "Placement", "PlanError", "REGIONS", "RegionPlan", "SAVED",
    "STRATEGIES", "Storage", "TRANSIENT", "WEIGHTS", "WORKSPACE", "check_offsets",
    "improve_order", "lower_bound", "memory_aware_order", "peak_live_bytes", "pinned_edges",
    "plan_memory", "reorder", "storage", "verify",
]
