"""`@kernel(name, fallback=)` (spec §7.5.3) in the runtime: which kernel runs a node.

A registry (a dict op -> kernel) holds its default kernel of each op under the op's name
and any alternative under `op@name` (runtime/cuda/train_kernels.py: the attention
backends); every op's `reference` kernel is runtime.kernels.KERNELS'. A node whose
annotations carry `@kernel("name")` (a derived backward carries its forward op's, so both
run the same kernel) runs that kernel where the registry has it; elsewhere the default,
unless `fallback=false`, which makes the missing kernel an error. The names the compiler
accepts are modulec/ops/kernel_names.py's.
"""

from __future__ import annotations

from runtime.errors import RuntimeUserError

REFERENCE = "reference"


def requested(node) -> tuple[str, bool] | None:
    """(kernel name, fallback) of the node's `@kernel`, or None."""
    args = next((args for name, args in node.annotations if name == "kernel" and args), None)
    if args is None:
        return None
    name = args[0].strip('"')
    fallback = not any(a.replace(" ", "") == "fallback=false" for a in args[1:])
    return name, fallback


def select(kernels: dict, op: str, node, default):
    """The kernel that runs `node` (of primitive `op`): the one its `@kernel` names when
    `kernels` has it, else `default` (an error with `fallback=false`)."""
    choice = requested(node)
    if choice is None:
        return default
    name, fallback = choice
    chosen = kernels.get(f"{op}@{name}")
    if chosen is None and name == REFERENCE:
        from runtime.kernels import KERNELS

        chosen = KERNELS.get(op)
    if chosen is not None:  # pinned: a kernel that may not cover a call says so
        strict = getattr(chosen, "strict", None)
        return chosen if fallback or strict is None else strict(name)
    if fallback:
        return default
    raise RuntimeUserError(f"`@kernel(\"{name}\", fallback=false)`: this backend has no "
                           f"kernel `{name}` for `{op}`; its kernels for it: "
                           f"{', '.join(variants(kernels, op))}")


def variants(kernels: dict, op: str) -> list[str]:
    """The kernel names `kernels` offers for `op` (the reference kernel always)."""
    return [REFERENCE] + sorted(key.split("@", 1)[1] for key in kernels
                                if key.startswith(f"{op}@"))
