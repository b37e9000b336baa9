"""torch's cuDNN attention entry called several times in one process at the same shapes
with its tensors laid different ways, each call checked against fp32 math (decisions.md
"GPU attention": torch keeps the backward's cuDNN graph without out's, d_out's and lse's
strides). The letters name the calls, in the order given; run each order in a fresh
process (the cache lives for the process):

    for order in abcdef fedcba dc ec cg gc ch hc; do
        python3 benchmarks/kernels/cudnn_layout_probe.py $order; done

Each line: the call, then the relative error of its outputs (the forward's out; the
backward's d_q, d_k, d_v). bf16 rounding is ~3e-3; ~1 is a wrong result.
"""

from __future__ import annotations

import sys

import torch

B, T, H, HKV, D = 1, 256, 8, 2, 128
SCALE = D ** -0.5


def heads_apart(t):
    """[B, H, T, D] copied into a [B, T, H * D + 16] buffer's left columns."""
    wide = torch.zeros(B, T, t.shape[1] * D + 16, device="cuda", dtype=t.dtype)
    view = wide[..., :t.shape[1] * D].view(B, T, t.shape[1], D).transpose(1, 2)
    view.copy_(t)
    return view


def rows_apart(lse):
    wide = torch.zeros(B, H, T + 8, 1, device="cuda", dtype=torch.float32)[:, :, :T]
    wide.copy_(lse.reshape(B, H, T, 1))
    return wide


def fp32_math(q, k, v, d_o):
    q, k, v = (t.float().detach().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2)) * SCALE
    s = s.masked_fill(torch.ones(T, T, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    o = s.softmax(-1) @ vv
    o.backward(d_o.float())
    return o.detach(), [q.grad, k.grad, v.grad]


def main(order: str) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(B, T, H + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([H, HKV, HKV], dim=2))
    d_o = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ref_o, ref_grads = fp32_math(q, k, v, d_o)
    empty = torch.empty(0, dtype=torch.int64, device="cuda")

    def forward(qq, kk, vv):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            qq, kk, vv, None, True, 0.0, True, False, scale=SCALE)[:2]

    out, lse = forward(q, k, v)
    lse = lse.reshape(B, H, T, 1)

    def backward(o=out, d=d_o, qq=q, kk=k, vv=v, stats=lse):
        return list(torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d, qq, kk, vv, o, stats, empty, empty, None, None, None, T, T, 0.0, True,
            scale=SCALE))

    contiguous = [t.contiguous() for t in (q, k, v)]
    calls = {
        "a": ("forward, q k v fused views", lambda: [forward(q, k, v)[0]], [ref_o]),
        "b": ("forward, q k v heads outer", lambda: [forward(*contiguous)[0]], [ref_o]),
        "c": ("backward, out d_out [B,T,H,D]", backward, ref_grads),
        "d": ("backward, d_out heads outer", lambda: backward(d=d_o.contiguous()), ref_grads),
        "e": ("backward, out rows apart", lambda: backward(o=heads_apart(out)), ref_grads),
        "f": ("backward, out d_out heads outer",
              lambda: backward(o=out.contiguous(), d=d_o.contiguous()), ref_grads),
        "g": ("backward, q k v heads outer",
              lambda: backward(qq=contiguous[0], kk=contiguous[1], vv=contiguous[2]),
              ref_grads),
        "h": ("backward, lse rows apart", lambda: backward(stats=rows_apart(lse)), ref_grads),
    }
    for letter in order:
        name, call, wanted = calls[letter]
        errors = [float((got.float() - want).norm() / want.norm())
                  for got, want in zip(call(), wanted)]
        print(f"{letter} {name:32s} " + " ".join(f"{e:.1e}" for e in errors), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "abcdefgh")
