"""Time causal attention forward + backward on packed documents (FlashAttention-2's
variable-length entry, runtime/cuda/varlen.py) against the unpacked causal kernel at the
same B and T (runtime/cuda/attention.py `flash`, and `cudnn`, the GPU step's first
choice), bf16, the step's layouts. Documents'
lengths are drawn uniformly from 1 .. 2 x --mean-doc (its correctness is
tests/test_cuda_varlen.py's). The attention-level half of issue 18's "packed within 5%
of unpacked" (the step-level half: benchmarks/gpu/packed_step.py). `packed` is the call
with exactly the batch's documents and its longest one; `packed-step` the GPU step's
(runtime/cuda/packed.py): cu_seqlens padded with empty documents to the step's capacity
and max_seqlen T; `--full-capacity` adds `packed-BT+1`, padded to B*T + 1 entries (the
bound the step does not use: empty sequences still launch blocks).

    python benchmarks/kernels/bench_varlen.py [--batch 4] [--seq 2048] [--mean-doc 512]
                                              [--full-capacity]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_attention import fused_qkv  # noqa: E402
from benchmarks.kernels.bench_kernels import time_ms  # noqa: E402
from runtime.cuda.attention import BACKENDS, flash_backward, flash_forward  # noqa: E402
from runtime.cuda.packed import capacity_for, padded_cu_seqlens  # noqa: E402
from runtime.cuda.varlen import cu_seqlens, varlen_backward, varlen_forward  # noqa: E402
from runtime.kernels.documents import Documents  # noqa: E402
from runtime.train.packing import documents_of  # noqa: E402

BF16 = torch.bfloat16


def documents(B: int, T: int, mean: int, generator) -> Documents:
    ends = torch.zeros(B, T, dtype=torch.bool)
    for row in range(B):
        at = -1
        while True:
            at += int(torch.randint(1, 2 * mean + 1, (1,), generator=generator))
            if at >= T:
                break
            ends[row, at] = True
    return documents_of(ends)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mean-doc", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--full-capacity", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    gpu = torch.Generator(device="cuda").manual_seed(0)
    cpu = torch.Generator().manual_seed(0)
    attrs = {"causal": True}
    q, k, v = fused_qkv(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, gpu)
    d_out = torch.randn(q.shape, device="cuda", generator=gpu).to(BF16)
    docs = documents(a.batch, a.seq, a.mean_doc, cpu)
    cu, longest = cu_seqlens(docs.positions.cuda())
    out, lse = flash_forward(q, k, v, attrs)
    vout, vlse = varlen_forward(q, k, v, cu, longest, attrs)
    rows = {
        "unpacked": (time_ms(lambda: flash_forward(q, k, v, attrs), a.iters),
                     time_ms(lambda: flash_backward(d_out, q, k, v, out, lse, attrs), a.iters)),
        "packed": (time_ms(lambda: varlen_forward(q, k, v, cu, longest, attrs), a.iters),
                   time_ms(lambda: varlen_backward(d_out, q, k, v, vout, vlse, cu, longest,
                                                   attrs), a.iters)),
    }
    capacities = {"packed-step": capacity_for(len(cu) - 1, a.batch * a.seq)}
    if a.full_capacity:
        capacities["packed-BT+1"] = a.batch * a.seq
    for name, capacity in capacities.items():
        padded = padded_cu_seqlens(docs.positions, capacity).cuda()
        pout, plse = varlen_forward(q, k, v, padded, a.seq, attrs)
        rows[name] = (
            time_ms(lambda: varlen_forward(q, k, v, padded, a.seq, attrs), a.iters),
            time_ms(lambda: varlen_backward(d_out, q, k, v, pout, plse, padded, a.seq,
                                            attrs), a.iters))
        del pout, plse
    try:  # the GPU step's first choice unpacked (TrainStep attention=("cudnn", "flash"))
        cudnn = BACKENDS["cudnn"]
        cout, clse = cudnn.forward(q, k, v, attrs)
        rows["unpacked-cudnn"] = (
            time_ms(lambda: cudnn.forward(q, k, v, attrs), a.iters),
            time_ms(lambda: cudnn.backward(d_out, q, k, v, cout, clse, attrs), a.iters))
    except Exception as error:  # a torch / GPU without cuDNN attention
        print(f"cudnn: {type(error).__name__}: {error}"[:200])
    print(f"B={a.batch} T={a.seq} Hq={a.heads} Hkv={a.kv_heads} D={a.head_dim} bf16, "
          f"{len(cu) - 1} documents (mean {a.batch * a.seq / (len(cu) - 1):.0f} tokens), "
          f"{torch.cuda.get_device_name()}")
    for name, (fwd, bwd) in rows.items():
        print(f"{name:14} fwd {fwd:7.3f} ms  bwd {bwd:7.3f} ms  total {fwd + bwd:7.3f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "documents": len(cu) - 1,
                                            "ms": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
