"""Each parameter's optimizer settings, read from the built program: one pure reading,
for the CPU trainer (runtime.train.backends) and the GPU step alike.

The program carries them in `metadata.training` (modulec.lower.training_settings,
docs/build-output.md): `frozen` (`@frozen`, `@gradient(skip)`: no gradient, no optimizer
state) and, by parameter path, `@trainable(lr_scale=, wd_scale=, grad_clip=)`. A LoRA
program (`metadata.lora`) also freezes every parameter but the adapters. Weight decay
leaves out norm weights, biases and embeddings by default (`no_decay`).
"""

from __future__ import annotations

import torch
from torch import Tensor


EMBEDDINGS = ("embedding", "vocab_parallel_embedding")  # tables: no weight decay

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
    (`clip_gradient`). A tied parameter's settings are its owner's (the path trained).
    Without a `wd_scale` of its own, a parameter `no_decay` lists gets no weight decay
    unless `base.decay_all`."""
    settings = program.metadata.get("training", {}).get("parameters", {}).get(path, {})
    return (base.lr * settings.get("lr_scale", 1.0),
            base.weight_decay * decay_scale(program, path, base),
            settings.get("grad_clip"))


def decay_scale(program, path: str, base) -> float:
    """The factor of the base weight decay parameter `path` gets: its `@trainable`
    `wd_scale` where written, else 0 for a `no_decay` parameter (unless
    `base.decay_all`), else 1."""
    settings = program.metadata.get("training", {}).get("parameters", {}).get(path, {})
    if "wd_scale" in settings:
        return settings["wd_scale"]
    if getattr(base, "decay_all", False):
        return 1.0
    return 0.0 if path in no_decay(program) else 1.0


def no_decay(program) -> frozenset[str]:
    """The parameters weight decay leaves out by default (torchtitan, nanoGPT, HF's
    Trainer): those with fewer than 2 dimensions (norm weights and biases), those whose
    name ends in `bias` (`qkv_bias`, a MoE's [experts, d] bias), and the tables an
    `embedding` lookup reads (token and position embeddings; a head tied to the token
    embedding shares its tensor, so its setting). Cached on the program."""
    cached = getattr(program, "_no_decay", None)
    if cached is None:
        cached = frozenset(_no_decay(program.graph))
        object.__setattr__(program, "_no_decay", cached)  # Program is a frozen dataclass
    return cached


def _no_decay(graph) -> set[str]:
    from modulec.ir.graph import function_runs
    from runtime.model import parameter_shapes

    shapes = parameter_shapes(graph)
    out = {p for p, shape in shapes.items()
           if len(shape) < 2 or p.rpartition(".")[2].endswith("bias")}
    for function, prefix in function_runs(graph, graph.function(graph.entry)):
        for node in function.nodes:
            if node.kind == "op" and node.target in EMBEDDINGS and len(node.inputs) > 1 \
                    and node.inputs[1].startswith("param:"):
                name = node.inputs[1][len("param:"):]
                out.add(f"{prefix}.{name}" if prefix else name)
    return out & set(shapes)


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


def lr_scale(program, path: str) -> float:
    """The `@trainable(lr_scale=)` of parameter `path` (1.0 when not set)."""
    settings = program.metadata.get("training", {}).get("parameters", {}).get(path, {})
    return settings.get("lr_scale", 1.0)


CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@torch.no_grad()
def global_norm(grads) -> Tensor:
    """The L2 norm of all `grads` together, computed as torch.nn.utils.clip_grad_norm_
    does (the norm of the per-tensor norms) in fp32 at least, on their device: no host
    sync."""
    grads = list(grads)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    norms = [torch.linalg.vector_norm(g, dtype=dtype) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (norm + 1e-6)): the factor every gradient is multiplied by in
    global gradient-norm clipping (torch.nn.utils.clip_grad_norm_'s), a tensor."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)

