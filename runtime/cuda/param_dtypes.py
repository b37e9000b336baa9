"""`@dtype(fp32)` on a parameter in the GPU step (runtime/cuda/step.py).

A parameter the program stores in fp32 (`@dtype(fp32)`, or declared `[d, fp32]`) while the
step computes in bf16 is held in fp32: its compute copy is its fp32 master (4 bytes, in
the `weights` region's fp32 block; no int16 low half), updated in place by the fused
AdamW kernel's unsplit form (`adamw_step`); the forward and backward read it in fp32 and
its gradient is fp32. Its ops get mixed dtypes, which the custom kernels do not take: they
run the reference kernel (fp32 arithmetic, the output in the first input's dtype, as the
IR types it: modulec/check/calls.py `_by_signature`; the gradient in the parameter's).

Only parameters of one dimension (norm weights, biases, scales) may: a matrix feeds a
matmul, an embedding or the fused LM head, which run in one dtype. Other dtypes (fp16,
fp8, ...) for a bf16 step, tied parameters, and data or tensor parallel runs (ZeRO holds
one dtype) are refused with a RuntimeUserError rather than run in bf16.
"""

from __future__ import annotations

import torch

from runtime.errors import RuntimeUserError


def stored_dtypes(program, compute: torch.dtype) -> dict[str, torch.dtype]:
    """Each parameter's storage dtype in a step computing in `compute` (runtime.model's
    rule: a float32 or float64 step holds everything in that dtype)."""
    from runtime.model import parameter_dtypes

    return parameter_dtypes(program.graph, compute)


def own_dtypes(step) -> dict[str, torch.dtype]:
    """The parameters `step` holds in a dtype of their own (not its compute dtype),
    checked (`refuse`)."""
    if not hasattr(step, "_own_dtypes"):
        own = {p: d for p, d in stored_dtypes(step.program, step.dtype).items()
               if d != step.dtype}
        refuse(step, own)
        step._own_dtypes = own
    return step._own_dtypes


def refuse(step, own: dict) -> None:
    if not own:
        return
    shapes = step.shapes()
    problems = [f"`{p}` is {len(shapes[p])}-d" for p in sorted(own) if len(shapes[p]) != 1]
    problems += [f"`{p}` is {str(d).replace('torch.', '')}" for p, d in sorted(own.items())
                 if d != torch.float32]
    ties = set(step.ties()) | set(step.ties().values())
    problems += [f"`{p}` is tied" for p in sorted(own) if p in ties]
    if step.dist is not None:
        problems.append("the run is data or tensor parallel (its shards hold one dtype)")
    if problems:
        raise RuntimeUserError(
            f"the GPU step holds a parameter in its own dtype (`@dtype(fp32)`) only for "
            f"1-d fp32 parameters on one GPU: {'; '.join(problems[:4])}",
            help=["drop the `@dtype` (the parameter then has a bf16 copy and an fp32 "
                  "master), or train on the CPU (`--device cpu`), which stores it as "
                  "declared"])


def whole_update(step, path: str, grad: torch.Tensor, scale, lr: float, decay: float,
                 norm=None) -> None:
    """One AdamW step of an fp32-stored parameter in place (its compute copy is the
    master): the fused kernel's unsplit form, with the same device lr and scale (and the
    gradient's squares added to `norm` when given)."""
    from runtime.cuda.kernels import _extension

    a = step.adamw
    _extension().adamw_step(step.compute[path], grad.contiguous(), step.exp_avg[path],
                            step.exp_avg_sq[path], None, step.step_count, lr, a.betas[0],
                            a.betas[1], a.eps, decay, step.lr_now, scale, norm)
