"""Reference kernels in torch: every primitive's forward and explicit backward.

`KERNELS[name]` (name = the file name in `std/primitives`) is a `ReferenceKernel` with
`forward(inputs, attrs)` and `backward(inputs, attrs)`; the inputs and outputs follow the
order of the primitive's `forward:` / `backward:` signatures (`forward_inputs`,
`forward_outputs`, `backward_inputs`, `backward_outputs` name them). See `base` for the
calling convention and the dtype policy. The kernels are written from the math of
std/primitives/*.module and docs/decisions.md; none uses torch.autograd (the backward
formulas are the point), so autograd of a forward is an independent check of its backward.

Families: linalg (matmul, batched_matmul, grouped_gemm), norms, activations, attention
(flash_attention, rope, qk_norm, qk_norm_rope), tensor (views and copies), elementwise, reductions,
embedding, moe, mamba, utility (zeros, ones, fill), loss (cross_entropy), comm (tp_copy,
tp_all_reduce; sp_all_gather, sp_reduce_scatter, sp_scatter, sp_gather: torch.distributed), vocab_parallel
(vocab_parallel_embedding, vocab_parallel_cross_entropy: `--tp`'s vocabulary split).
"""

from __future__ import annotations

from runtime.kernels.base import KERNELS, ReferenceKernel
from runtime.kernels import (  # noqa: F401 (each module registers its kernels)
    activations, attention, comm, elementwise, embedding, linalg, loss, mamba, moe, norms,
    reductions, tensor, utility, vocab_parallel,
)

__all__ = ["KERNELS", "ReferenceKernel", "default_attrs"]


def default_attrs(name: str, **given) -> dict:
    """The params of primitive `name` as a kernel reads them: `given` (by name), the
    declared defaults for the rest, as plain Python values (Dim -> int, enum member or
    dtype -> str, int list -> list). A param without default must be given."""
    from modulec.ops.registry import op_table  # the compiler, only here

    rule = op_table()[name]
    unknown = set(given) - {p.name for p in rule.params}
    if unknown:
        raise KeyError(f"{name} has no param(s) {sorted(unknown)}")
    attrs = {}
    for spec in rule.params:
        if spec.name in given:
            attrs[spec.name] = given[spec.name]
        elif spec.has_default:
            attrs[spec.name] = _plain(spec.default)
        else:
            raise KeyError(f"{name} needs its param {spec.name!r}")
    return attrs


def _plain(value):
    from modulec.semantic.consteval import Ident
    from modulec.types.dims import Dim

    if isinstance(value, Dim):
        return value.value
    if isinstance(value, Ident):
        return value.name
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
