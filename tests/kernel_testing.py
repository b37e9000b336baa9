"""Shared by the reference-kernel tests: float64 random inputs, router-like indices, and a
relative-error comparison that walks lists of tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

F64 = torch.float64
I32 = torch.int32


def randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def randint(g, high, *shape):
    return torch.randint(0, high, shape, generator=g).to(I32)


def topk_indices(g, n, experts, k):
    """Distinct experts per token, as a router picks them."""
    return torch.argsort(torch.rand(n, experts, generator=g), dim=-1)[:, :k].to(I32)


def offsets_of(indices, experts):
    counts = [int((indices == e).sum()) for e in range(experts)]
    return torch.tensor([0] + [sum(counts[:e + 1]) for e in range(experts)], dtype=I32)


def relative_error(a, b) -> float:
    a, b = a.to(F64), b.to(F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale > 0 else diff


def assert_close(got, want, tol, what):
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tol, f"{what}[{i}]")
        return
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    if not want.is_floating_point():
        assert torch.equal(got.to(torch.int64), want.to(torch.int64)), f"{what}: {got} != {want}"
        return
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = relative_error(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.0e}"
