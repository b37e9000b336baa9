"""AdamW for the CPU trainer, with its state in plain dicts by parameter path (so a
checkpoint is the dicts): torch.optim.AdamW's arithmetic, as the GPU's fused kernel.
The settings of a run (`modulec train --lr --beta1 --beta2 --eps --weight-decay
--decay-all --clip-grad`) are this dataclass's fields on both devices; `lr` is the
current step's rate when a schedule runs (runtime.train.schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor


@dataclass
class AdamW:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_all: bool = False  # False: norms, biases, embeddings get none (param_groups)
    clip_grad: float | None = None  # global gradient-norm clipping's largest norm
    step: int = 0
    exp_avg: dict[str, Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor],
               settings: Callable[[str], tuple[float, float]] | None = None,
               scale: Tensor | None = None) -> None:
        """One step on every parameter with a gradient (in place); counts the step.
        `settings(path)`: that parameter's (lr, weight_decay) when not this optimizer's
        (`@trainable`, runtime.train.param_groups); `scale`: a factor every gradient is
        multiplied by first (global clipping's)."""
        self.step += 1
        for path, grad in grads.items():
            param = params[path]
            lr, weight_decay = settings(path) if settings else (self.lr, self.weight_decay)
            if scale is not None:
                grad = grad * scale
            m = self.exp_avg.setdefault(path, torch.zeros_like(param))
            v = self.exp_avg_sq.setdefault(path, torch.zeros_like(param))
            adamw_step_(param, grad, m, v, self.step, lr, self.betas, self.eps, weight_decay)


@torch.no_grad()
def adamw_step_(param: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step of `param` in place (step counts from 1): torch.optim.AdamW's
    arithmetic, shared by the CPU trainer and its data-parallel shards."""
    beta1, beta2 = betas
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    param.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / bias2_sqrt).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bias1)
