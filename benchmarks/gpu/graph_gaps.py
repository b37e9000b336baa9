"""Where a captured step's replay time goes: kernel time against the idle gaps between them.

The profile of eager steps (profile_step.py) sums kernel durations; a replay of the step's
CUDA graph also pays the time between one node's end and the next one's start. This
replays the captured step under torch's profiler (CUPTI records each kernel, memset and
copy node of a graph) and prints, for the last profiled replay: its span, the sum of its
nodes' durations, the sum of the gaps between them, how many nodes ran, the gaps by size,
the nodes' time by kind (GEMM, attention, LoRA's own kernels, norms, ...: `KINDS`), and
the largest gaps with the nodes on either side.

    python3 benchmarks/gpu/graph_gaps.py --shape llama3-8b --lora [--batch 1] [--replays 3]
    python3 benchmarks/gpu/graph_gaps.py --shape tinyllama --batch 4
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]

NODE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
GAP_BINS_US = (1, 2, 4, 8, 16, 64, 1e9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=1,
                        help="profiled replays (the last one is summarized)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default="")
    parser.add_argument("--nodes", default="", help="write the last replay's nodes here")
    args = parser.parse_args()
    import torch

    from benchmarks.harness import random_tokens
    from step_ab import STEP_SHAPES, captured

    shape = STEP_SHAPES[args.shape]
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"]).to(torch.int32)
    args.switch = "MODULEC_GRAPH_GAPS_UNUSED"
    step = captured(args, shape, tokens, "1")
    for _ in range(5):
        step(tokens)
    torch.cuda.synchronize()
    step.set_batch(tokens)  # outside the profile: its eager copies are not graph nodes
    nodes = profiled_nodes(step.cuda_graph.replay, args.replays)
    nodes = last_replay(nodes) if args.replays > 1 else nodes
    summary = summarize(nodes, args.top)
    print(f"{torch.cuda.get_device_name()}: {args.shape}{' LoRA' if args.lora else ''} "
          f"B={args.batch} T={args.seq}")
    print(render(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.nodes:
        write_nodes(nodes, args.nodes)


def write_nodes(nodes: list[dict], path: str) -> None:
    """[name, start us, duration us, stream] per node, for a timeline read elsewhere."""
    rows = [[n["name"][:100], float(n["ts"]), float(n["dur"]), n.get("tid")] for n in nodes]
    Path(path).write_text(json.dumps(rows))


def profiled_nodes(replay, replays: int) -> list[dict]:
    """Every graph node CUPTI saw over `replays` replays, as chrome-trace events by start."""
    import torch

    from benchmarks.harness import profiled_events

    def replayed():
        for _ in range(replays):
            replay()
            torch.cuda.synchronize()
    events = profiled_events(replayed)
    nodes = [e for e in events if e.get("cat") in NODE_CATEGORIES and "dur" in e]
    return sorted(nodes, key=lambda e: float(e["ts"]))


def last_replay(nodes: list[dict], idle_us: float = 60.0) -> list[dict]:
    """The nodes after the last idle stretch longer than `idle_us` (the host's sync)."""
    start = 0
    for i in range(1, len(nodes)):
        if float(nodes[i]["ts"]) - end_of(nodes[i - 1]) > idle_us:
            start = i
    return nodes[start:]


def end_of(node: dict) -> float:
    return float(node["ts"]) + float(node["dur"])


def summarize(nodes: list[dict], top: int) -> dict:
    """Span, busy time, gaps by size and the largest gaps of one replay (times in us).

    Nodes on several streams overlap; a gap is counted only where no node runs, so
    busy + gaps = span."""
    busy, gaps, reach = 0.0, [], float(nodes[0]["ts"])
    for i, node in enumerate(nodes):
        start, end = float(node["ts"]), end_of(node)
        if start > reach:
            gaps.append((start - reach, i))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = reach - float(nodes[0]["ts"])
    time_by_name, count = Counter(), Counter()
    for node in nodes:
        time_by_name[node["name"]] += float(node["dur"])
        count[node["name"]] += 1
    bins = Counter(next(b for b in GAP_BINS_US if g < b) for g, _ in gaps)
    largest = sorted(gaps, reverse=True)[:top]
    return {
        "nodes": len(nodes),
        "by_category": dict(Counter(n["cat"] for n in nodes)),
        "span_ms": span / 1e3, "busy_ms": busy / 1e3, "gaps_ms": sum(g for g, _ in gaps) / 1e3,
        "gaps": len(gaps),
        "gap_bins_us": {f"<{b:g}": [bins[b], round(sum(g for g, _ in gaps if _bin(g) == b), 1)]
                        for b in GAP_BINS_US},
        "by_kind": by_kind(nodes),
        "top_names": [{"name": name[:90], "count": count[name], "ms": round(ms / 1e3, 3)}
                      for name, ms in time_by_name.most_common(top * 2)],
        "largest": [{"gap_us": round(g, 2), "after": nodes[i - 1]["name"][:90],
                     "before": nodes[i]["name"][:90]} for g, i in largest],
    }


# what a node's name says it is, first match wins: where a step's kernel time goes by kind
KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "cublas", "splitKreduce")),
         ("attention", ("sdpa", "fmha", "flash", "cudnn")),
         ("lora", ("skinny", "finish_kernel", "block_diag", "scaled_copies")),
         ("norm", ("rms_", "layernorm", "layer_norm")),
         ("activation", ("swiglu", "geglu", "gelu", "silu")),
         ("rope", ("rope",)),
         ("optimizer", ("adamw",)),
         ("loss", ("cross_entropy",)),
         ("fill", ("fill", "memset")),
         ("copy", ("copy", "memcpy")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(m in low for m in marks)), "other")


def by_kind(nodes: list[dict]) -> dict[str, dict]:
    """{kind: {ms, count}} of the nodes' own durations (`KINDS`), the largest first."""
    time_of, count = Counter(), Counter()
    for node in nodes:
        kind = kind_of(node["name"])
        time_of[kind] += float(node["dur"])
        count[kind] += 1
    return {kind: {"ms": round(us / 1e3, 3), "count": count[kind]}
            for kind, us in time_of.most_common()}


def _bin(gap: float) -> float:
    return next(b for b in GAP_BINS_US if gap < b)


def render(summary: dict) -> str:
    lines = [f"span {summary['span_ms']:.2f} ms: busy {summary['busy_ms']:.2f} ms, "
             f"gaps {summary['gaps_ms']:.2f} ms over {summary['gaps']} gaps; "
             f"{summary['nodes']} nodes {summary['by_category']}",
             "gaps by size (count, total us): " + ", ".join(
                 f"{k}: {v[0]} / {v[1]}" for k, v in summary["gap_bins_us"].items())]
    lines.append("by kind (ms, nodes): " + ", ".join(
        f"{kind} {v['ms']:.2f} / {v['count']}" for kind, v in summary["by_kind"].items()))
    for row in summary["top_names"]:
        lines.append(f"  {row['ms']:8.3f} ms {row['count']:5d} x  {row['name']}")
    lines.append("largest gaps:")
    for row in summary["largest"]:
        lines.append(f"  {row['gap_us']:8.2f} us  after {row['after']}  |  before {row['before']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
