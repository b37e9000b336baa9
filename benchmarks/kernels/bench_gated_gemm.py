"""Time SwiGLU's GEMM + activation pairs against quack's GEMMs with the activation fused.

The LoRA step runs each pair as cuBLAS, then our swiglu kernel; quack's gated GEMMs apply
the activation in the GEMM's epilogue (the quack-kernels package: CuTe DSL kernels for
SM90 / SM100).

- forward: gu = [x | h] [W_gate ; W_up]^T, then h = silu(g) * u (our swiglu_forward),
  against quack's `gemm_act` writing gu and h in one kernel, over W laid interleaved and
  over W as it lies, its rows read interleaved in place (`concat_layout`);
- backward: d_h = [d_y | d_t] [W_down ; A] (down_proj's one-GEMM d_x), then
  d_g, d_u = swiglu_backward(d_h, g, u), against quack's `gemm_dact` reading gu in its
  epilogue and writing d_g, d_u (and silu(g) * u again, which it always stores);
- gate/up's d_x = d_gu W: cuBLAS over [d_g | d_u], against quack's GEMM over the
  interleaved d_gu that `gemm_dact` writes, reading W's [gate; up] rows interleaved in
  place (`concat_layout`), so W need not be laid again.

Both gated GEMMs run again writing h and d_gu rows apart, as the step lays them (down's
input [h | t], gate/up's one-GEMM d_x scratch [d_gu | d_t]).

quack's gated epilogues pair adjacent output columns: its gu and d_gu are interleaved
(g0, u0, g1, u1, ...), from W's [gate; up] rows taken interleaved. Each side is captured
in a CUDA graph of `--calls` calls and replayed; the rounds take the sides in turn. "burst"
rests 50 ms before each replay (the card at its full clock), "held" replays back to back,
where a 700 W card runs at its power cap as the training step does. Before timing, quack's
outputs are checked against ours and against fp32 math on the same bf16 gu.

    python benchmarks/kernels/bench_gated_gemm.py [--tokens 2048] [--dim 4096]
        [--ffn 14336] [--rank 16] [--calls 10] [--rounds 15] [--json out.json]

quack-kernels 0.6.5 and its CuTe DSL come from the pins in benchmarks/gpu/fa4_wheels.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import graphed, replay_us  # noqa: E402
from runtime.cuda.gated_gemm import deinterleaved, interleaved, quack_gated  # noqa: E402

BF16 = torch.bfloat16


def operands(tokens, dim, ffn, rank):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(BF16)
    k_fwd, k_bwd = dim + 2 * rank, dim + rank  # [x | h] for gate/up, [d_y | d_t] for down
    return {"x": rand(tokens, k_fwd, scale=0.5), "w": rand(2 * ffn, k_fwd, scale=0.02),
            "d_y": rand(tokens, k_bwd, scale=0.5), "w_down": rand(k_bwd, ffn, scale=0.02),
            "w_dx": rand(2 * ffn, dim, scale=0.02), "rank": rank}


def sides(ops, ext, gemm_act, gemm_dact, gemm):
    """({group: {name: fn}}, the buffers they write)."""
    x, w, d_y, w_down, w_dx = (ops[k] for k in ("x", "w", "d_y", "w_down", "w_dx"))
    tokens, ffn, r = x.shape[0], w.shape[0] // 2, ops["rank"]
    w_il = interleaved(w, 0)
    buf = {name: torch.empty(tokens, n, device="cuda", dtype=BF16) for name, n in (
        ("gu", 2 * ffn), ("h", ffn), ("d_h", ffn), ("d_gu", 2 * ffn), ("q_gu", 2 * ffn),
        ("q_h", ffn), ("q_d_gu", 2 * ffn), ("q_h_again", ffn), ("d_x", w_dx.shape[1]),
        ("q_d_x", w_dx.shape[1]), ("h_wide", ffn + r), ("d_gu_wide", 2 * ffn + 2 * r))}
    gu, d_gu = buf["gu"], buf["d_gu"]
    # the step's layouts: h written into down's wide input [h | t], d_gu into gate/up's
    # one-GEMM d_x scratch [d_gu | d_t] (rows apart, lora_kcat.py)
    buf["q_h_apart"], buf["q_d_gu_apart"] = buf["h_wide"][:, :ffn], buf["d_gu_wide"][:, :2 * ffn]

    def cublas_swiglu():
        torch.mm(x, w.t(), out=gu)
        ext.swiglu_forward(gu[:, :ffn], gu[:, ffn:], [buf["h"]], activation=0)

    def cublas_swiglu_backward():
        torch.mm(d_y, w_down, out=buf["d_h"])
        ext.swiglu_backward(buf["d_h"], gu[:, :ffn], gu[:, ffn:],
                            [d_gu[:, :ffn], d_gu[:, ffn:]], activation=0)

    def quack_act():
        gemm_act(x, w_il.t(), activation="swiglu", preact_out=buf["q_gu"],
                 postact_out=buf["q_h"], tuned=True)

    def quack_act_concat():  # W's [gate; up] rows read interleaved in place: not laid again
        gemm_act(x.unsqueeze(0), w.t().unsqueeze(0), activation="swiglu",
                 preact_out=buf["q_gu"].unsqueeze(0), postact_out=buf["q_h"].unsqueeze(0),
                 concat_layout=("B",), tuned=True)

    def quack_act_apart():
        gemm_act(x.unsqueeze(0), w.t().unsqueeze(0), activation="swiglu",
                 preact_out=buf["q_gu"].unsqueeze(0),
                 postact_out=buf["q_h_apart"].unsqueeze(0), concat_layout=("B",), tuned=True)

    def quack_dact_apart():
        gemm_dact(d_y, w_down, buf["q_gu"], activation="swiglu", dx_out=buf["q_d_gu_apart"],
                  postact_out=buf["q_h_again"], tuned=True)

    def quack_dact():
        gemm_dact(d_y, w_down, buf["q_gu"], activation="swiglu", dx_out=buf["q_d_gu"],
                  postact_out=buf["q_h_again"], tuned=True)

    def quack_dx():  # 3-D operands: quack's concat_layout wants a batch mode
        gemm(buf["q_d_gu"].unsqueeze(0), w_dx.unsqueeze(0), out=buf["q_d_x"].unsqueeze(0),
             concat_layout=("B",), tuned=True)
    return {"forward": {"cublas + swiglu": cublas_swiglu, "quack gemm_act": quack_act,
                        "quack gemm_act concat B": quack_act_concat,
                        "concat B, h rows apart": quack_act_apart,
                        "cublas alone": lambda: torch.mm(x, w.t(), out=gu)},
            "backward": {"cublas + swiglu_backward": cublas_swiglu_backward,
                         "quack gemm_dact": quack_dact,
                         "d_gu rows apart": quack_dact_apart,
                         "cublas alone": lambda: torch.mm(d_y, w_down, out=buf["d_h"])},
            "gate/up d_x": {"cublas": lambda: torch.mm(d_gu, w_dx, out=buf["d_x"]),
                            "quack concat B": quack_dx}}, buf


def errors(buf, ffn, w_dx) -> dict:
    """Each side's largest error against fp32 math on the same bf16 inputs (relative to the
    largest value), and whether quack's gu has cuBLAS's bits. Both activations' errors are
    taken against math on cuBLAS's bf16 gu and d_h, which quack's epilogues never see:
    they apply the activation to the fp32 accumulator."""
    gu = buf["gu"].float()
    g, u = gu[:, :ffn], gu[:, ffn:]
    sig = torch.sigmoid(g)
    h32 = g * sig * u
    d_h = buf["d_h"].float()
    d_g32, d_u32 = d_h * u * sig * (1 + g * (1 - sig)), d_h * g * sig
    d_gu32 = interleaved(torch.cat([d_g32, d_u32], 1), 1)

    def rel(a, ref):
        return ((a.float() - ref).abs().max() / ref.abs().max()).item()
    return {"gu_bits_equal": bool(torch.equal(buf["q_gu"], interleaved(buf["gu"], 1))),
            "h_ours": rel(buf["h"], h32), "h_quack": rel(buf["q_h"], h32),
            "d_gu_ours": rel(interleaved(buf["d_gu"], 1), d_gu32),
            "d_gu_quack": rel(buf["q_d_gu"], d_gu32),
            "h_rows_apart_bits_equal": bool(torch.equal(buf["q_h_apart"], buf["q_h"])),
            "d_gu_rows_apart_bits_equal": bool(torch.equal(buf["q_d_gu_apart"], buf["q_d_gu"])),
            "d_x_ours": rel(buf["d_x"], buf["d_gu"].float() @ w_dx.float()),
            "d_x_quack": rel(buf["q_d_x"], deinterleaved(buf["q_d_gu"], 1).float() @ w_dx.float())}


def timed(fns: dict, calls: int, rounds: int) -> dict:
    """{mode: {name: median us a call}}, the sides taken in turn in each round."""
    graphs = {name: graphed(fn, calls) for name, fn in fns.items()}
    out = {}
    for mode, rest in (("burst", 0.05), ("held", 0.0)):
        samples = {name: [] for name in graphs}
        for i in range(rounds + 2):
            names = list(graphs)[i % len(graphs):] + list(graphs)[:i % len(graphs)]
            for name in names:
                us = replay_us(graphs[name], calls, rest)
                if i >= 2:  # two rounds of warm-up
                    samples[name].append(us)
        out[mode] = {name: statistics.median(s) for name, s in samples.items()}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from runtime.cuda.build import load

    gated = quack_gated()
    if isinstance(gated, str):
        sys.exit(f"quack's gated GEMMs are not available: {gated}")
    ops = operands(args.tokens, args.dim, args.ffn, args.rank)
    groups, buf = sides(ops, load(), *gated)
    started = time.time()
    for group in groups.values():
        for name, fn in list(group.items()):
            try:
                fn()  # quack tunes and compiles each problem on its first call
            except Exception as error:  # a layout quack refuses: reported, not timed
                print(f"{name}: {type(error).__name__}: {str(error)[:300]}")
                del group[name]
    torch.cuda.synchronize()
    compiled_s = time.time() - started
    checks = errors(buf, args.ffn, ops["w_dx"])
    results = {name: timed(group, args.calls, args.rounds) for name, group in groups.items()}
    print(f"{torch.cuda.get_device_name()}: T={args.tokens} d={args.dim} ffn={args.ffn} "
          f"LoRA r={args.rank} (K {args.dim + 2 * args.rank} forward, "
          f"{args.dim + args.rank} backward); us a call, medians of {args.rounds} rounds "
          f"of {args.calls} calls in a CUDA graph; first calls (tuning) {compiled_s:.0f} s")
    for side, modes in results.items():
        for mode, row in modes.items():
            print(f"{side:12s}{mode:6s}" + "".join(f"{n:>27s} {t:7.1f}" for n, t in row.items()))
    print("errors against fp32 math on the same bf16 gu (max relative): " + ", ".join(
        f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in checks.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "args": vars(args), "first_calls_s": compiled_s, "errors": checks,
            "us_per_call": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
