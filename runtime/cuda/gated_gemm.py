"""SwiGLU in the GEMMs' epilogues: the three GEMMs the step's gated MLP path runs
(runtime/cuda/gated_mlp.py), from a provider chosen once per device.

The gated epilogues pair adjacent output columns, so gu = [x | t] [W_gate ; W_up]^T comes
out interleaved (g0, u0, g1, u1, ...), as does its gradient d_gu. Each provider computes:

- `act(a, w, gu, h)`: gu = a w_il^T (w's [gate; up] rows read interleaved in place, so the
  frozen weight is not laid again) and h = silu(g) * u from the fp32 accumulator;
- `dact(a, b, gu, d_gu, h)`: d_h = a b, then d_g, d_u from gu (interleaved, bf16) into
  d_gu (interleaved); h = silu(g) * u again (the epilogue always stores it);
- `mm_rows_interleaved(d_gu, w, out)`: out = d_gu w_il (w's rows read interleaved).

Providers: `quack` (quack-kernels' `gemm_act` / `gemm_dact` / `gemm` with
`concat_layout=("B",)`: CuTe DSL kernels for SM90 / SM100, an optional dependency) and
`torch` (the same math in fp32 with torch ops, for CPU tests of the step's wiring).
MODULEC_GATED_GEMM: `0` none (the step runs cuBLAS + our swiglu kernels), `torch`, or
`1` (default): quack where it imports on an SM90 / SM100 device, else none.
quack tunes each problem on its first call (the step's warm-up); MODULEC_GATED_GEMM_TUNED=0
takes its default configurations instead, which made the LoRA 8B step 1.8 ms slower than
cuBLAS + our kernels on an H200 where tuned ones made it 2.8 ms faster (decisions.md).
`summary()` says which ran (the step's notes, the benchmarks' logs)."""

from __future__ import annotations

import collections
import os

import torch


def interleaved(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """[first; second] halves along `dim` as (first_0, second_0, first_1, ...), a copy."""
    halves = t.unflatten(dim, (2, t.shape[dim] // 2))
    return halves.transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def deinterleaved(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The inverse of `interleaved`, a copy."""
    pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
    return pairs.transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


class TorchGated:
    """The epilogues' math with torch ops in fp32, rounded once (CPU tests)."""

    name = "torch"

    def act(self, a, w, gu, h) -> None:
        _used[self.name] += 1
        acc = a.float() @ interleaved(w).float().t()
        gu.copy_(acc)
        g, u = acc[:, 0::2], acc[:, 1::2]
        h.copy_(torch.nn.functional.silu(g) * u)

    def dact(self, a, b, gu, d_gu, h) -> None:
        d_h = a.float() @ b.float()
        g, u = gu[:, 0::2].float(), gu[:, 1::2].float()
        sig = torch.sigmoid(g)
        d_gu[:, 0::2] = d_h * u * sig * (1 + g * (1 - sig))
        d_gu[:, 1::2] = d_h * g * sig
        h.copy_(g * sig * u)

    def mm_rows_interleaved(self, d_gu, w, out) -> None:
        out.copy_(d_gu.float() @ interleaved(w).float())


class QuackGated:
    """quack's gated GEMMs (its operands 3-D: `concat_layout` wants a batch mode)."""

    name = "quack"

    def __init__(self, gemm_act, gemm_dact, gemm, tuned: bool):
        self._act, self._dact, self._gemm, self.tuned = gemm_act, gemm_dact, gemm, tuned

    def act(self, a, w, gu, h) -> None:
        _used[self.name] += 1
        self._act(a.unsqueeze(0), w.t().unsqueeze(0), activation="swiglu",
                  preact_out=gu.unsqueeze(0), postact_out=h.unsqueeze(0),
                  concat_layout=("B",), tuned=self.tuned)

    def dact(self, a, b, gu, d_gu, h) -> None:
        self._dact(a, b, gu, activation="swiglu", dx_out=d_gu, postact_out=h,
                   tuned=self.tuned)

    def mm_rows_interleaved(self, d_gu, w, out) -> None:
        self._gemm(d_gu.unsqueeze(0), w.unsqueeze(0), out=out.unsqueeze(0),
                   concat_layout=("B",), tuned=self.tuned)


_used: collections.Counter = collections.Counter()  # provider name -> forward calls
_chosen: dict = {}  # (switch, device type, capability) -> provider or None
_why: dict = {}  # the same key -> why quack is not used (`summary`)


def provider(device: torch.device):
    """The gated GEMMs' provider for tensors on `device`, or None (the step's usual
    path). Chosen once per switch value and device kind."""
    key = _key(device)
    if key not in _chosen:
        _chosen[key] = _choose(key[0], key[2], key)
    return _chosen[key]


def refuse(device: torch.device, error: Exception) -> None:
    """The provider raised on a call (a layout it does not take): the step's usual path
    from here on for `device`, said once on stderr and kept for `summary`."""
    import sys

    key = _key(device)
    _chosen[key] = None
    _why[key] = f"the gated GEMM raised {type(error).__name__}: {error}"
    print(f"modulec: SwiGLU's gated GEMMs off ({_why[key][:300]}); the step runs cuBLAS "
          f"and its swiglu kernels", file=sys.stderr)


def _key(device: torch.device) -> tuple:
    """(the switch's value, the device's type, its compute capability or None)."""
    cuda = device.type == "cuda"
    return (os.environ.get("MODULEC_GATED_GEMM", "1"), device.type,
            torch.cuda.get_device_capability(device) if cuda else None)


def _choose(switch: str, capability, key):
    if switch == "0":
        _why[key] = "MODULEC_GATED_GEMM=0"
        return None
    if switch == "torch":
        return TorchGated()
    if capability is None or capability[0] not in (9, 10):
        _why[key] = "quack's gated GEMMs run on SM90 / SM100 devices"
        return None
    found = quack_gated()
    if isinstance(found, str):
        _why[key] = found
        return None
    return QuackGated(*found, tuned=os.environ.get("MODULEC_GATED_GEMM_TUNED", "1") != "0")


def summary() -> str | None:
    """One line on the gated GEMMs this process ran (their forward calls, made while steps
    ran eagerly or were captured), or why a step with the pattern did not run them; None
    where no step asked."""
    if _used:
        return "SwiGLU in the GEMMs' epilogues: " + ", ".join(
            f"{name} ({calls} forward calls)" for name, calls in sorted(_used.items()))
    reasons = sorted(set(_why.values()))
    return f"SwiGLU's gated GEMMs not run: {'; '.join(reasons)}" if reasons else None


def quack_gated():
    """quack's (gemm_act, gemm_dact, gemm), or the reason they do not import."""
    try:
        from quack.gemm_interface import gemm, gemm_act, gemm_dact
        from quack.gemm_runtime import identity
    except Exception as error:  # an optional package: any import failure is a reason
        return f"quack-kernels does not import ({type(error).__name__}: {error})"
    _key_opaque_globals(identity)
    return gemm_act, gemm_dact, gemm


def _key_opaque_globals(identity) -> None:
    """quack 0.6.5 keys its compiled epilogues by the globals the epilogue's Python reaches
    and refuses a value it has no key for; with nvidia-cutlass-dsl 4.8.1 that is a
    ContextVar of cutlass's op helpers, which does not change the traced math. Such values
    get their type as the key (a shim for that pair of versions; idempotent)."""
    original = identity.semantic_value_key
    if getattr(original, "modulec_shim", False):
        return

    def key(value, seen):
        try:
            return original(value, seen)
        except TypeError:
            return ("opaque", type(value).__module__, type(value).__qualname__)
    key.modulec_shim = True
    identity.semantic_value_key = key
