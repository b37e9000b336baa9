"""Auxiliary losses: a model's 0-d floating outputs besides its logits (the MoE
load-balancing loss of std Mixtral and Qwen3-MoE, `aux_loss`) are terms of the training
loss. Training adds each to the cross-entropy and seeds its gradient with 1, on the CPU
trainer and in the GPU step (docs/decisions.md, "Auxiliary losses")."""

from __future__ import annotations

import torch
from torch import Tensor


def is_auxiliary(value) -> bool:
    return isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point()


def auxiliary_losses(outputs: dict, main: str) -> dict[str, Tensor]:
    """The auxiliary losses among a forward's outputs (by name), `main` (the logits) left
    out."""
    return {name: value for name, value in outputs.items()
            if name != main and is_auxiliary(value)}


def auxiliary_seeds(others: list) -> tuple[list, Tensor | None]:
    """For the outputs after the logits, in order: each one's gradient seed (1 for an
    auxiliary loss, None for any other output) and the sum of the auxiliary losses (None
    when there is none)."""
    seeds = [torch.ones_like(v) if is_auxiliary(v) else None for v in others]
    losses = [v.float() for v in others if is_auxiliary(v)]
    return seeds, (torch.stack(losses).sum() if losses else None)
