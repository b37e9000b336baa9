"""Simulated training step of Llama-3-70B on 64 nodes x 8 H100 (docs/distributed.md,
"Internet scale on paper"): the cost model of `modulec plan`, not a measurement.

Layout: TP 8 inside a node (NVLink), PP 4 and DP 16 across nodes (InfiniBand),
64 x 8 = 512 GPUs = DP 16 x PP 4 x TP 8. Per step each data-parallel replica runs M
micro-batches of B sequences of T tokens through its 4-stage 1F1B pipeline.

1. Compute: the cost model (modulec/plan/cost.py: roofline, GEMMs at 0.8 of 989 TFLOP/s,
   attention at 0.54 / 0.42, memory-bound ops at 0.8 of 3.35 TB/s) on the graph one
   tensor-parallel rank runs: the model built with heads, KV heads, d_ff and vocabulary
   divided by TP (column / row / vocab-parallel shards); norms and residual adds stay
   whole (no sequence parallelism).
2. TP communication: per layer and micro-batch, 2 all-reduces of B x T x d bf16 in the
   forward (after attention's out projection and the MLP's down projection) and 2 in the
   backward, ring all-reduce time = bytes x 2 (TP-1)/TP / bus bandwidth (450 GB/s NVLink),
   not overlapped (added to the stage's compute).
3. Pipeline: `modulec.plan.pipeline` splits the per-rank graph into 4 stages (balanced by
   the cost model) and writes the 1F1B ops; `modulec.plan.pipeline_sim` runs them. Stage
   boundaries cross nodes: each TP rank sends 1/TP of the activations through its own
   400 Gb/s NIC (50 GB/s) and the receivers all-gather over NVLink (Megatron's
   scatter/gather), so the link is TP x 50 GB/s for a whole activation.
4. DP: ZeRO-1 (the distributed optimizer): per step, gradients reduce-scattered and
   updated weights all-gathered over DP ranks, bf16, ring: bytes x (DP-1)/DP / 50 GB/s
   each (one NIC per GPU, all 8 GPUs of a node at once). The reduce-scatter overlaps the
   last micro-batch's backward; the all-gather is exposed (conservative).
5. AdamW on the rank's shard: memory-bound, 16 bytes read + 14 written a parameter.

Step = pipeline (bubble and p2p included) + exposed DP + optimizer. Prints a table, the
formula with the numbers, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modulec.lower.build import BuildRequest, build  # noqa: E402
from modulec.plan.devices import H100  # noqa: E402
from modulec.plan.pipeline import Pipeline, pipeline_section  # noqa: E402
from modulec.plan.pipeline_sim import IB_BYTES_PER_S, simulate  # noqa: E402

LLAMA3_70B = dict(n_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
                  vocab_size=128256, head_dim=128)
NVLINK_BUS_BYTES_PER_S = 450e9
ADAMW_BYTES_PER_PARAM = 30  # bf16 weight + grad, int16 master half, fp32 moments: r + w


@dataclass(frozen=True)
class Setup:
    nodes: int = 64
    gpus_per_node: int = 8
    tp: int = 8
    pp: int = 4
    micro_batch: int = 1          # sequences per micro-batch
    seq: int = 4096
    microbatches: int = 64        # per replica and step
    model: tuple = tuple(LLAMA3_70B.items())

    @property
    def dp(self) -> int:
        return self.nodes * self.gpus_per_node // (self.tp * self.pp)


def rank_graph(setup: Setup):
    """The graph one TP rank runs: the dims TP divides, divided."""
    model = dict(setup.model)
    shard = dict(model, num_heads=model["num_heads"] // setup.tp,
                 num_kv_heads=model["num_kv_heads"] // setup.tp,
                 d_ff=model["d_ff"] // setup.tp, vocab_size=model["vocab_size"] // setup.tp,
                 max_seq=max(setup.seq, 8192))
    request = BuildRequest(ROOT / "std" / "models" / "llama.module",
                           settings={k: str(v) for k, v in shard.items()},
                           shapes={"B": setup.micro_batch, "T": setup.seq})
    result = build(request)
    if result.graph is None:
        raise SystemExit("build failed: " + "; ".join(d.message for d in result.diagnostics))
    return result.graph


def all_reduce_s(nbytes: float, ranks: int, bus: float) -> float:
    return nbytes * 2 * (ranks - 1) / ranks / bus


def ring_half_s(nbytes: float, ranks: int, link: float) -> float:
    """A reduce-scatter or all-gather: each rank moves (n-1)/n of the buffer."""
    return nbytes * (ranks - 1) / ranks / link


def parameters(setup: Setup) -> int:
    m = dict(setup.model)
    d, h, kv, hd, f, v, n = (m[k] for k in ("d_model", "num_heads", "num_kv_heads",
                                            "head_dim", "d_ff", "vocab_size", "n_layers"))
    layer = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f + 2 * d
    return n * layer + 2 * v * d + d


def simulate_step(setup: Setup) -> dict:
    graph = rank_graph(setup)
    section = pipeline_section(graph, Pipeline(setup.pp, setup.microbatches), H100)
    model = dict(setup.model)
    activation = setup.micro_batch * setup.seq * model["d_model"] * 2  # bf16
    tp_ar = all_reduce_s(activation, setup.tp, NVLINK_BUS_BYTES_PER_S) if setup.tp > 1 else 0
    for stage in section["stages"]:  # 2 all-reduces per layer each way, exposed
        layers = sum(u["layers"][1] - u["layers"][0] + 1 for u in stage["units"]
                     if "layers" in u)
        stage["layers"] = layers
        stage["compute_forward_s"], stage["compute_backward_s"] = \
            stage["forward_s"], stage["backward_s"]
        stage["forward_s"] += 2 * layers * tp_ar
        stage["backward_s"] += 2 * layers * tp_ar
    timeline = simulate(section, IB_BYTES_PER_S * setup.tp)
    total = parameters(setup)
    per_rank = total / (setup.tp * setup.pp)
    grads = 2 * per_rank
    reduce_scatter = ring_half_s(grads, setup.dp, IB_BYTES_PER_S)
    all_gather = ring_half_s(grads, setup.dp, IB_BYTES_PER_S)
    last_backward = max(s["backward_s"] for s in section["stages"])
    exposed_dp = max(0.0, reduce_scatter - last_backward) + all_gather
    adamw = per_rank / setup.dp * ADAMW_BYTES_PER_PARAM / H100.bytes_per_s
    step = timeline.step_s + exposed_dp + adamw
    tokens = setup.dp * setup.microbatches * setup.micro_batch * setup.seq
    gpus = setup.nodes * setup.gpus_per_node
    return {
        "setup": asdict(setup) | {"dp": setup.dp, "gpus": gpus, "model": dict(setup.model)},
        "parameters": total, "parameters_per_rank": per_rank,
        "stages": [{"stage": s["stage"], "layers": s["layers"],
                    "forward_ms": s["forward_s"] * 1e3, "backward_ms": s["backward_s"] * 1e3,
                    "compute_forward_ms": s["compute_forward_s"] * 1e3,
                    "compute_backward_ms": s["compute_backward_s"] * 1e3}
                   for s in section["stages"]],
        "tp_all_reduce_ms": tp_ar * 1e3,
        "p2p_bytes_per_microbatch": section["boundaries"][0]["activation_bytes"]
        if section["boundaries"] else 0,
        "pipeline_ms": timeline.step_s * 1e3, "bubble_fraction": timeline.bubble,
        "ideal_bubble_fraction": timeline.ideal_bubble,
        "dp_reduce_scatter_ms": reduce_scatter * 1e3, "dp_all_gather_ms": all_gather * 1e3,
        "dp_exposed_ms": exposed_dp * 1e3, "adamw_ms": adamw * 1e3,
        "step_s": step, "tokens_per_step": tokens, "tokens_per_s": tokens / step,
        "mfu": 6 * total * tokens / step / (gpus * H100.peak_flops),
    }


def report(r: dict) -> str:
    s = r["setup"]
    lines = [f"Llama-3-70B ({r['parameters'] / 1e9:.1f}B parameters) on {s['nodes']} nodes x "
             f"{s['gpus_per_node']} H100 = {s['gpus']} GPUs: TP {s['tp']} x PP {s['pp']} x "
             f"DP {s['dp']}, micro-batch {s['micro_batch']} x {s['seq']} tokens, "
             f"{s['microbatches']} micro-batches per replica and step",
             "stage  layers  forward ms  backward ms  (compute only: fwd / bwd)"]
    lines += [f"{t['stage']:>5}  {t['layers']:>6}  {t['forward_ms']:>10.2f}  "
              f"{t['backward_ms']:>11.2f}  ({t['compute_forward_ms']:.2f} / "
              f"{t['compute_backward_ms']:.2f})" for t in r["stages"]]
    lines += [
        f"TP all-reduce per layer and direction: 2 x {r['tp_all_reduce_ms']:.3f} ms",
        f"pipeline (1F1B, simulated): {r['pipeline_ms']:.1f} ms, bubble "
        f"{r['bubble_fraction']:.1%} (ideal {r['ideal_bubble_fraction']:.1%})",
        f"DP ZeRO-1: reduce-scatter {r['dp_reduce_scatter_ms']:.1f} ms + all-gather "
        f"{r['dp_all_gather_ms']:.1f} ms, exposed {r['dp_exposed_ms']:.1f} ms; AdamW "
        f"{r['adamw_ms']:.2f} ms",
        f"step = pipeline + exposed DP + AdamW = {r['pipeline_ms']:.1f} + "
        f"{r['dp_exposed_ms']:.1f} + {r['adamw_ms']:.2f} = {r['step_s'] * 1e3:.1f} ms",
        f"{r['tokens_per_step'] / 1e6:.2f}M tokens a step: {r['tokens_per_s'] / 1e6:.2f}M "
        f"tokens/s, MFU {r['mfu']:.1%} (6 N tokens / step / (GPUs x 989 TFLOP/s))"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("nodes", 64), ("tp", 8), ("pp", 4), ("microbatches", 64),
                          ("micro-batch", 1), ("seq", 4096)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    setup = Setup(nodes=args.nodes, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch,
                  seq=args.seq, microbatches=args.microbatches)
    result = simulate_step(setup)
    print(report(result))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
