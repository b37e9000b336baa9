"""Memory plans of the std models' training steps against their lower bounds (issue 4).

Until the Schedule IR lowers real models, `synthetic_transformer` writes the lifetimes of
one training step (B=1, T=4096, bf16) by hand: forward with the std blocks' save lists,
a backward that consumes the saved tensors in reverse and recomputes the MLP (the std
SwiGLU `recompute:` list), gradient accumulation and an Adam step. Any other source of
`(ops, buffers)` plugs into `report` unchanged.

Prints a table (per model and region: naive bytes, TFLite-style greedy by size, ORT-style
exact-size reuse, modulec's plan, the lower bound, modulec / lower bound) and one JSON line
per model (with the peak live bytes of the given order and of the memory-aware orders).
Target: ratio <= 1.02 in every region. Exit status 1 when a ratio misses it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace

from modulec.plan.memory import (
    GRADIENTS, OPTIMIZER_STATE, SAVED, TRANSIENT, WEIGHTS, WORKSPACE, Buffer, Op,
    memory_aware_order, peak_live_bytes, pinned_edges, plan_memory, reorder, verify,
)

TARGET = 1.02
MATMUL_WORKSPACE = 32 << 20          # cuBLAS-style per-call workspace
F32 = 4


@dataclass
class Builder:
    """Appends ops and buffers in schedule order; pinned buffers span the whole step."""
    act: int                                     # bytes per activation element
    ops: list = field(default_factory=list)
    buffers: list = field(default_factory=list)

    def tensor(self, name: str, nbytes: int, region: str = TRANSIENT,
               alias_of: str | None = None, offset: int = 0) -> str:
        self.buffers.append(Buffer(name, nbytes, region, alias_of=alias_of,
                                   offset_in_source=offset))
        return name

    def acts(self, rows: int, *named: tuple[str, int], region: str = TRANSIENT) -> tuple:
        """Activation tensors of `rows` x width elements each, for (name, width) pairs."""
        return tuple(self.tensor(name, rows * width * self.act, region) for name, width in named)

    def f32(self, *named: tuple[str, int], region: str = SAVED) -> tuple:
        return tuple(self.tensor(name, count * F32, region) for name, count in named)

    def op(self, name: str, inputs, outputs, kind: str = "other", inplace: bool = False,
           workspace: int = 0):
        outputs = tuple(outputs)
        if workspace:
            outputs += (self.tensor(f"{name}.ws", workspace, WORKSPACE),)
        self.ops.append(Op(len(self.ops), name, tuple(inputs), outputs, kind, inplace))

    def param(self, name: str, numel: int) -> str:
        for region, suffix, width in ((WEIGHTS, "", self.act), (GRADIENTS, ".grad", self.act),
                                      (OPTIMIZER_STATE, ".m", F32), (OPTIMIZER_STATE, ".v", F32)):
            self.buffers.append(Buffer(name + suffix, numel * width, region,
                                       pinned_lifetime=(0, 0)))
        return name

    def matmul(self, name: str, x: str, w: str, rows: int, cols: int, region: str = TRANSIENT):
        self.op(name, (x, w), self.acts(rows, (name, cols), region=region),
                workspace=MATMUL_WORKSPACE)
        return name

    def weight_grad(self, name: str, dy: str, x: str, w: str):
        self.op(name, (dy, x, w + ".grad"), (), workspace=MATMUL_WORKSPACE)

    def finish(self):
        for p in [b.id for b in self.buffers if b.region == WEIGHTS]:
            self.op(f"adam.{p}", (p, p + ".grad", p + ".m", p + ".v"), ())
        end = len(self.ops) - 1
        buffers = [replace(b, pinned_lifetime=(0, end)) if b.pinned_lifetime else b
                   for b in self.buffers]
        return self.ops, buffers


@dataclass(frozen=True)
class Shape:
    n: int           # tokens, B * T
    d: int
    ff: int
    heads: int
    kv: int
    hd: int
    experts: int
    top_k: int
    qk_norm: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv * self.hd

    @property
    def expert_rows(self) -> int:
        return -(-self.n * self.top_k // self.experts)      # balanced routing


def synthetic_transformer(layers: int, d_model: int, d_ff: int, seq: int, batch: int,
                          heads: int, vocab: int, dtype_bytes: int = 2, *,
                          kv_heads: int | None = None, head_dim: int | None = None,
                          experts: int = 0, top_k: int = 0, qk_norm: bool = False):
    """(ops, buffers) of one training step of a pre-norm decoder (std DenseTransformerBlock,
    or MoETransformerBlock with `experts` > 0)."""
    s = Shape(batch * seq, d_model, d_ff, heads, kv_heads or heads,
              head_dim or d_model // heads, experts, top_k, qk_norm)
    b, n, d = Builder(dtype_bytes), s.n, s.d
    emb, lm_head = b.param("embedding", vocab * d), b.param("lm_head", vocab * d)
    final_w = b.param("final_norm", d)
    tokens, labels = b.f32(("token_ids", n), ("labels", n))
    b.op("embedding", (tokens, emb), b.acts(n, ("x0", d)))
    b.op("zeros", (), b.acts(n, ("residual0", d)))
    x, residual = "x0", "residual0"
    for layer in range(layers):
        x, residual = _forward_block(b, s, f"L{layer}", x, residual)
    _norm(b, s, "final", residual, x, final_w)
    b.matmul("logits", "final.out", lm_head, n, vocab)
    b.op("cross_entropy", ("logits", labels), b.f32(("loss", 1), ("ce_lse", n), region=TRANSIENT))
    b.op("cross_entropy_bwd", ("logits", "ce_lse", labels), b.acts(n, ("d_logits", vocab)),
         "elementwise", inplace=True)
    b.matmul("d_final_out", "d_logits", lm_head, n, d)
    b.weight_grad("d_lm_head", "d_logits", "final.out", lm_head)
    dh = _norm_backward(b, s, "final", final_w, "d_final_out", None, f"d_h{layers}")
    for layer in reversed(range(layers)):
        dh = _backward_block(b, s, f"L{layer}", dh, f"d_h{layer}")
    b.op("embedding_bwd", (dh, tokens, emb + ".grad"), ())
    return b.finish()


def _norm(b: Builder, s: Shape, name: str, residual: str, x: str, w: str):
    """fused_residual_rmsnorm: (residual + x, rmsnorm(residual + x), rstd), all saved."""
    outs = (*b.acts(s.n, (f"{name}.residual", s.d), (f"{name}.out", s.d), region=SAVED),
            *b.f32((f"{name}.rstd", s.n)))
    b.op(name, (residual, x, w), outs)
    return outs


def _norm_backward(b: Builder, s: Shape, name: str, w: str, d_out: str,
                   d_residual: str | None, grad: str) -> str:
    """Gradient of residual + x (both inputs get it), written in place of d_out."""
    inputs = (d_out, *([d_residual] if d_residual else []), f"{name}.residual",
              f"{name}.rstd", w, w + ".grad")
    b.op(f"{name}_bwd", inputs, b.acts(s.n, (grad, s.d)), "elementwise", inplace=True)
    return grad


def _forward_block(b: Builder, s: Shape, p: str, x: str, residual: str):
    ln1, ln2 = b.param(f"{p}.ln1", s.d), b.param(f"{p}.ln2", s.d)
    res_mid, ln1_out, _ = _norm(b, s, f"{p}.ln1", residual, x, ln1)
    attn_out = _forward_attention(b, s, p, ln1_out)
    res_out, ln2_out, _ = _norm(b, s, f"{p}.ln2", res_mid, attn_out, ln2)
    if s.experts:
        return _forward_moe(b, s, p, ln2_out), res_out
    return _forward_mlp(b, s, f"{p}.mlp", ln2_out, s.n), res_out


def _forward_attention(b: Builder, s: Shape, p: str, x: str) -> str:
    a, n, qd, kvd = b.act, s.n, s.q_dim, s.kv_dim
    wqkv = b.param(f"{p}.qkv_weight", (qd + 2 * kvd) * s.d)
    wo = b.param(f"{p}.out_weight", s.d * qd)
    qkv = b.matmul(f"{p}.qkv", x, wqkv, n, qd + 2 * kvd)
    parts = (("q", qd, 0), ("k", kvd, qd), ("v", kvd, qd + kvd))      # head-axis split: views
    views = [b.tensor(f"{p}.{t}_bthd", n * w * a, alias_of=qkv, offset=off * a)
             for t, w, off in parts]
    b.op(f"{p}.split_heads", (qkv,), views, "view")
    qk_region = SAVED if s.qk_norm else TRANSIENT                     # qk_norm's backward reads
    q, k = b.acts(n, (f"{p}.q", qd), (f"{p}.k", kvd), region=qk_region)
    v, = b.acts(n, (f"{p}.v", kvd), region=SAVED)
    b.op(f"{p}.to_heads", views, (q, k, v))
    if s.qk_norm:
        qn, kn = b.param(f"{p}.q_norm", s.hd), b.param(f"{p}.k_norm", s.hd)
        normed = (*b.acts(n, (f"{p}.q_normed", qd), (f"{p}.k_normed", kvd)),
                  *b.f32((f"{p}.q_rstd", n * s.heads), (f"{p}.k_rstd", n * s.kv)))
        b.op(f"{p}.qk_norm", (q, k, qn, kn), normed)
        q, k = normed[:2]
    rot = b.acts(n, (f"{p}.q_rot", qd), (f"{p}.k_rot", kvd), region=SAVED)
    b.op(f"{p}.rope", (q, k), rot, "elementwise", inplace=True)
    attn = (*b.acts(n, (f"{p}.attn", qd), region=SAVED), *b.f32((f"{p}.lse", n * s.heads)))
    b.op(f"{p}.flash_attention", (*rot, v), attn, workspace=n * s.heads * F32)
    b.op(f"{p}.from_heads", attn[:1], b.acts(n, (f"{p}.attn_bthd", qd), region=SAVED))
    flat = b.tensor(f"{p}.attn_flat", n * qd * a, alias_of=f"{p}.attn_bthd")
    b.op(f"{p}.flatten", (f"{p}.attn_bthd",), (flat,), "view")
    return b.matmul(f"{p}.attn_out", flat, wo, n, s.d)


def _forward_mlp(b: Builder, s: Shape, p: str, x: str, rows: int) -> str:
    """SwiGLU: up (gate|up) -> split views -> swiglu -> down."""
    half = rows * s.ff * b.act
    wup, wdown = b.param(f"{p}.up_weight", 2 * s.ff * s.d), b.param(f"{p}.down_weight", s.d * s.ff)
    gate_up = b.matmul(f"{p}.gate_up", x, wup, rows, 2 * s.ff)
    halves = (b.tensor(f"{p}.gate", half, alias_of=gate_up),
              b.tensor(f"{p}.up", half, alias_of=gate_up, offset=half))
    b.op(f"{p}.split", (gate_up,), halves, "view")
    b.op(f"{p}.swiglu", halves, b.acts(rows, (f"{p}.hidden", s.ff)), "elementwise", True)
    return b.matmul(f"{p}.out", f"{p}.hidden", wdown, rows, s.d)


def _forward_moe(b: Builder, s: Shape, p: str, ln2_out: str) -> str:
    n, d = s.n, s.d
    tokens = b.tensor(f"{p}.tokens", n * d * b.act, alias_of=ln2_out)
    b.op(f"{p}.flatten_tokens", (ln2_out,), (tokens,), "view")
    router = b.param(f"{p}.router", s.experts * d)
    logits = b.f32((f"{p}.router_logits", n * s.experts), region=TRANSIENT)
    b.op(f"{p}.router", (tokens, router), logits, workspace=MATMUL_WORKSPACE)
    route = b.f32((f"{p}.weights", n * s.top_k), (f"{p}.indices", n * s.top_k))
    b.op(f"{p}.topk_softmax", logits, route)
    acc, = b.acts(n, (f"{p}.moe_acc", d))
    b.op(f"{p}.moe_zeros", (), (acc,))
    for e in range(s.experts):
        q = f"{p}.expert{e}"
        b.op(f"{q}.gather", (tokens, *route), b.acts(s.expert_rows, (f"{q}.x", d)))
        y_e = _forward_mlp(b, s, q, f"{q}.x", s.expert_rows)
        b.op(f"{q}.scatter_add", (acc, y_e, *route), b.acts(n, (f"{q}.acc", d)),
             "elementwise", inplace=True)
        acc = f"{q}.acc"
    return acc


def _backward_block(b: Builder, s: Shape, p: str, dh: str, grad: str) -> str:
    """Gradient of the block's input hidden state (residual + x), given the next one's."""
    if s.experts:
        d_ln2 = _backward_moe(b, s, p, dh)
    else:
        d_ln2 = _backward_mlp(b, s, f"{p}.mlp", f"{p}.ln2.out", dh, s.n)
    dh_mid = _norm_backward(b, s, f"{p}.ln2", f"{p}.ln2", d_ln2, dh, f"{p}.d_h_mid")
    d_ln1 = _backward_attention(b, s, p, dh_mid)
    return _norm_backward(b, s, f"{p}.ln1", f"{p}.ln1", d_ln1, dh_mid, grad)


def _backward_mlp(b: Builder, s: Shape, p: str, x: str, dy: str, rows: int) -> str:
    """Recomputes gate_up and hidden (std SwiGLU_MLP recompute list), then backward."""
    wup, wdown = f"{p}.up_weight", f"{p}.down_weight"
    gate_up = b.matmul(f"{p}.gate_up_r", x, wup, rows, 2 * s.ff)
    b.op(f"{p}.swiglu_r", (gate_up,), b.acts(rows, (f"{p}.hidden_r", s.ff)))
    d_hidden = b.matmul(f"{p}.d_hidden", dy, wdown, rows, s.ff)
    b.weight_grad(f"{p}.d_down_weight", dy, f"{p}.hidden_r", wdown)
    d_gate_up, = b.acts(rows, (f"{p}.d_gate_up", 2 * s.ff))
    b.op(f"{p}.swiglu_bwd", (gate_up, d_hidden), (d_gate_up,), "elementwise", inplace=True)
    d_x = b.matmul(f"{p}.d_x", d_gate_up, wup, rows, s.d)
    b.weight_grad(f"{p}.d_up_weight", d_gate_up, x, wup)
    return d_x


def _backward_moe(b: Builder, s: Shape, p: str, dh: str) -> str:
    n, d, rows = s.n, s.d, s.expert_rows
    route, tokens = (f"{p}.weights", f"{p}.indices"), f"{p}.tokens"
    acc, = b.acts(n, (f"{p}.d_tokens0", d))
    b.op(f"{p}.d_moe_zeros", (), (acc,))
    for e in reversed(range(s.experts)):
        q = f"{p}.expert{e}"
        b.op(f"{q}.gather_r", (tokens, *route), b.acts(rows, (f"{q}.x_r", d)))
        b.op(f"{q}.gather_dy", (dh, *route), b.acts(rows, (f"{q}.dy", d)))
        dx_e = _backward_mlp(b, s, q, f"{q}.x_r", f"{q}.dy", rows)
        b.op(f"{q}.scatter_add_dx", (acc, dx_e, *route), b.acts(n, (f"{q}.d_acc", d)),
             "elementwise", inplace=True)
        acc = f"{q}.d_acc"
    d_logits = b.f32((f"{p}.d_router_logits", n * s.experts), region=TRANSIENT)
    b.op(f"{p}.topk_softmax_bwd", (dh, *route), d_logits)
    b.weight_grad(f"{p}.d_router_weight", d_logits[0], tokens, f"{p}.router")
    d_tokens = b.acts(n, (f"{p}.d_tokens", d))
    b.op(f"{p}.router_bwd", (acc, *d_logits, f"{p}.router"), d_tokens, "elementwise", inplace=True)
    return d_tokens[0]


def _backward_attention(b: Builder, s: Shape, p: str, dy: str) -> str:
    n, qd, kvd = s.n, s.q_dim, s.kv_dim
    wqkv, wo = f"{p}.qkv_weight", f"{p}.out_weight"
    d_flat = b.matmul(f"{p}.d_attn_flat", dy, wo, n, qd)
    b.weight_grad(f"{p}.d_out_weight", dy, f"{p}.attn_flat", wo)
    b.op(f"{p}.d_to_heads", (d_flat,), b.acts(n, (f"{p}.d_attn", qd)))
    grads = b.acts(n, (f"{p}.d_q_rot", qd), (f"{p}.d_k_rot", kvd), (f"{p}.d_v", kvd))
    saved = (f"{p}.q_rot", f"{p}.k_rot", f"{p}.v", f"{p}.attn", f"{p}.lse")
    b.op(f"{p}.flash_attention_bwd", (f"{p}.d_attn", *saved), grads, workspace=n * qd * F32)
    dq, dk = b.acts(n, (f"{p}.d_q", qd), (f"{p}.d_k", kvd))
    b.op(f"{p}.rope_bwd", grads[:2], (dq, dk), "elementwise", inplace=True)
    if s.qk_norm:
        saved_qk = tuple(f"{p}.{t}" for t in ("q", "k", "q_rstd", "k_rstd", "q_norm", "k_norm",
                                              "q_norm.grad", "k_norm.grad"))
        pre = b.acts(n, (f"{p}.d_q_pre", qd), (f"{p}.d_k_pre", kvd))
        b.op(f"{p}.qk_norm_bwd", (dq, dk, *saved_qk), pre, "elementwise", inplace=True)
        dq, dk = pre
    d_qkv, = b.acts(n, (f"{p}.d_qkv", qd + 2 * kvd))
    b.op(f"{p}.d_from_heads", (dq, dk, grads[2]), (d_qkv,))
    d_x = b.matmul(f"{p}.d_ln1_out", d_qkv, wqkv, n, s.d)
    b.weight_grad(f"{p}.d_qkv_weight", d_qkv, f"{p}.ln1.out", wqkv)
    return d_x


# Llama-2-7B, Qwen3-8B, Mistral-7B, Mixtral-8x7B: the std models' defaults (std/models)
MODELS = {
    "llama2-7b": dict(layers=32, d_model=4096, d_ff=11008, heads=32, vocab=32000),
    "qwen3-8b": dict(layers=36, d_model=4096, d_ff=12288, heads=32, vocab=151936,
                     kv_heads=8, head_dim=128, qk_norm=True),
    "mistral-7b": dict(layers=32, d_model=4096, d_ff=14336, heads=32, vocab=32000, kv_heads=8),
    "mixtral-8x7b": dict(layers=32, d_model=4096, d_ff=14336, heads=32, vocab=32000,
                         kv_heads=8, experts=8, top_k=2),
}
COLUMNS = ("naive", "TFLite greedy", "ORT exact-reuse", "modulec", "lower bound", "ratio")


def report(name: str, ops, buffers) -> dict:
    """Plans one model's step and returns its JSON record (the table is printed from it)."""
    start = time.perf_counter()
    plan = plan_memory(ops, buffers)
    seconds = time.perf_counter() - start
    verify(plan)
    regions = [dict(r.summary(), ratio=round(r.ratio, 5)) for r in plan.regions.values()]
    return {"model": name, "ops": len(ops), "buffers": len(buffers), "plan_s": round(seconds, 2),
            **{k: v for k, v in plan.summary().items() if k != "regions"},
            "max_ratio": max(r["ratio"] for r in regions), "regions": regions,
            "order_peak_bytes": order_peaks(ops, buffers)}


def order_peaks(ops, buffers) -> dict:
    """Peak live bytes (all regions) of the given order and of the memory-aware orders."""
    edges = pinned_edges(ops, buffers)
    peaks = {"given": peak_live_bytes(ops, buffers)}
    for label, defer in (("v2", False), ("v2_deferred", True)):
        order = memory_aware_order(ops, buffers, edges, defer_allocations=defer)
        peaks[label] = peak_live_bytes(reorder(ops, order), buffers)
    return peaks


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _row(model: str, region: str, r: dict) -> str:
    ratio = r["arena_bytes"] / r["lower_bound_bytes"] if r["lower_bound_bytes"] else 1.0
    cells = (r["naive_bytes"], r["greedy_by_size_bytes"], r["exact_size_reuse_bytes"],
             r["arena_bytes"], r["lower_bound_bytes"])
    return f"{model:<13} {region:<22}" + "".join(f"{_mib(c):>16}" for c in cells) + f"{ratio:>9.4f}"


def print_table(records: list[dict]) -> None:
    print(f"{'model':<13} {'region (MiB)':<22}" + "".join(f"{c:>16}" for c in COLUMNS[:-1])
          + f"{COLUMNS[-1]:>9}")
    for rec in records:
        for r in rec["regions"]:
            print(_row(rec["model"], r["region"], r))
        print(_row(rec["model"], "total", rec))


STD_MODELS = {"llama2-7b": "llama", "qwen3-8b": "qwen3", "mistral-7b": "mistral",
              "mixtral-8x7b": "mixtral"}


def graph_report(name: str, seq: int, batch: int) -> dict:
    """The std model's real step: `modulec build` lowering, then modulec.plan.from_graph."""
    from pathlib import Path

    from modulec.lower.build import BuildRequest, build
    from modulec.plan.from_graph import plan_step

    root = Path(__file__).resolve().parent.parent
    start = time.perf_counter()
    result = build(BuildRequest(root / "std" / "models" / f"{STD_MODELS[name]}.module",
                                shapes={"B": batch, "T": seq}))
    if result.graph is None:
        raise SystemExit(f"{name}: build failed: {[d.message for d in result.diagnostics]}")
    summary = plan_step(result.graph).summary()
    seconds = time.perf_counter() - start
    regions = [dict(r, ratio=round(r["arena_bytes"] / r["lower_bound_bytes"], 5)
                    if r["lower_bound_bytes"] else 1.0) for r in summary["regions"]]
    return {"model": name, "source": "graph", "build_and_plan_s": round(seconds, 2),
            **{k: v for k, v in summary.items() if k not in ("regions", "invocations")},
            "max_ratio": max(r["ratio"] for r in regions), "regions": regions}


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--seq", type=int, default=4096)
    options.add_argument("--batch", type=int, default=1)
    options.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    options.add_argument("--source", choices=("graph", "synthetic"), default="graph",
                         help="graph: the std models' real Graph IR (default); synthetic: "
                              "generated transformer lifetimes")
    args = options.parse_args(argv)
    records = []
    for name in args.models:
        if args.source == "graph":
            records.append(graph_report(name, args.seq, args.batch))
            continue
        ops, buffers = synthetic_transformer(seq=args.seq, batch=args.batch, dtype_bytes=2,
                                             **MODELS[name])
        records.append(report(name, ops, buffers))
    print_table(records)
    for rec in records:
        print(json.dumps(rec, sort_keys=True))
    missed = [r["model"] for r in records if r["max_ratio"] > TARGET]
    print(f"target modulec / lower bound <= {TARGET} in every region: "
          + (f"MISSED by {', '.join(missed)}" if missed else "met"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
