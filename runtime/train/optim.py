"""AdamW for the CPU trainer, with its state in plain dicts by parameter path (so a
checkpoint is the dicts): torch.optim.AdamW's arithmetic, as the GPU's fused kernel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AdamW:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    step: int = 0
    exp_avg: dict[str, Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor]) -> None:
        """One step on every parameter with a gradient (in place); counts the step."""
        self.step += 1
        beta1, beta2 = self.betas
        bias1 = 1 - beta1 ** self.step
        bias2_sqrt = (1 - beta2 ** self.step) ** 0.5
        for path, grad in grads.items():
            param = params[path]
            m = self.exp_avg.setdefault(path, torch.zeros_like(param))
            v = self.exp_avg_sq.setdefault(path, torch.zeros_like(param))
            param.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            param.addcdiv_(m, denom, value=-self.lr / bias1)
