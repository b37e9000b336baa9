"""benchmarks/kernels/bench_gated_gemm.py's parts that run anywhere: the fp32 references its
checks compare against (SwiGLU's gradient as autograd takes it), and the shim that keys
quack's epilogues (runtime/cuda/gated_gemm.py, which the bench imports; its interleave
helpers are tested in tests/test_gated_mlp.py)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import bench_gated_gemm as bench  # noqa: E402
from runtime.cuda import gated_gemm  # noqa: E402


def test_the_checks_references_are_swiglu_and_its_gradient_as_autograd_takes_them():
    """Outputs made by autograd, ours as [g | u] and quack's interleaved, check at fp32's
    rounding against the harness's references; a wrong gradient does not."""
    tokens, ffn, dim = 4, 8, 6
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(tokens, 2 * ffn, generator=g).to(torch.bfloat16)
    d_h = torch.randn(tokens, ffn, generator=g).to(torch.bfloat16)
    w_dx = torch.randn(2 * ffn, dim, generator=g).to(torch.bfloat16)
    gate, up = gu.float()[:, :ffn].requires_grad_(), gu.float()[:, ffn:].requires_grad_()
    h = torch.nn.functional.silu(gate) * up
    d_gate, d_up = torch.autograd.grad(h, (gate, up), d_h.float())
    d_gu = torch.cat([d_gate, d_up], 1)
    h_wide = torch.zeros(tokens, ffn + 4)  # h rows apart, as the step lays down's input
    h_wide[:, :ffn] = h.detach()
    d_gu_apart = bench.interleaved(d_gu, 1)
    d_gu_apart[0, 0] += 1  # one element off: the bits check must see it
    buf = {"gu": gu, "d_h": d_h, "h": h.detach(), "d_gu": d_gu,
           "q_gu": bench.interleaved(gu, 1), "q_h": h.detach(),
           "q_d_gu": bench.interleaved(d_gu, 1), "q_h_apart": h_wide[:, :ffn],
           "q_d_gu_apart": d_gu_apart,
           "d_x": d_gu @ w_dx.float(), "q_d_x": d_gu @ w_dx.float()}
    checks = bench.errors(buf, ffn, w_dx)
    assert checks["gu_bits_equal"] and checks["h_rows_apart_bits_equal"]
    assert not checks["d_gu_rows_apart_bits_equal"]
    for key in ("h_ours", "h_quack", "d_gu_ours", "d_gu_quack", "d_x_ours", "d_x_quack"):
        assert checks[key] < 1e-5, key
    buf["q_d_gu"] = bench.interleaved(torch.cat([d_up, d_gate], 1), 1)  # halves swapped
    assert bench.errors(buf, ffn, w_dx)["d_gu_quack"] > 0.1


def test_the_shim_keys_what_quacks_key_refuses_by_its_type():
    def refusing(value, seen):
        if isinstance(value, int):
            return ("int", value)
        raise TypeError("no fail-closed semantic key")
    identity = types.SimpleNamespace(semantic_value_key=refusing)
    gated_gemm._key_opaque_globals(identity)
    assert identity.semantic_value_key(3, set()) == ("int", 3)
    assert identity.semantic_value_key(object(), set()) == ("opaque", "builtins", "object")
    shimmed = identity.semantic_value_key
    gated_gemm._key_opaque_globals(identity)  # once: a second call keeps the shim
    assert identity.semantic_value_key is shimmed
