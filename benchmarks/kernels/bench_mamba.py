"""Time mamba_selective_scan and mamba_conv1d on the GPU at a mamba-130m layer's shape
(d_model 768, expand 2: 1536 channels, d_state 16, conv kernel 4, T 2048; --batch 2),
bf16 I/O, forward and forward + backward:

    modulec       csrc/kernels/mamba.cu through runtime/cuda/mamba.py (the GPU step's path;
                  the scan's backward with chunk_size 2048, std Mamba's default)
    reference     the reference kernels (runtime/kernels/mamba.py: a per-time-step loop of
                  torch ops in fp32, the reference's dtype policy): what the GPU step ran
                  before
    hf_torch      transformers' torch path (what MambaForCausalLM runs without mamba_ssm /
                  causal_conv1d): modeling_mamba.mamba_selective_scan's per-step loop (or,
                  in transformers 4.x, MambaMixer.slow_forward's scan, timed the same way)
                  and causal_conv1d_fn's F.conv1d + SiLU; backward through autograd
    mamba_ssm     selective_scan_fn / causal_conv1d_fn of the mamba_ssm and causal_conv1d
                  packages (the fast kernels transformers uses when installed), where they
                  import

Each timing is the median of --iters calls (--slow-iters for the loops) with L2 flushed
before each (benchmarks/kernels/bench_kernels.py time_ms). The forward + backward column
runs the forward again each call (autograd needs its graph; the custom kernels' backward
recomputes anyway).

    python benchmarks/kernels/bench_mamba.py [--batch 2 --seq 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import time_ms  # noqa: E402
from runtime.cuda.mamba import MAMBA_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402

BF16 = torch.bfloat16


def scan_inputs(batch, ch, N, T):
    u = torch.randn(batch, ch, T, device="cuda").to(BF16)
    delta = (torch.randn(batch, ch, T, device="cuda") * 0.5 - 1).to(BF16)
    A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(ch, 1)
    B = torch.randn(batch, 1, N, T, device="cuda").to(BF16)
    C = torch.randn(batch, 1, N, T, device="cuda").to(BF16)
    D = torch.ones(ch, device="cuda")
    dt_bias = (torch.rand(ch, device="cuda") - 4).float()
    return [u, delta, A, B, C, D, dt_bias, None]


def hf_scan():
    """transformers' torch scan as f(u, delta, A, B [b, N, T], C, D, dt_bias) -> y, and
    what it is; None where this transformers has neither layout."""
    try:
        from transformers.models.mamba import modeling_mamba
    except ImportError:
        return None, "transformers has no Mamba"
    fn = getattr(modeling_mamba, "mamba_selective_scan", None)
    if fn is not None:
        torch_fn = inspect.unwrap(fn)  # the torch path, whatever the hub / packages offer

        def run(u, delta, A, B, C, D, dt_bias):
            return torch_fn(u, delta, A, B, C, D=D, delta_bias=dt_bias, delta_softplus=True)
        return run, "modeling_mamba.mamba_selective_scan (torch loop)"
    if hasattr(modeling_mamba.MambaMixer, "slow_forward"):
        return slow_forward_scan, "MambaMixer.slow_forward's scan loop (transformers 4.x)"
    return None, "no torch scan in this transformers"


def slow_forward_scan(u, delta, A, B, C, D, dt_bias):
    """The scan of transformers 4.x's MambaMixer.slow_forward, as it computes it."""
    dt = F.softplus(delta.transpose(1, 2) + dt_bias).transpose(1, 2)      # [b, ch, T]
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])               # [b, ch, T, N]
    dBu = dt[:, :, :, None] * B.transpose(1, 2)[:, None].float() * u[:, :, :, None].float()
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], device=u.device)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.matmul(h.to(u.dtype), C[:, :, t, None]).squeeze(-1))
    return torch.stack(ys, -1) + u * D[None, :, None]


def mamba_ssm_scan():
    if importlib.util.find_spec("mamba_ssm") is None:
        return None
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    def run(u, delta, A, B, C, D, dt_bias):
        return selective_scan_fn(u, delta, A, B, C, D, delta_bias=dt_bias, delta_softplus=True)
    return run


def autograd_pair(fn, inputs, grads_of):
    """(forward under no_grad, forward + backward) of fn(*inputs) through autograd."""
    leaves = [x.detach().requires_grad_(i in grads_of) if isinstance(x, torch.Tensor) else x
              for i, x in enumerate(inputs)]
    wanted = [leaves[i] for i in grads_of]

    def fwd():
        with torch.no_grad():
            fn(*leaves)

    def fwd_bwd():
        y = fn(*leaves)
        torch.autograd.grad(y, wanted, torch.ones_like(y))
    return fwd, fwd_bwd


def bench_scan(a) -> dict:
    inputs = scan_inputs(a.batch, a.channels, a.d_state, a.seq)
    d_y = torch.randn(a.batch, a.channels, a.seq, device="cuda").to(BF16)
    attrs = {"chunk_size": a.chunk}
    out = {}
    for name, kernel, iters in (("modulec", MAMBA_KERNELS["mamba_selective_scan"], a.iters),
                                ("reference", KERNELS["mamba_selective_scan"], a.slow_iters)):
        def fwd(k=kernel):
            k.forward(list(inputs), dict(attrs))

        def fwd_bwd(k=kernel):
            k.forward(list(inputs), dict(attrs))
            k.backward([d_y, *inputs], dict(attrs))
        out[name] = {"fwd_ms": time_ms(fwd, iters, warmup=1),
                     "fwd_bwd_ms": time_ms(fwd_bwd, iters, warmup=1)}
    u, delta, A, B, C, D, dt_bias, _ = inputs
    hf, what = hf_scan()
    if hf is not None:
        f, fb = autograd_pair(hf, [u, delta, A, B[:, 0], C[:, 0], D, dt_bias], (0, 1, 3, 4))
        out["hf_torch"] = {"fwd_ms": time_ms(f, a.slow_iters, warmup=1),
                           "fwd_bwd_ms": time_ms(fb, a.slow_iters, warmup=1), "what": what}
    else:
        out["hf_torch"] = {"skipped": what}
    fast = mamba_ssm_scan()
    if fast is not None:
        f, fb = autograd_pair(fast, [u, delta, A, B, C, D, dt_bias], (0, 1, 3, 4))
        out["mamba_ssm"] = {"fwd_ms": time_ms(f, a.iters), "fwd_bwd_ms": time_ms(fb, a.iters)}
    else:
        out["mamba_ssm"] = {"skipped": "mamba_ssm does not import"}
    return out


def bench_conv(a) -> dict:
    x = torch.randn(a.batch, a.channels, a.seq, device="cuda").to(BF16)
    w = (torch.randn(a.channels, 1, a.d_conv, device="cuda") * 0.3).to(BF16)
    b = (torch.randn(a.channels, device="cuda") * 0.1).to(BF16)
    d_y = torch.randn_like(x)
    attrs = {"kernel_size": a.d_conv, "activation": "silu"}
    out = {}
    for name, kernel, iters in (("modulec", MAMBA_KERNELS["mamba_conv1d"], a.iters),
                                ("reference", KERNELS["mamba_conv1d"], a.iters)):
        def fwd(k=kernel):
            k.forward([x, w, b, None], dict(attrs))

        def fwd_bwd(k=kernel):
            k.forward([x, w, b, None], dict(attrs))
            k.backward([d_y, x, w, b, None], dict(attrs))
        out[name] = {"fwd_ms": time_ms(fwd, iters), "fwd_bwd_ms": time_ms(fwd_bwd, iters)}

    def hf_conv(x, w, b):  # transformers' causal_conv1d_fn torch path
        y = F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
        return F.silu(y)
    f, fb = autograd_pair(hf_conv, [x, w, b], (0, 1, 2))
    out["hf_torch"] = {"fwd_ms": time_ms(f, a.iters), "fwd_bwd_ms": time_ms(fb, a.iters),
                       "what": "F.conv1d (groups = channels) + SiLU, autograd"}
    if importlib.util.find_spec("causal_conv1d") is not None:
        from causal_conv1d import causal_conv1d_fn

        f, fb = autograd_pair(lambda x, w, b: causal_conv1d_fn(x, w[:, 0], b, activation="silu"),
                              [x, w, b], (0, 1, 2))
        out["mamba_ssm"] = {"fwd_ms": time_ms(f, a.iters), "fwd_bwd_ms": time_ms(fb, a.iters),
                            "what": "causal_conv1d.causal_conv1d_fn"}
    else:
        out["mamba_ssm"] = {"skipped": "causal_conv1d does not import"}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--channels", type=int, default=1536, help="d_inner = expand * d_model")
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--d-conv", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048, help="the scan's chunk_size")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--slow-iters", type=int, default=3, help="for the per-step loops")
    p.add_argument("--json")
    a = p.parse_args(argv)
    print(f"mamba kernels: batch {a.batch}, {a.channels} channels, d_state {a.d_state}, "
          f"d_conv {a.d_conv}, T {a.seq}, bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    results = {"scan": bench_scan(a), "conv1d": bench_conv(a)}
    print(f"{'op':8}{'variant':11}{'fwd ms':>10}{'fwd+bwd ms':>12}{'x modulec':>11}  notes")
    for op, rows in results.items():
        ours = rows["modulec"]["fwd_bwd_ms"]
        for name, r in rows.items():
            if "skipped" in r:
                print(f"{op:8}{name:11}{'':>10}{'':>12}{'':>11}  skipped: {r['skipped']}")
                continue
            print(f"{op:8}{name:11}{r['fwd_ms']:>10.3f}{r['fwd_bwd_ms']:>12.3f}"
                  f"{r['fwd_bwd_ms'] / ours:>10.1f}x  {r.get('what', '')}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__, "results": results},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
