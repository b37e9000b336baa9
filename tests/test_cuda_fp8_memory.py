"""The FP8 step's memory on a GPU (`-m cuda`; skipped without CUDA): TrainStep.predicted_peak,
which counts the recipe's buffers beside the arena (modulec.plan.fp8_memory: fp8 weights,
the wgrad's x^T kept from the forward, cast buffers, scales), against
torch.cuda.max_memory_allocated over eager and captured steps, with and without a memory
budget; and that every x^T the forward keeps is read by its backward (the count assumes
the backward casts no second one).

Tolerances: the whole FP8 peak within 5% of the prediction (the bf16 step's own
prediction is 0.7% to 2.8% off at the benchmark shapes); the FP8 step's excess over the
bf16 step's peak within 20% of the predicted FP8 buffers, plus 64 MiB for what the
prediction leaves out (cuBLASLt's workspace for torch._scaled_mm, the per-tensor 0-d
scale tensors, the allocator's 512-byte rounding). The numbers are printed (`-s`)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

LLAMA = "std/models/llama.module"
# every FP8 GEMM dim a multiple of 16; big enough that the FP8 buffers (~0.2 GiB) stand
# out of the allocator's and cuBLAS's fixed costs
SHAPE = dict(vocab_size=2048, d_model=1024, n_layers=4, num_heads=16, num_kv_heads=4,
             d_ff=2816, max_seq=1024, eps=1e-5)
B, T = 4, 1024
MIB = 2 ** 20


def _measured(precision, **options):
    """(the step's peak over 2 eager steps, a capture and 3 replays, its prediction, the
    step) for a fresh step of SHAPE; the load's temporaries before the peak is reset."""
    from runtime.cuda.step import TrainStep

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    step = TrainStep.from_module(LLAMA, SHAPE, batch=B, seq=T, derive_written=True,
                                 precision=precision, **options)
    step.init_random(seed=0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (B, T), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(0)).cuda()
    step.set_batch(tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step.capture(warmup=2)
    for _ in range(3):
        loss = step(tokens)
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
    return torch.cuda.max_memory_allocated() - before, step.predicted_peak(), step


def _fp8_bytes(step, held: bool) -> int:
    from modulec.plan.fp8_memory import fp8_memory

    return fp8_memory(step.program.graph,
                      step.program.metadata["precision"]).outside_plan(held)


def test_fp8_peak_is_predicted():
    bf16_peak, bf16_predicted, step = _measured(None)
    del step
    peak, predicted, step = _measured("fp8")
    fp8 = _fp8_bytes(step, step.fp8.casts.keep_transposed)
    print(f"\nbf16: measured {bf16_peak / MIB:.1f} MiB, predicted {bf16_predicted / MIB:.1f}"
          f"\nfp8: measured {peak / MIB:.1f} MiB, predicted {predicted / MIB:.1f} "
          f"(FP8 buffers {fp8 / MIB:.1f}, measured excess {(peak - bf16_peak) / MIB:.1f})")
    assert step.fp8.casts.keep_transposed  # no budget, no decisions: x^T kept
    assert predicted == bf16_predicted + fp8
    assert abs(peak - predicted) <= 0.05 * peak
    assert abs((peak - bf16_peak) - fp8) <= 0.2 * fp8 + 64 * MIB


def test_every_kept_transpose_is_read_by_its_backward():
    """The count takes the backward's wgrad to read the x^T its forward kept (no second
    cast, and the kept one dropped there): the casts' own counts over the eager steps."""
    _, _, step = _measured("fp8")
    counts = step.fp8.casts.counts
    print(f"\ncasts: {counts}")
    assert counts["held"] > 0 and counts["held_read"] == counts["held"]


def test_budgeted_fp8_step_stays_inside_its_budget():
    """A budget halfway between the planner's lowest FP8 peak and its keep-all peak (the
    FP8 buffers counted, no x^T kept): the step plans recompute, predicts at most the
    budget, and its measured peak stays within 5% of it."""
    from modulec.plan.budget import make_problem, no_recompute, plan_budget
    from modulec.plan.devices import device
    from runtime.cuda.step import TrainStep, planner_budget

    program = TrainStep.from_module(LLAMA, SHAPE, batch=B, seq=T, derive_written=True,
                                    precision="fp8").program
    problem = make_problem(program.graph, None, "full", device("h200-noswap"),
                           precision=program.metadata["precision"])
    lowest, keep_all = plan_budget(problem, 0).minimum_peak, no_recompute(problem).peak_bytes
    budget = (lowest + keep_all) // 2 - planner_budget(program, 0)
    del program
    peak, predicted, step = _measured("fp8", memory_budget=budget)
    print(f"\nbudget {budget / MIB:.1f} MiB: measured {peak / MIB:.1f}, predicted "
          f"{predicted / MIB:.1f}")
    assert step.decisions is not None and step.decisions.table
    assert not step.fp8.casts.keep_transposed
    assert predicted <= budget
    assert peak <= 1.05 * budget
