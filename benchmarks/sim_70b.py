"""Simulated training step of Llama-3-70B on 64 nodes x 8 H100 (docs/distributed.md,
"Internet scale on paper"): the cost model of `modulec plan`, not a measurement.

Layout: TP 8 inside a node (NVLink), PP 4 and DP 16 across nodes (InfiniBand),
64 x 8 = 512 GPUs = DP 16 x PP 4 x TP 8. Per step each data-parallel replica runs M
micro-batches of B sequences of T tokens through its 4-stage 1F1B pipeline.

1. Compute: the cost model (modulec/plan/cost.py, calibrated in docs/decisions.md "Cost
   model calibration": GEMMs at 0.78 of 989 TFLOP/s in whole waves of 256 x 128 tiles,
   attention at 0.54 / 0.42 scaled by head dim and keys, memory-bound ops at 0.8 of 3.35
   TB/s, norm backwards and RoPE at their measured shares) on the graph one
   tensor-parallel rank runs: the model built with heads, KV heads, d_ff and vocabulary
   divided by TP (column / row / vocab-parallel shards); norms and residual adds stay
   whole (no sequence parallelism).
2. TP communication: per layer and micro-batch, 2 all-reduces of B x T x d bf16 in the
   forward (after attention's out projection and the MLP's down projection) and 2 in the
   backward, ring all-reduce time = bytes x 2 (TP-1)/TP / bus bandwidth (450 GB/s NVLink
   x TP_EFFICIENCY 0.3: what the measured TP steps cost, see the cut below), not
   overlapped (added to the stage's compute).
3. Pipeline: `modulec.plan.pipeline` splits the per-rank graph into 4 stages (balanced by
   the cost model) and writes the 1F1B ops; `modulec.plan.pipeline_sim` runs them. Stage
   boundaries cross nodes: each TP rank sends 1/TP of the activations through its own
   400 Gb/s NIC (50 GB/s) and the receivers all-gather over NVLink (Megatron's
   scatter/gather), so the link is TP x 50 GB/s for a whole activation.
4. DP: ZeRO-1 (the distributed optimizer): per step, gradients reduce-scattered and
   updated weights all-gathered over DP ranks, bf16, ring: bytes x (DP-1)/DP / 50 GB/s
   each (one NIC per GPU, all 8 GPUs of a node at once), plus DP_COLLECTIVE_S (0.11 ms)
   for each of a stage's per-bucket collectives: the reduce-scatter overlaps the last
   micro-batch's backward but costs its time all the same (measured on one node, see the
   cut below); the all-gather is exposed.
5. AdamW on the rank's shard: memory-bound, 16 bytes read + 14 written a parameter.

Step = pipeline (bubble and p2p included) + exposed DP + optimizer. Prints a table, the
formula with the numbers, and one JSON line.

A cut on one node (`--layers N --tp M --dp D --pp 1 --batch B --seq T --device h100|h200
[--zero S] [--shape llama3-70b|llama3-8b|tinyllama]`; issue 20): the step of
benchmarks/train_step_dist.py's `modulec_zero{S}_tp{M}` (or `modulec_zero{S}`, TP 1) on
D x M GPUs of one node, predicted for the measured run to be set against:
  compute   the cost model on the program one TP rank runs, built as the GPU step builds
            it (`tensor_parallel=M`: heads, KV heads and d_ff divided; embedding, norms
            and LM head whole on every rank), B sequences of T tokens
  TP        each all-reduce of the program (tp_all_reduce forward, tp_copy's backward:
            2 + 2 per layer, B x T x d bf16 each) as a ring at TP_EFFICIENCY (0.3) of the
            NVLink bus bandwidth (450 GB/s: 135 GB/s), on the compute stream, not
            overlapped. 0.3: what the measured TP steps leave for their all-reduces beyond
            the rest of the model: 0.30 of 450 GB/s for the 70B cut's TP 4, 0.25 and 0.15
            for Llama-3-8B's and the 70B cut's DP 2 x TP 2 (4 x H200), 0.55 for TinyLlama's
            TP 2 (2 x H100, results-h100x4-train_step_dist-tp2-sp.txt). The program
            overlaps each backward all-reduce of an input gradient with the weight
            gradient's GEMM (modulec.lower.tp_overlap); `tp_hideable_ms` is the most that
            can hide (per async all-reduce, the lesser of its ring time and the cost
            model's time of the nodes before its wait), not subtracted from the step:
            the constants above were measured in order, and what NCCL's kernels take
            from the GEMMs beside them is not modelled
  DP        D > 1: the rank's bf16 gradients (ZeRO 0: all-reduced; 1-2: reduce-scattered
            and the updated weights all-gathered; 3: the weights gathered again for the
            forward and the backward) over NVLink (450 GB/s), on the communication
            stream, one bucket a layer or entry parameter (ZeRO 0: 1 collective a bucket,
            1-2: 2, 3: 3): hidden under the compute, they still cost the step their ring
            time plus DP_COLLECTIVE_S (0.11 ms) each (NCCL's kernels take SMs and HBM
            bandwidth from the compute they overlap, each bucket syncs two streams).
            From TinyLlama ZeRO-2 on 4 and 2 H200s: the +ms over one GPU plus the AdamW
            share it saves is 12.8 and 10.5 ms, ring time 7.3 and 4.9 ms, 50 collectives
  loss      cross-entropy over the rank's block of the vocabulary (V / TP logits a
            token, vocab-parallel): the logits read and their gradient written, bf16, at
            0.5 of HBM (results_cross_entropy_h200.json: 2.4-2.8 TB/s)
  AdamW     the rank's parameters (its ZeRO share at stage >= 1), 30 bytes each at the
            device's memory bandwidth (0.8 of 3.35 TB/s on the H100, 4.8 TB/s on the H200)
Step = compute + TP + DP + loss + AdamW. No launch gaps (none in a CUDA graph), no rank
imbalance.
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
from modulec.plan.cost import node_cost, step_seconds, value_table  # noqa: E402
from modulec.plan.devices import H100, device  # noqa: E402
from modulec.plan.distributed import (COMPUTE_BYTES, GRAD_BYTES, LOW_BYTES,  # noqa: E402
                                      MOMENT_BYTES)
from modulec.plan.from_graph import _bytes  # noqa: E402
from modulec.plan.pipeline import Pipeline, pipeline_section  # noqa: E402
from modulec.plan.pipeline_sim import IB_BYTES_PER_S, simulate  # noqa: E402

LLAMA3_70B = dict(n_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
                  vocab_size=128256, head_dim=128)
# benchmarks/train_step_dist.py's other shapes, for a cut's prediction (--shape)
SHAPES = {"llama3-70b": LLAMA3_70B,
          "llama3-8b": dict(n_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                            d_ff=14336, vocab_size=128256, head_dim=128),
          "tinyllama": dict(n_layers=22, d_model=2048, num_heads=32, num_kv_heads=4,
                            d_ff=5632, vocab_size=32000, head_dim=64)}
NVLINK_BUS_BYTES_PER_S = 450e9
TP_EFFICIENCY = 0.3     # TP all-reduces' share of the bus bandwidth (measured TP steps)
DP_COLLECTIVE_S = 0.11e-3  # a DP collective's fixed cost beyond its ring time
ENTRY_BUCKETS = 3       # the entry parameters' buckets: embedding, final norm, LM head
LOSS_BYTES_PER_LOGIT = 4  # bf16 logit read + its gradient written
LOSS_BANDWIDTH = 0.5    # cross-entropy's share of HBM (results_cross_entropy_h200.json)
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
    return llama_graph(shard, setup.micro_batch, setup.seq)


def llama_graph(settings: dict, batch: int, seq: int, tp: int = 1):
    """std/models/llama.module built at these settings for B x T (with `tp` > 1: the
    program one tensor-parallel rank runs, its collectives in it)."""
    request = BuildRequest(ROOT / "std" / "models" / "llama.module",
                           settings={k: str(v) for k, v in settings.items()},
                           shapes={"B": batch, "T": seq}, tensor_parallel=tp)
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
    return model_parameters(dict(setup.model))


def model_parameters(m: dict, tp: int = 1) -> int:
    """Parameters of the model, or with `tp` those one rank of the GPU step holds: the
    layers' matmuls, the embedding and the LM head (untied; `@shard(vocab)`) divided by
    TP, norms whole."""
    d, h, kv, hd, f, v, n = (m[k] for k in ("d_model", "num_heads", "num_kv_heads",
                                            "head_dim", "d_ff", "vocab_size", "n_layers"))
    layer = (d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f) // tp + 2 * d
    return n * layer + 2 * v * d // tp + d


def simulate_step(setup: Setup) -> dict:
    graph = rank_graph(setup)
    section = pipeline_section(graph, Pipeline(setup.pp, setup.microbatches), H100)
    model = dict(setup.model)
    activation = setup.micro_batch * setup.seq * model["d_model"] * 2  # bf16
    tp_ar = all_reduce_s(activation, setup.tp, NVLINK_BUS_BYTES_PER_S * TP_EFFICIENCY) \
        if setup.tp > 1 else 0
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
    layers = max(s["layers"] for s in section["stages"])  # the reduce-scatter overlaps
    exposed_dp = reduce_scatter + all_gather + \
        2 * (layers + ENTRY_BUCKETS) * DP_COLLECTIVE_S  # the backward, still paid
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


# ---------------------------------------------------------------------- a cut on one node
GPUS_PER_NODE = 8
TP_REDUCED = ("tp_all_reduce", "tp_copy_backward")  # the ops that all-reduce over TP


@dataclass(frozen=True)
class Cut:
    """`layers` of a shape's stack on dp x tp GPUs of one node (pp 1), as
    benchmarks/train_step_dist.py runs it: `batch` sequences of `seq` tokens per
    data-parallel rank (the ranks of a TP group share them), ZeRO stage `zero`."""

    layers: int
    tp: int = 1
    dp: int = 1
    batch: int = 1
    seq: int = 4096
    zero: int = 1
    device: str = "h100"
    shape: str = "llama3-70b"
    nvlink: float = NVLINK_BUS_BYTES_PER_S

    @property
    def model(self) -> dict:
        return dict(SHAPES[self.shape], n_layers=self.layers)


def tp_reduced(graph) -> tuple[float, int]:
    """(bytes, count) of the tensor-parallel all-reduces one step of `graph` runs: each
    `tp_all_reduce` of the forward and each `tp_copy` gradient of the backward, a repeated
    call's once per repetition."""
    memo: dict = {}

    def walk(name: str) -> tuple[float, int]:
        if name not in memo:
            function = graph.function(name)
            values = value_table(graph, function)
            total, count = 0.0, 0
            for node in function.nodes:
                if node.kind == "call":
                    inner = walk(node.target)
                    total += int(node.repeat) * inner[0]
                    count += int(node.repeat) * inner[1]
                elif node.kind == "op" and node.target in TP_REDUCED:
                    total += _bytes(values.value(node.inputs[0]))
                    count += 1
            memo[name] = (total, count)
        return memo[name]

    forward = walk(graph.entry)
    backward = walk(graph.backward) if graph.backward else (0.0, 0)
    return forward[0] + backward[0], forward[1] + backward[1]


def tp_hideable_s(graph, profile, ranks: int, bus: float) -> float:
    """The most of the backward all-reduces the program overlaps (`stream=comm`,
    modulec.lower.tp_overlap) that the compute before each one's wait can hide: per
    async all-reduce, min(its ring time at `bus`, the cost model's time of the nodes
    between it and its wait), a repeated call's once per repetition."""
    memo: dict = {}

    def walk(name: str) -> float:
        if name not in memo:
            function = graph.function(name)
            values = value_table(graph, function)
            waits = {n.target: i for i, n in enumerate(function.nodes) if n.kind == "wait"}
            total = 0.0
            for i, node in enumerate(function.nodes):
                if node.kind == "call":
                    total += int(node.repeat) * walk(node.target)
                elif node.target in TP_REDUCED and node.id in waits:
                    ring = all_reduce_s(_bytes(values.value(node.inputs[0])), ranks, bus)
                    between = sum(node_cost(values, n).seconds(profile)
                                  for n in function.nodes[i + 1:waits[node.id]]
                                  if n.kind == "op")
                    total += min(ring, between)
            memo[name] = total
        return memo[name]

    return walk(graph.backward) if graph.backward else 0.0


def dp_seconds(cut: Cut, params: int) -> tuple[float, float]:
    """(forward, backward) time of the data-parallel collectives of the rank's bf16
    gradients / weights over NVLink: ZeRO 0 all-reduces; 1-2 reduce-scatter and all-gather
    the updated weights; 3 also gathers the weights for the forward and the backward."""
    if cut.dp == 1:
        return 0.0, 0.0
    grads = GRAD_BYTES * params
    half = ring_half_s(grads, cut.dp, cut.nvlink)
    if cut.zero == 0:
        return 0.0, all_reduce_s(grads, cut.dp, cut.nvlink)
    if cut.zero == 3:
        return half, 3 * half
    return 0.0, 2 * half


def dp_collectives(cut: Cut) -> int:
    """The DP collectives a step issues: one bucket per layer and entry parameter, ZeRO 0
    all-reduces it, 1-2 reduce-scatter and all-gather, 3 also gathers for the forward."""
    if cut.dp == 1:
        return 0
    return (cut.layers + ENTRY_BUCKETS) * {0: 1, 3: 3}.get(cut.zero, 2)


def predict_cut(cut: Cut) -> dict:
    """The predicted step of `cut` (docstring: compute + TP + DP + loss + AdamW)."""
    if cut.tp * cut.dp > GPUS_PER_NODE:
        raise ValueError(f"TP {cut.tp} x DP {cut.dp} is more than the "
                         f"{GPUS_PER_NODE} GPUs of a node")
    profile = device(cut.device)
    model = cut.model
    graph = llama_graph(dict(model, max_seq=max(cut.seq, 8192)), cut.batch, cut.seq, cut.tp)
    compute = step_seconds(graph, profile)
    tp_bytes, tp_count = tp_reduced(graph)
    tp_s = all_reduce_s(tp_bytes, cut.tp, cut.nvlink * TP_EFFICIENCY) if cut.tp > 1 else 0.0
    hideable = tp_hideable_s(graph, profile, cut.tp, cut.nvlink * TP_EFFICIENCY) \
        if cut.tp > 1 else 0.0
    params = model_parameters(model, cut.tp)
    dp_forward, dp_backward = dp_seconds(cut, params)
    exposed = max(0.0, dp_forward - compute["forward_s"]) + \
        max(0.0, dp_backward - compute["backward_s"])
    dp_cost = dp_forward + dp_backward + dp_collectives(cut) * DP_COLLECTIVE_S
    shards = cut.dp if cut.zero >= 1 else 1
    adamw = params / shards * ADAMW_BYTES_PER_PARAM / profile.bytes_per_s
    loss = cut.batch * cut.seq * model["vocab_size"] // cut.tp * LOSS_BYTES_PER_LOGIT / \
        (LOSS_BANDWIDTH * profile.hbm_bytes_per_s)
    step = compute["step_s"] + tp_s + dp_cost + loss + adamw
    tokens = cut.batch * cut.seq * cut.dp
    gpus = cut.tp * cut.dp
    state = params * (COMPUTE_BYTES / (cut.dp if cut.zero == 3 else 1) +
                      (LOW_BYTES + MOMENT_BYTES) / shards)
    return {"cut": asdict(cut) | {"gpus": gpus, "model": model},
            "parameters": model_parameters(model), "parameters_per_rank": params,
            "state_bytes_per_rank": state,
            "compute_forward_ms": compute["forward_s"] * 1e3,
            "compute_backward_ms": compute["backward_s"] * 1e3,
            "tp_all_reduces": tp_count, "tp_bytes": tp_bytes, "tp_ms": tp_s * 1e3,
            "tp_hideable_ms": hideable * 1e3,
            "dp_forward_ms": dp_forward * 1e3, "dp_backward_ms": dp_backward * 1e3,
            "dp_exposed_ms": exposed * 1e3, "dp_ms": dp_cost * 1e3, "loss_ms": loss * 1e3,
            "adamw_ms": adamw * 1e3,
            "step_s": step, "tokens_per_step": tokens, "tokens_per_s": tokens / step,
            "tokens_per_s_per_gpu": tokens / step / gpus,
            "mfu": 6 * model_parameters(model) * tokens / step / (gpus * profile.peak_flops)}


def report_cut(r: dict) -> str:
    c = r["cut"]
    return "\n".join([
        f"{c['shape']} cut to {c['layers']} layers ({r['parameters'] / 1e9:.2f}B parameters, "
        f"{r['parameters_per_rank'] / 1e9:.2f}B a rank) on {c['gpus']} {c['device']} of one "
        f"node: DP {c['dp']} (ZeRO {c['zero']}) x TP {c['tp']}, B={c['batch']} x T="
        f"{c['seq']} per data-parallel rank",
        f"compute (cost model, one rank's program): forward {r['compute_forward_ms']:.2f} ms "
        f"+ backward {r['compute_backward_ms']:.2f} ms",
        f"TP: {r['tp_all_reduces']} all-reduces, {r['tp_bytes'] / 2 ** 30:.2f} GiB a step, "
        f"ring over {c['nvlink'] * TP_EFFICIENCY / 1e9:.0f} GB/s ({TP_EFFICIENCY} of "
        f"{c['nvlink'] / 1e9:.0f}): {r['tp_ms']:.2f} ms, of which the backward overlap "
        f"can hide up to {r['tp_hideable_ms']:.2f} ms (not subtracted)",
        f"DP: forward {r['dp_forward_ms']:.2f} ms, backward {r['dp_backward_ms']:.2f} ms of "
        f"collectives at {c['nvlink'] / 1e9:.0f} GB/s, exposed {r['dp_exposed_ms']:.2f} ms, "
        f"cost {r['dp_ms']:.2f} ms (+{DP_COLLECTIVE_S * 1e3:.2f} ms a collective); loss "
        f"{r['loss_ms']:.2f} ms; AdamW {r['adamw_ms']:.2f} ms",
        f"step = compute + TP + DP + loss + AdamW = {r['step_s'] * 1e3:.1f} ms: "
        f"{r['tokens_per_s']:.0f} tokens/s, {r['tokens_per_s_per_gpu']:.0f} per GPU, MFU "
        f"{r['mfu']:.1%}; state {r['state_bytes_per_rank'] / 2 ** 30:.1f} GiB a rank "
        f"(weights, master low halves, moments; no activations)"])


CUT_OPTIONS = ("layers", "dp", "batch", "zero", "device", "shape", "nvlink")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("nodes", 64), ("tp", None), ("pp", None), ("microbatches", 64),
                          ("micro-batch", 1), ("seq", 4096)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--layers", type=int, help="a cut on one node: its layers")
    parser.add_argument("--dp", type=int, help="a cut: data-parallel ranks (default 1)")
    parser.add_argument("--batch", type=int, help="a cut: sequences per data-parallel rank")
    parser.add_argument("--zero", type=int, choices=range(4), help="a cut: ZeRO stage")
    parser.add_argument("--device", choices=["h100", "h200"], help="a cut: the GPU")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a cut: the model")
    parser.add_argument("--nvlink", type=float, help="a cut: NVLink bus bandwidth, GB/s "
                        f"(default {NVLINK_BUS_BYTES_PER_S / 1e9:.0f})")
    args = parser.parse_args(argv)
    if any(getattr(args, name) is not None for name in CUT_OPTIONS):
        main_cut(parser, args)
        return
    setup = Setup(nodes=args.nodes, tp=args.tp or 8, pp=args.pp or 4,
                  micro_batch=args.micro_batch, seq=args.seq, microbatches=args.microbatches)
    result = simulate_step(setup)
    print(report(result))
    print(json.dumps(result, sort_keys=True))


def main_cut(parser, args) -> None:
    if args.pp not in (None, 1):
        parser.error("a cut runs on one node without a pipeline: --pp 1")
    shape = args.shape or "llama3-70b"
    cut = Cut(layers=args.layers or SHAPES[shape]["n_layers"], tp=args.tp or 1,
              dp=args.dp or 1, batch=args.batch or 1, seq=args.seq,
              zero=1 if args.zero is None else args.zero, device=args.device or "h100",
              shape=shape, nvlink=(args.nvlink or NVLINK_BUS_BYTES_PER_S / 1e9) * 1e9)
    try:
        result = predict_cut(cut)
    except ValueError as exc:
        parser.error(str(exc))
    print(report_cut(result))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
