"""The optimizer pieces of the GPU step (runtime/cuda/step.py) beside the fused AdamW
kernel: the torch-optimizer path's parameter groups and clipping, and what global
clipping holds in memory (for the budget planner's offset). docs/training.md, "Optimizer";
docs/decisions.md, "Training optimizer"."""

from __future__ import annotations

import torch


def param_groups(step) -> list[dict]:
    """optimizer='torch': a group per (lr_scale, weight decay), each with its own
    device learning rate (`set_lr` writes them; a captured step reads them)."""
    from runtime.train.param_groups import decay_scale, lr_scale

    a, groups = step.adamw, {}
    for path in step.names:
        key = (lr_scale(step.program, path),
               a.weight_decay * decay_scale(step.program, path, a))
        groups.setdefault(key, []).append(step.masters[path])
    return [{"params": params, "weight_decay": wd, "lr_scale": scale,
             "lr": torch.full((), a.lr * scale, dtype=torch.float32, device="cuda")}
            for (scale, wd), params in groups.items()]


def clip_torch_grads(step) -> None:
    """optimizer='torch': `@trainable(grad_clip=)` per parameter, then the global
    norm (kept in `grad_norm`) and, with clip_grad, every gradient scaled by
    min(1, clip / (norm + 1e-6)); all on the device."""
    from runtime.train.param_groups import (clip_coefficient, clip_gradient,
                                            global_norm, hyperparameters)

    grads = []
    for path in step.names:
        grad = step.masters[path].grad
        clip = hyperparameters(step.program, path, step.adamw)[2]
        if clip is not None:
            grad.copy_(clip_gradient(grad, clip))
        grads.append(grad)
    step.grad_norm.copy_(global_norm(grads).reshape(1))
    if step.adamw.clip_grad is not None:
        scale = clip_coefficient(step.grad_norm, step.adamw.clip_grad).reshape(())
        torch._foreach_mul_(grads, scale)  # a 0-d tensor: no host sync


def clipped(options: dict) -> bool:
    """Global clipping holds gradients beyond the step's state: with one micro-batch a
    step (more: the fp32 gradient sums it holds anyway are kept), `TrainStep` options."""
    adamw = options.get("adamw")
    return getattr(adamw, "clip_grad", None) is not None and \
        options.get("accumulation", 1) == 1


def clipped_held_bytes(section: dict) -> int:
    """What a ZeRO rank keeps for global clipping (runtime/dist/zero.py `held`): its part
    of each bucket instance's reduced bf16 gradient (the whole with ZeRO-0)."""
    from modulec.plan.distributed import GRAD_BYTES

    zero = section["zero"]
    return sum(GRAD_BYTES * (b["numel"] if zero == 0 else b["shard"]) * b["instances"]
               for b in section["buckets"])
