"""RoPE over q and k: two launches (one a tensor) against one (`rope_pair`).

At the step's shapes, q and k the strided heads of the fused QKV projection's output: the
forward in place, the backward into the head slots of the fused QKV gradient. Each
variant after a write that evicts the L2 (bench_kernels.time_ms), in rounds (median); the
pair is checked bit for bit against the two launches first.

    python3 benchmarks/kernels/bench_rope_pair.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]

from bench_kernels import in_rounds, nbytes, rand, time_ms  # noqa: E402

# name: (B, T, Hq, Hk, D, rope_theta)
SHAPES = {"llama3-8b": (1, 2048, 32, 8, 128, 500000.0),
          "tinyllama": (4, 2048, 32, 4, 64, 10000.0)}


def cases(shape):
    from runtime.cuda.kernels import _extension, rope_args

    B, T, Hq, Hk, D, theta = shape
    ext = _extension()
    qkv = rand(B, T, Hq + 2 * Hk, D)
    q, k, _ = (x.transpose(1, 2) for x in qkv.split([Hq, Hk, Hk], dim=2))
    grad = torch.empty_like(qkv)
    d_q, d_k, _ = (x.transpose(1, 2) for x in grad.split([Hq, Hk, Hk], dim=2))
    pos = torch.arange(T, device="cuda", dtype=torch.int32).expand(B, T).contiguous()
    attrs = {"theta": theta, "max_position_embeddings": T, "partial_rotary_factor": 1.0,
             "interleaved": False}
    args = rope_args(attrs, q, pos)
    want = [ext.rope(x, pos, *args, True) for x in (q, k)]
    got = ext.rope_pair(q, k, pos, *args, True, [d_q, d_k])
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "rope_pair differs"
    return {
        "forward, two launches": lambda: [ext.rope_inplace(x, pos, *args, False) for x in (q, k)],
        "forward, rope_pair": lambda: ext.rope_pair(q, k, pos, *args, False),
        "backward, two launches": lambda: [ext.rope(x, pos, *args, True, [o])
                                           for x, o in ((q, d_q), (k, d_k))],
        "backward, rope_pair": lambda: ext.rope_pair(q, k, pos, *args, True, [d_q, d_k]),
    }, 2 * nbytes(q, k)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name()}
    print(results["device"])
    for name, shape in SHAPES.items():
        fns, moved = cases(shape)
        times = in_rounds(fns, lambda fn: time_ms(fn, args.iters), args.rounds)
        results[name] = {k: round(v * 1e3, 2) for k, v in times.items()}
        for k, ms in times.items():
            print(f"{name:10} {k:24} {ms * 1e3:8.2f} us  {moved / ms / 1e9:6.2f} TB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
