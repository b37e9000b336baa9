"""Time the custom CUDA kernels (runtime/cuda) against the reference kernels
(runtime/kernels, fp32 math in torch) and plain torch eager (F.rms_norm, F.silu(g) * u,
HF-style rope; backward through autograd) at LLM shapes, bf16.

Each timing is the median of `--iters` calls, each bracketed by its own CUDA events, with
L2 flushed before each call (a 256 MiB memset outside the events), so that inputs come
from HBM. GB/s counts the bytes a kernel must move: each input read once, each output
written once (workspaces not counted). A device-to-device copy gives the achievable
bandwidth beside the spec peak.

    python benchmarks/kernels/bench_kernels.py [--tokens 8192] [--dims 2048 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.cuda.kernels import CUDA_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402

PEAK_TBS = {"H100": 3.35, "H200": 4.8}  # HBM spec bandwidth (SXM), TB/s
BF16 = torch.bfloat16
_flush = None


def flush_l2():
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()


def time_ms(fn, iters: int, warmup: int = 3, setup=lambda: None) -> float:
    """Median ms of `fn()`; `setup()` runs before each call, outside the events (an
    in-place kernel's input restored, say)."""
    for _ in range(warmup):
        setup()
        fn()
    times = []
    for _ in range(iters):
        setup()
        flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def in_rounds(fns: dict, measure, rounds: int) -> dict:
    """{name: median of measure(fn)} over `rounds` rounds, each round measuring every fn in
    turn (a card under a power cap slows as it heats: the rounds share that drift out)."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(measure(fn))
    return {name: statistics.median(times) for name, times in samples.items()}


def graphed(fn, calls: int = 1):
    """`calls` calls of fn captured in one CUDA graph (after a warm-up call on a side stream:
    workspaces and lazily made state exist before the capture): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def replay_us(replay, calls: int = 1, rest: float = 0.0) -> float:
    """us a call of one replay of a graph holding `calls` calls (`graphed`), timed by CUDA
    events; `rest` s of sleep first, the card idle (at its full clock) when it starts."""
    if rest:
        torch.cuda.synchronize()
        time.sleep(rest)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda").to(dtype)


def grad_fn(build, inputs):
    """Eager backward: autograd of `build(*inputs)` (graph built once, kept)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    outs = build(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


# ------------------------------------------------------------------------------ cases
# each: (primitive, phase, shape label, inputs, attrs, bytes, eager fn or None)
def norm_cases(tokens, d):
    x, w, res = rand(tokens, d), rand(d), rand(tokens, d)
    y, rstd = KERNELS["rmsnorm"].forward([x, w], {})
    dy = rand(tokens, d)
    label = f"{tokens}x{d}"
    rms = lambda x, w: F.rms_norm(x, (d,), w, 1e-6)  # noqa: E731
    fused = lambda r, i, w: (lambda s: (s, F.rms_norm(s, (d,), w, 1e-6)))(r + i)  # noqa: E731
    res_out = res + x
    _, _, rstd2 = KERNELS["fused_residual_rmsnorm"].forward([res, x, w], {})
    yield ("rmsnorm", "forward", label, [x, w], {}, nbytes(x, w, y, rstd), lambda: rms(x, w))
    yield ("rmsnorm", "backward", label, [dy, x, w, rstd], {}, nbytes(dy, x, w, rstd, x, w),
           grad_fn(rms, [x, w]))
    yield ("fused_residual_rmsnorm", "forward", label, [res, x, w], {},
           nbytes(res, x, w, res, y, rstd), lambda: fused(res, x, w))
    yield ("fused_residual_rmsnorm", "backward", label, [dy, dy, res_out, w, rstd2], {},
           nbytes(dy, dy, res_out, w, rstd2, x, w), grad_fn(fused, [res, x, w]))


def swiglu_cases(tokens, d):
    g, u, dy = rand(tokens, d), rand(tokens, d), rand(tokens, d)
    label = f"{tokens}x{d}"
    eager = lambda g, u: F.silu(g) * u  # noqa: E731
    yield ("swiglu", "forward", label, [g, u], {}, nbytes(g, u, g), lambda: eager(g, u))
    # the gradients alone (a derived backward's), then with y (the std MLPs' written
    # backward: the recompute of hidden in the same pass, one more write)
    gradients_only = {"wanted_outputs": (True, True, False)}
    yield ("swiglu", "backward", label, [dy, g, u], gradients_only, nbytes(dy, g, u, g, u),
           grad_fn(eager, [g, u]))
    yield ("swiglu", "backward", f"{label} +y", [dy, g, u], {}, nbytes(dy, g, u, g, u, g), None)


def hf_rope(q, k, T, D, theta=10000.0):
    """HF LlamaRotaryEmbedding + apply_rotary_pos_emb, eager (tables in fp32, cast to bf16)."""
    inv = theta ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    ang = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * inv
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    rot = lambda x: torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)  # noqa: E731
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def rope_cases(tokens, d, head_dim=128, batch=4):
    T, Hq = tokens // batch, d // head_dim
    Hkv = max(1, Hq // 4)
    q, k = rand(batch, Hq, T, head_dim), rand(batch, Hkv, T, head_dim)
    label = f"B{batch} T{T} Hq{Hq} Hkv{Hkv} D{head_dim}"
    eager = lambda q, k: hf_rope(q, k, T, head_dim)  # noqa: E731
    moved = 2 * nbytes(q, k)
    yield ("rope", "forward", label, [q, k, None], {}, moved, lambda: eager(q, k))
    yield ("rope", "backward", label, [q, k, None], {}, moved, grad_fn(eager, [q, k]))


def qk_norm_cases(tokens, d, head_dim=128, batch=4):
    T, Hq = tokens // batch, d // head_dim
    Hkv = max(1, Hq // 4)
    q, k = rand(batch, Hq, T, head_dim), rand(batch, Hkv, T, head_dim)
    qw, kw = rand(head_dim), rand(head_dim)
    _, _, qr, kr = KERNELS["qk_norm"].forward([q, k, qw, kw], {})
    label = f"B{batch} T{T} Hq{Hq} Hkv{Hkv} D{head_dim}"
    eager = lambda q, k, qw, kw: (F.rms_norm(q, (head_dim,), qw, 1e-6),  # noqa: E731
                                  F.rms_norm(k, (head_dim,), kw, 1e-6))
    yield ("qk_norm", "forward", label, [q, k, qw, kw], {}, 2 * nbytes(q, k) + nbytes(qr, kr),
           lambda: eager(q, k, qw, kw))
    yield ("qk_norm", "backward", label, [q, k, q, k, qw, kw, qr, kr], {},
           3 * nbytes(q, k) + nbytes(qr, kr), grad_fn(eager, [q, k, qw, kw]))


def qk_norm_rope_cases(tokens, d, head_dim=128, batch=4):
    """The fused pair at qk_norm's and rope's shapes (compare with the sum of their rows);
    eager: F.rms_norm then HF rope."""
    T, Hq = tokens // batch, d // head_dim
    Hkv = max(1, Hq // 4)
    q, k = rand(batch, Hq, T, head_dim), rand(batch, Hkv, T, head_dim)
    qw, kw = rand(head_dim), rand(head_dim)
    _, _, qr, kr = KERNELS["qk_norm_rope"].forward([q, k, qw, kw, None], {})
    label = f"B{batch} T{T} Hq{Hq} Hkv{Hkv} D{head_dim}"

    def eager(q, k, qw, kw):
        return hf_rope(F.rms_norm(q, (head_dim,), qw, 1e-6), F.rms_norm(k, (head_dim,), kw, 1e-6),
                       T, head_dim)
    # forward: read q, k once, write q_rot, k_rot and the rstds; backward: read d_rot, q, k
    # and the rstds, write d_q, d_k (the weights, D elements each, not counted)
    yield ("qk_norm_rope", "forward", label, [q, k, qw, kw, None], {},
           2 * nbytes(q, k) + nbytes(qr, kr), lambda: eager(q, k, qw, kw))
    yield ("qk_norm_rope", "backward", label, [q, k, q, k, qw, kw, qr, kr, None], {},
           3 * nbytes(q, k) + nbytes(qr, kr), grad_fn(eager, [q, k, qw, kw]))


def embedding_cases(tokens, d, vocab=32000):
    """The backward only (the forward is torch's gather); eager: torch's index_add_ into
    a zeroed bf16 table, as autograd's embedding backward does."""
    ids = torch.randint(0, vocab, (tokens,), device="cuda", dtype=torch.int32)
    dy = rand(tokens, d)
    attrs = {"input_shapes": {"weight": (vocab, d)}}
    moved = nbytes(dy) + vocab * d * 2  # read d_y, write the table

    def eager():
        return torch.zeros(vocab, d, dtype=BF16, device="cuda").index_add_(0, ids.long(), dy)
    yield ("embedding", "backward", f"{tokens}x{d} V{vocab}", [dy, ids], attrs, moved, eager)


def moe_cases(tokens, d, experts=8, top_k=2):
    """The routing's row movement (Mixtral-like: 8 experts, top 2); eager: torch's
    gathers and index_add_ (what the reference kernels run, without the fp32 casts)."""
    indices = torch.stack([torch.randperm(experts, device="cuda")[:top_k]
                           for _ in range(tokens)]).int()
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.bincount(indices.reshape(-1).long(), minlength=experts).cumsum(0)
    x, rows = rand(tokens, d), rand(tokens * top_k, d)
    weights = torch.rand(tokens, top_k, device="cuda")
    scatter = torch.argsort(indices.reshape(-1), stable=True).int()
    token = scatter.long() // top_k
    label = f"{tokens}x{d} top{top_k}/{experts}"
    attrs = {"input_shapes": {"x": (tokens, d)}}
    moved = nbytes(x) + nbytes(rows)  # read one side, write the other

    def combine(r, w):
        return torch.zeros(tokens, d, dtype=BF16, device="cuda").index_add_(0, token, r * w)
    w_rows = weights.reshape(-1)[scatter.long()][:, None].to(BF16)
    yield ("moe_permute", "forward", label, [x, indices, offsets], {}, moved, lambda: x[token])
    yield ("moe_permute", "backward", label, [rows, scatter], attrs, moved,
           lambda: combine(rows, 1))
    yield ("moe_unpermute", "forward", label, [rows, weights, scatter], {}, moved,
           lambda: combine(rows, w_rows))
    yield ("moe_unpermute", "backward", label, [x, rows, weights, scatter], {}, 2 * moved,
           None)


# ------------------------------------------------------------------------------- main
def copy_bandwidth(iters) -> float:
    src = rand(8192, 8192)
    dst = torch.empty_like(src)
    return 2 * nbytes(src) / time_ms(lambda: dst.copy_(src), iters) / 1e6  # GB/s


def run(args) -> dict:
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TBS.items() if k in name), None)
    rows = []
    for d in args.dims:
        for case in (*norm_cases(args.tokens, d), *swiglu_cases(args.tokens, d),
                     *rope_cases(args.tokens, d), *qk_norm_cases(args.tokens, d),
                     *qk_norm_rope_cases(args.tokens, d),
                     *embedding_cases(args.tokens, d), *moe_cases(args.tokens, d)):
            prim, phase, label, inputs, attrs, moved, eager = case
            fn = getattr(CUDA_KERNELS[prim], phase)
            ref = getattr(KERNELS[prim], phase)
            row = {"primitive": prim, "phase": phase, "shape": label, "bytes": moved,
                   "custom_ms": time_ms(lambda: fn(inputs, attrs), args.iters),
                   "reference_ms": time_ms(lambda: ref(inputs, attrs), args.iters),
                   "eager_ms": time_ms(eager, args.iters) if eager else None}
            row["custom_GBs"] = moved / row["custom_ms"] / 1e6
            row["pct_peak"] = 100 * row["custom_GBs"] / (peak * 1000) if peak else None
            rows.append(row)
            torch.cuda.empty_cache()
    return {"device": name, "peak_TBs": peak, "copy_GBs": copy_bandwidth(args.iters),
            "tokens": args.tokens, "dims": args.dims, "iters": args.iters, "rows": rows}


def print_table(result: dict):
    print(f"{result['device']}: spec HBM {result['peak_TBs']} TB/s, "
          f"measured D2D copy {result['copy_GBs']:.0f} GB/s; bf16, median of {result['iters']}")
    head = ("primitive", "phase", "shape", "custom ms", "ref ms", "eager ms", "GB/s", "% peak",
            "x ref", "x eager")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in result["rows"]:
        eager = r["eager_ms"]
        cells = (r["primitive"], r["phase"], r["shape"], f"{r['custom_ms']:.4f}",
                 f"{r['reference_ms']:.4f}", f"{eager:.4f}" if eager else "-",
                 f"{r['custom_GBs']:.0f}", f"{r['pct_peak']:.0f}" if r["pct_peak"] else "-",
                 f"{r['reference_ms'] / r['custom_ms']:.2f}",
                 f"{eager / r['custom_ms']:.2f}" if eager else "-")
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: no CUDA device")
    result = run(args)
    print_table(result)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
