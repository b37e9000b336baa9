"""A simulated timeline of a pipeline section's ops (`modulec plan --pp`, `modulec build
--emit pipeline`): what the 1F1B schedule costs before any GPU runs it.

Each stage runs its ops in order on one clock. A `forward` or `backward` takes the
stage's predicted time for one micro-batch (modulec.plan.cost through
modulec.plan.pipeline); a `send` occupies the link for latency + bytes / bandwidth and
does not hold the stage (an isend); a `recv` holds the stage until the matching send's
data has arrived; an `all_reduce` (data parallel over the pipelines) holds the stage for
a ring all-reduce of its bucket's bytes over the mesh's dp ranks on the same link (a
ZeRO-1 `broadcast` the bytes once; the `optimizer_step` takes no time here); a `shared`
entry's all-reduce waits for every stage of the entry to reach it and then takes a ring
all-reduce of its bytes over those stages. A
stage's idle time is the step time less its compute; the bubble
fraction is the idle share of all stages' time (for equal stages and free links:
(P - 1) / (M + P - 1)). Ops that can never run (a recv whose send never comes) are a
deadlock, reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NVLINK_BYTES_PER_S = 450e9     # H100 NVLink 4, one direction (18 links x 25 GB/s)
IB_BYTES_PER_S = 50e9          # one 400 Gb/s InfiniBand NIC per GPU
P2P_LATENCY_S = 10e-6          # a small NCCL send/recv, launch to arrival
LINKS = {"nvlink": NVLINK_BYTES_PER_S, "ib": IB_BYTES_PER_S}


class Deadlock(ValueError):
    pass


@dataclass
class StageTimeline:
    stage: int
    busy_s: float = 0.0
    end_s: float = 0.0
    spans: list = field(default_factory=list)   # (start, end, kind, microbatch)


@dataclass
class Timeline:
    stages: list[StageTimeline]
    step_s: float
    microbatches: int

    @property
    def bubble(self) -> float:
        total = self.step_s * len(self.stages)
        return 1 - sum(s.busy_s for s in self.stages) / total if total else 0.0

    @property
    def ideal_bubble(self) -> float:
        p, m = len(self.stages), self.microbatches
        return (p - 1) / (m + p - 1)

    def summary(self) -> dict:
        return {"step_s": self.step_s, "microbatches": self.microbatches,
                "bubble_fraction": self.bubble, "ideal_bubble_fraction": self.ideal_bubble,
                "stages": [{"stage": s.stage, "busy_s": s.busy_s,
                            "idle_s": self.step_s - s.busy_s,
                            "idle_fraction": 1 - s.busy_s / self.step_s if self.step_s else 0}
                           for s in self.stages]}


def simulate(section: dict, link_bytes_per_s: float = NVLINK_BYTES_PER_S,
             latency_s: float = P2P_LATENCY_S) -> Timeline:
    stages = section["stages"]
    ops = section["ops"]
    sizes = {(b["from"], b["to"]): b for b in section["boundaries"]}
    clocks = [StageTimeline(s["stage"]) for s in stages]
    position = [0] * len(ops)
    dp = section.get("mesh", {}).get("dp", 1)
    arrived: dict = {}  # (what, from, to, microbatch) -> arrival time
    while any(position[s] < len(ops[s]) for s in range(len(ops))):
        moved = False
        for s, stage_ops in enumerate(ops):
            while position[s] < len(stage_ops):
                if not _run(stage_ops[position[s]], s, stages[s], clocks[s], sizes, arrived,
                            link_bytes_per_s, latency_s, dp, section.get("shared", [])):
                    break
                position[s] += 1
                moved = True
        if not moved:
            stuck = {s: ops[s][position[s]] for s in range(len(ops))
                     if position[s] < len(ops[s])}
            raise Deadlock("the pipeline schedule deadlocks: " + "; ".join(
                f"stage {s} waits at {_op_text(op)}" for s, op in stuck.items()))
    step = max((c.end_s for c in clocks), default=0.0)
    return Timeline(clocks, step, section["microbatches"])


def _run(op, s, stage, clock, sizes, arrived, link, latency, dp, shared) -> bool:
    """Run one op on its stage's clock; False when it must wait for a peer."""
    kind, m = op["kind"], op.get("microbatch")
    if op.get("group") == "shared":  # a shared parameter's gradients over its stages
        return _shared_all_reduce(shared[op["shared"]], op["shared"], s, clock, arrived,
                                  link, latency)
    if kind in ("all_reduce", "broadcast"):  # a bucket over the stage's DP group
        from modulec.plan.pipeline_dp import all_reduce_seconds, broadcast_seconds

        cost = all_reduce_seconds if kind == "all_reduce" else broadcast_seconds
        clock.end_s += cost(stage["grad_buckets"][op["bucket"]]["bytes"], dp, link, latency)
    elif kind == "optimizer_step":  # AdamW is not on this clock
        pass
    elif kind == "recv":
        key = (op["what"], op["peer"], s, m)
        if key not in arrived:
            return False
        clock.end_s = max(clock.end_s, arrived[key])
    elif kind == "send":
        boundary = sizes[tuple(sorted((s, op["peer"])))]
        size = boundary["activation_bytes" if op["what"] == "activations" else "gradient_bytes"]
        arrived[(op["what"], s, op["peer"], m)] = clock.end_s + latency + size / link
    else:
        seconds = stage["forward_s" if kind == "forward" else "backward_s"]
        clock.spans.append((clock.end_s, clock.end_s + seconds, kind, m))
        clock.end_s += seconds
        clock.busy_s += seconds
    return True


def _shared_all_reduce(entry: dict, index: int, s: int, clock, arrived: dict, link: float,
                       latency: float) -> bool:
    """A collective of the entry's stages: it starts when the last of them reaches it and
    takes a ring all-reduce of the entry's bytes over them."""
    from modulec.plan.pipeline_dp import all_reduce_seconds

    reached = arrived.setdefault(("shared", index), {})
    reached.setdefault(s, clock.end_s)
    if len(reached) < len(entry["stages"]):
        return False
    clock.end_s = max(reached.values()) + all_reduce_seconds(
        entry["bytes"], len(entry["stages"]), link, latency)
    return True


def _op_text(op) -> str:
    if op.get("group") == "shared":
        return f"the all_reduce of shared parameter {op.get('shared')}"
    peer = f" from stage {op['peer']}" if op["kind"] == "recv" else ""
    text = f"{op['kind']} {op.get('what', '')} of micro-batch {op.get('microbatch')}{peer}"
    return text.replace("  ", " ")


def chart(timeline: Timeline, width: int = 96) -> list[str]:
    """One text row per stage: `F` forward, `B` backward (each starting with its
    micro-batch's last digit where there is room), `.` idle."""
    scale = width / timeline.step_s if timeline.step_s else 0
    rows = []
    for stage in timeline.stages:
        cells = ["."] * width
        for start, end, kind, m in stage.spans:
            lo, hi = int(start * scale), max(int(start * scale) + 1, int(end * scale))
            for i in range(lo, min(hi, width)):
                cells[i] = "F" if kind == "forward" else "B"
            if hi - lo > 1 and lo < width:  # the micro-batch, where there is room
                cells[lo] = str(m % 10)
        rows.append(f"stage {stage.stage} |{''.join(cells)}|")
    return rows
