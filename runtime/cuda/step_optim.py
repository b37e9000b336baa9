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
    from runtime.train.param_groups import clip_coefficient, clip_gradient, hyperparameters

    grads = {}
    for path in step.names:
        grad = step.masters[path].grad
        clip = hyperparameters(step.program, path, step.adamw)[2]
        if clip is not None:
            grad.copy_(clip_gradient(grad, clip))
        grads[path] = grad
    step.grad_norm.copy_(step_norm(step, grads))
    grads = list(grads.values())
    if step.adamw.clip_grad is not None:
        scale = clip_coefficient(step.grad_norm, step.adamw.clip_grad).reshape(())
        torch._foreach_mul_(grads, scale)  # a 0-d tensor: no host sync


def step_norm(step, grads: dict) -> torch.Tensor:
    """The global norm of `grads` (by path; a [1] tensor): on one TP rank of a `--tp`
    program the whole model's (runtime/dist/tp_norm.py), on the device."""
    from runtime.train.param_groups import global_norm

    tp = getattr(step.dist, "tp", 1) if step.dist is not None else 1
    if tp == 1 or not grads:
        return global_norm(grads.values()).reshape(1)
    from runtime.dist.tp_norm import tp_global_norm

    return tp_global_norm(grads, step.program, step.dist.tp_group, torch.float32,
                          step.grad_norm.device)


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


class NormSquares:
    """The step's sum of squared gradient norms, for `grad_norm`: every update's AdamW
    kernel adds its gradient's squares to `fused` (a fp64 device scalar: csrc/kernels/
    adamw.cu), so the norm costs no pass of its own over the gradients (a reduction, a
    square and an add a parameter before: ~1.4 ms and ~270 launches a TinyLlama step on
    an H100). The kernels' blocks add in varying order; in fp64 the fp32 norm does not
    see it. No update reads it (global clipping takes its own norm, `step_norm`)."""

    def __init__(self, device):
        self.fused = torch.zeros(1, dtype=torch.float64, device=device)

    def zero(self) -> None:
        """A step starts (on the device: inside a captured graph too)."""
        self.fused.zero_()

    def norm_into(self, out: torch.Tensor) -> None:
        """The norm, sqrt of the sum, into `out` (fp32 [1])."""
        out.copy_(self.fused.sqrt())


class AdamWBatch:
    """The fused AdamW step's small split-master updates gathered and run 16 tensors a
    launch (csrc/bindings_optim.cpp `adamw_split_list`, adamw.cu's list form: the same
    arithmetic, each tensor with its own rate factor and weight decay). LoRA's adapters
    are 14 tensors a layer, each a launch of a few microseconds that moves less than its
    launch costs (448 a step on Llama-3-8B, ~1.5 ms). A gradient handed here is the
    step's own (a parameter gradient gets its own bytes, runtime.arena `place`), held to
    the flush (at most HELD elements of them), but for one in the activations' bytes (the
    LM head's, handed in the transient region before the backward reuses it): that one
    flushes the list at once; the step flushes at the end of its
    optimizer step (nothing reads a parameter after its gradient is final until the next
    forward). A list shares its gradient dtype and `scale` (clipping's factor or None):
    another starts a new list."""

    SMALL = 1 << 20  # elements: larger tensors keep a launch of their own
    LIST = 16  # csrc/kernels/kernels.h kAdamWListMax
    HELD = 1 << 21  # elements of held gradients that flush (4 MiB in bf16)

    def __init__(self):
        self.pending: list = []
        self.scale = None
        self.norm = None
        self.dtype = None
        self.held = 0

    def add(self, step, path: str, grad: torch.Tensor, scale, norm=None) -> None:
        """Queue `path`'s update from `grad` (contiguous) times `scale`; `norm` (a fp64
        device scalar or None) gets the gradient's squares."""
        from runtime.train.param_groups import decay_scale, lr_scale

        if self.pending and (grad.dtype != self.dtype or scale is not self.scale
                             or norm is not self.norm):
            self.flush(step)
        a = step.adamw
        self.pending.append((step.compute[path], step.lows[path], grad, step.exp_avg[path],
                             step.exp_avg_sq[path], lr_scale(step.program, path),
                             a.weight_decay * decay_scale(step.program, path, a)))
        self.dtype, self.scale, self.norm = grad.dtype, scale, norm
        self.held += grad.numel()
        if len(self.pending) >= self.LIST or self.held >= self.HELD or in_activations(step, grad):
            self.flush(step)

    def discard(self) -> None:
        """Drop the queued updates unrun (a step that failed midway: the next step must
        not apply them with gradients whose bytes it has reused)."""
        self.pending, self.held = [], 0

    def flush(self, step) -> None:
        """Run the queued updates (one launch per LIST of them)."""
        if not self.pending:
            return
        from runtime.cuda.kernels import _extension

        hi, lo, grad, m, v, lr, decay = (list(column) for column in zip(*self.pending))
        a = step.adamw
        _extension().adamw_split_list(hi, lo, grad, m, v, step.step_count, lr, decay,
                                      a.betas[0], a.betas[1], a.eps, step.lr_now, self.scale,
                                      self.norm)
        self.pending, self.held = [], 0


def in_activations(step, grad: torch.Tensor) -> bool:
    """`grad` lies in the step's activation arena (bytes a later op may write)."""
    arena = getattr(step, "activations", None)
    return arena is not None and arena._in_arena(grad)
