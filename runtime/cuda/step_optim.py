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
    """The step's sum of squared gradient norms (fp32, on the device), for `grad_norm`.
    A large gradient adds its own; small ones (LoRA's adapters: 14 a layer) are summed in
    batches through one multi-tensor norm (`torch._foreach_norm`) instead of a reduction,
    a square and an add each (448 reductions a step on a LoRA'd Llama-3-8B: ~5 ms). A
    held gradient is one the step owns (a layer's, handed once); `flush` before reading
    `total`. The sum's order differs from one add per gradient: the last bits of
    grad_norm may too; no update reads it (global clipping takes its own norm). A gradient
    in the activations' bytes (`transient`: the LM head's, handed in the transient region
    before the backward reuses it) adds its own at once, as AdamWBatch flushes for it."""

    SMALL = 1 << 20  # elements: a gradient held for a batch (2 MiB in bf16)
    BATCH = 64

    def __init__(self, total: torch.Tensor):
        self.total = total
        self.pending: list = []

    def add(self, grad: torch.Tensor, transient: bool = False) -> None:
        if grad.numel() > self.SMALL or transient:
            self.total.add_(torch.linalg.vector_norm(grad, dtype=torch.float32).square())
            return
        self.pending.append(grad)
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flushed(self) -> torch.Tensor:
        self.flush()
        return self.total

    def discard(self) -> None:
        """Drop the held gradients unread (a step that failed midway)."""
        self.pending = []

    def flush(self) -> None:
        if self.pending:
            norms = torch._foreach_norm(self.pending, 2, dtype=torch.float32)
            self.total.add_(torch.stack(norms).square().sum())
            self.pending = []


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
        self.dtype = None
        self.held = 0

    def add(self, step, path: str, grad: torch.Tensor, scale) -> None:
        """Queue `path`'s update from `grad` (contiguous) times `scale`."""
        from runtime.train.param_groups import decay_scale, lr_scale

        if self.pending and (grad.dtype != self.dtype or scale is not self.scale):
            self.flush(step)
        a = step.adamw
        self.pending.append((step.compute[path], step.lows[path], grad, step.exp_avg[path],
                             step.exp_avg_sq[path], lr_scale(step.program, path),
                             a.weight_decay * decay_scale(step.program, path, a)))
        self.dtype, self.scale = grad.dtype, scale
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
                                      a.betas[0], a.betas[1], a.eps, step.lr_now, self.scale)
        self.pending, self.held = [], 0


def in_activations(step, grad: torch.Tensor) -> bool:
    """`grad` lies in the step's activation arena (bytes a later op may write)."""
    arena = getattr(step, "activations", None)
    return arena is not None and arena._in_arena(grad)
