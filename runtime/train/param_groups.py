"""Each parameter's optimizer settings, read from the built program: one pure reading,
for the CPU trainer (runtime.train.backends) and the GPU step alike.

The program carries them in `metadata.training` (modulec.lower.training_settings,
docs/build-output.md): `frozen` (`@frozen`, `@gradient(skip)`: no gradient, no optimizer
state) and, by parameter path, `@trainable(lr_scale=, wd_scale=, grad_clip=)`. A LoRA
program (`metadata.lora`) also freezes every parameter but the adapters.
"""

from __future__ import annotations

import torch
from torch import Tensor


def frozen_parameters(program) -> set[str]:
    """The parameter paths a trainer does not train (nor keeps optimizer state for)."""
    metadata = program.metadata
    frozen = set(metadata.get("training", {}).get("frozen", ()))
    if metadata.get("lora"):
        from modulec.lower.lora import is_adapter
        from runtime.model import parameter_shapes

        frozen |= {p for p in parameter_shapes(program.graph) if not is_adapter(p)}
    return frozen


def hyperparameters(program, path: str, base) -> tuple[float, float, float | None]:
    """(learning rate, weight decay, gradient clip) of parameter `path`: the base
    optimizer's `lr` and `weight_decay` times the parameter's `lr_scale` and `wd_scale`,
    and its `grad_clip` (None: not clipped), the largest L2 norm its gradient may have
    (`clip_gradient`). A tied parameter's settings are its owner's (the path trained)."""
    settings = program.metadata.get("training", {}).get("parameters", {}).get(path, {})
    return (base.lr * settings.get("lr_scale", 1.0),
            base.weight_decay * settings.get("wd_scale", 1.0),
            settings.get("grad_clip"))


@torch.no_grad()
def clip_gradient(grad: Tensor, clip: float | None) -> Tensor:
    """`grad` scaled down to L2 norm `clip` when its norm is larger (per parameter, as
    torch.nn.utils.clip_grad_norm_ does for one parameter); unchanged otherwise. No host
    sync (the GPU step captures it in its CUDA graph): the factor clip / max(norm, clip)
    is exactly 1 when the norm is within the clip."""
    if clip is None:
        return grad
    norm = grad.double().norm()
    return grad * (clip / torch.clamp(norm, min=clip)).to(grad.dtype)
