"""The kernels `@kernel(name)` (spec §7.5.3) may name, per operation and backend.

The compiler never imports the runtime (nor torch), so the names are data here; the
runtime registers the kernels under `op@name` (runtime/kernel_choice.py) and
tests/test_kernel_choice.py checks that both say the same. Every operation has its
`reference` kernel (runtime/kernels) on both backends: the GPU runs it on GPU tensors.
"""

from __future__ import annotations

REFERENCE = "reference"
BACKEND_NAMES = {"cpu": "CPU reference", "gpu": "GPU"}

# the GPU training step's alternatives (runtime/cuda/attention.py BACKENDS)
GPU_VARIANTS: dict[str, tuple[str, ...]] = {
    "flash_attention": ("cudnn", "cudnn_expand", "flash", "fa4", "fa4_bwd"),
}


def kernel_names(op: str) -> dict[str, tuple[str, ...]]:
    """Backend -> the kernel names `op` can be given."""
    return {"cpu": (REFERENCE,), "gpu": (REFERENCE, *GPU_VARIANTS.get(op, ()))}


def all_kernel_names(ops) -> frozenset[str]:
    return frozenset(name for op in ops for names in kernel_names(op).values()
                     for name in names)


def describe(ops) -> str:
    """`flash_attention`: `reference` (CPU reference, GPU), `cudnn` (GPU), ..."""
    parts = []
    for op in sorted(ops):
        where: dict[str, list[str]] = {}
        for backend, names in kernel_names(op).items():
            for name in names:
                where.setdefault(name, []).append(BACKEND_NAMES[backend])
        listed = ", ".join(f"`{name}` ({', '.join(b)})" for name, b in where.items())
        parts.append(f"`{op}`: {listed}")
    return "; ".join(parts)
