"""Time causal attention forward + backward through the backends the GPU step can use
(runtime/cuda/attention.py): torch's FlashAttention-2 aten ops, cuDNN's SDPA ops and
FlashAttention-4's CuTe kernels where the flash-attn-4 package is installed, at
LLM shapes in bf16, with the step's layouts (q, k, v transposed views of one fused QKV
projection output; GQA). Each backend is checked against the fp32 math reference first.

TFLOP/s counts causal attention's matmul FLOPs: 4·B·Hq·T²·D / 2 forward, 2.5× that for the
backward (FlashAttention's accounting).

    python benchmarks/kernels/bench_attention.py [--batch 4] [--seq 2048] [--heads 32]
        [--kv-heads 4] [--head-dim 64] [--json out.json]

The ms columns time eager calls (L2 flushed); the us columns time the calls as the step runs
them, captured in a CUDA graph and replayed back to back (no host work between kernels, so
what a backend launches around its kernels shows and its Python does not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import graphed, replay_us, time_ms  # noqa: E402
from runtime.cuda import attention  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402

BF16 = torch.bfloat16


def fused_qkv(B, T, Hq, Hk, D, generator):
    """q, k, v as the attention module makes them: head views of one [B, T, (Hq+2Hk)·D]
    projection output, transposed to [B, H, T, D]."""
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, device="cuda", generator=generator).to(BF16)
    q, k, v = qkv.split([Hq, Hk, Hk], dim=2)
    return [t.transpose(1, 2) for t in (q, k, v)]


def reference(q, k, v, d_out, attrs):
    ref = KERNELS["flash_attention"]
    f = [t.double().cpu() for t in (q, k, v)]
    out, lse = ref.forward_fn(*f, None, **attrs)
    grads = ref.backward_fn(d_out.double().cpu(), *f, out, lse, None, **attrs)
    return [out, lse, *grads[:3]]


def max_rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(backend, q, k, v, d_out, attrs, ref) -> float:
    out, lse = backend.forward(q, k, v, attrs)
    d_q, d_k, d_v = backend.backward(d_out, q, k, v, out, lse, attrs)
    return max(max_rel(x, r) for x, r in zip((out, lse, d_q, d_k, d_v), ref))


def time_backend(backend, q, k, v, d_out, attrs, iters):
    out, lse = backend.forward(q, k, v, attrs)
    fwd = time_ms(lambda: backend.forward(q, k, v, attrs), iters)
    bwd = time_ms(lambda: backend.backward(d_out, q, k, v, out, lse, attrs), iters)
    return fwd, bwd


def replayed_us(fn, calls: int = 16, replays: int = 15) -> float:
    """Median us a call of `fn` over replays of a CUDA graph holding `calls` of them."""
    replay = graphed(fn, calls)
    replay()
    return sorted(replay_us(replay, calls) for _ in range(replays))[replays // 2]


def replayed_backend(backend, q, k, v, d_out, attrs):
    out, lse = backend.forward(q, k, v, attrs)
    return (replayed_us(lambda: backend.forward(q, k, v, attrs)),
            replayed_us(lambda: backend.backward(d_out, q, k, v, out, lse, attrs)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    B, T, Hq, Hk, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    attrs = {"causal": True}
    small = fused_qkv(2, 256, Hq, Hk, D, g)
    d_small = torch.randn(small[0].shape, device="cuda", generator=g).to(BF16)
    ref = reference(*small, d_small, attrs)
    q, k, v = fused_qkv(B, T, Hq, Hk, D, g)
    # laid as the step's (o_proj's d_x: [B, T, H, D] dense), so no backend copies it first
    d_out = torch.randn(B, T, Hq, D, device="cuda", generator=g).to(BF16).transpose(1, 2)
    flops = 4 * B * Hq * T * T * D / 2
    rows = []
    for name, backend in attention.BACKENDS.items():
        row = {"backend": name}
        if not backend.covers(q, k, v, attrs):  # fa4 without its package or off Hopper
            row["error"] = getattr(backend, "unavailable", None) or \
                "does not cover this call on this machine"
            rows.append(row)
            continue
        try:
            row["max_rel_error"] = check(backend, *small, d_small, attrs, ref)
            row["fwd_ms"], row["bwd_ms"] = time_backend(backend, q, k, v, d_out, attrs, args.iters)
            row["fwd_graph_us"], row["bwd_graph_us"] = replayed_backend(backend, q, k, v, d_out,
                                                                        attrs)
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
        except Exception as error:  # a backend this torch / GPU does not have
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
    print(f"causal attention B={B} T={T} Hq={Hq} Hkv={Hk} D={D} bf16, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'backend':10} {'max rel err':>12} {'fwd ms':>8} {'TFLOP/s':>8} "
          f"{'bwd ms':>8} {'TFLOP/s':>8} {'fwd us':>8} {'bwd us':>8} (graph replays)")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:10} {r['error']}")
            continue
        print(f"{r['backend']:10} {r['max_rel_error']:12.2e} {r['fwd_ms']:8.3f} "
              f"{r['fwd_tflops']:8.1f} {r['bwd_ms']:8.3f} {r['bwd_tflops']:8.1f} "
              f"{r['fwd_graph_us']:8.1f} {r['bwd_graph_us']:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [B, T, Hq, Hk, D], "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
