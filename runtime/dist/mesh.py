"""The process groups of a pipeline run, with data parallel over its pipelines (DP x PP)
and tensor parallel inside its stages (TP x PP), from the `mesh` of the IR's `pipeline`
section (docs/distributed.md, "Internet scale on paper"):
rank r = ((dp_index x PP) + pp_index) x TP + tp_index, so

- the TP group of (dp_index d, stage s) is ranks (d x PP + s) x TP .. + TP - 1
  (consecutive: the stage's tensor-parallel ranks, its `tp_copy` / `tp_all_reduce`),
- the PP group of (d, tp_index t) is ranks (d x PP + s) x TP + t for s = 0 .. PP - 1
  (one pipeline: its sends and receives, each TP rank to the same tp_index of the next
  stage),
- the DP group of (s, t) is ranks (d x PP + s) x TP + t for d = 0 .. DP - 1 (the
  replicas of one stage's slice: the all-reduce of its gradients).

- the shared group of entry k of the section's `shared` list, for (d, t), is ranks
  (d x PP + s) x TP + t for the entry's stages s (the sum of a shared parameter's
  copies' gradients: Megatron-LM's embedding group), made only for an entry whose
  copies are summed (its stages' op lists say so).

Every rank creates every group (`torch.distributed.new_group` is collective over the
default group, in the same order everywhere: TP, then PP, then DP, then the shared
entries in order, each for every (d, t)) and keeps its own. A group of the whole world
is the default group (None); a dimension of size 1 has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.errors import RuntimeUserError


@dataclass(frozen=True)
class PipelineMesh:
    dp: int
    pp: int
    rank: int
    pp_group: object = None  # None: the default group (dp 1, tp 1)
    dp_group: object = None  # None: no data parallel (dp 1)
    tp: int = 1
    tp_group: object = None  # None: no tensor parallel (tp 1)
    shared_groups: dict = field(default_factory=dict)  # shared entry -> its group here

    @property
    def tp_index(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp % self.pp

    @property
    def dp_index(self) -> int:
        return self.rank // (self.pp * self.tp)

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline (its tp_index)."""
        return self.global_rank(self.dp_index, stage, self.tp_index)

    def replica_rank(self, dp_index: int) -> int:
        """The global rank of this stage's slice in pipeline `dp_index`."""
        return self.global_rank(dp_index, self.stage, self.tp_index)

    def global_rank(self, dp_index: int, stage: int, tp_index: int) -> int:
        return (dp_index * self.pp + stage) * self.tp + tp_index

    @classmethod
    def of(cls, context, mesh: dict, shared: dict | None = None) -> "PipelineMesh":
        """This rank's place in the IR's `mesh` ({dp, pp, tp}), whose product must be the
        number of processes; `shared`: the section's shared entries whose gradients are
        summed (index -> their stages), each a group of this rank's if it holds it."""
        dp, pp, tp = (int(mesh[k]) for k in ("dp", "pp", "tp"))
        if dp * pp * tp != context.world:
            raise RuntimeUserError(
                f"the IR's pipeline mesh is dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} "
                f"processes; this run has {context.world}",
                help=[f"launch torchrun --nproc-per-node {dp * pp * tp}, or build the IR "
                      f"for this launch: modulec build ... --pp {pp}"
                      + (f" --tp {tp}" if tp > 1 else "")
                      + f" --dp {max(context.world // (pp * tp), 1)}"])
        shared = shared or {}
        if dp == 1 and tp == 1 and not shared:
            return cls(dp, pp, context.rank)
        plain = cls(dp, pp, context.rank, tp=tp)
        at = plain.global_rank
        tp_groups = [[at(d, s, t) for t in range(tp)] for d in range(dp) for s in range(pp)]
        pp_groups = [[at(d, s, t) for s in range(pp)] for d in range(dp) for t in range(tp)]
        dp_groups = [[at(d, s, t) for d in range(dp)] for s in range(pp) for t in range(tp)]
        mine = {}
        for kind, groups, size in (("tp", tp_groups, tp), ("pp", pp_groups, pp),
                                   ("dp", dp_groups, dp)):
            if size == 1:
                continue
            for ranks in groups:  # every rank makes every group, in this order
                group = dist.new_group(ranks) if len(ranks) < context.world else None
                if context.rank in ranks:
                    mine[kind] = group
        groups = _shared_groups(plain, shared, context)
        own = cls(dp, pp, context.rank, mine.get("pp"), mine.get("dp"), tp, mine.get("tp"),
                  groups)
        for group in list(mine.values()) + list(groups.values()):  # every member at once
            _warm_up(group, context.device)  # (below)
        return own


def _shared_groups(plain: PipelineMesh, shared: dict, context) -> dict:
    """The groups of the shared entries (index -> stages), every rank making each entry's
    for every (dp_index, tp_index), entries in index order: this rank's by entry."""
    at, mine = plain.global_rank, {}
    for index in sorted(shared):
        for d in range(plain.dp):
            for t in range(plain.tp):
                ranks = [at(d, s, t) for s in shared[index]]
                group = dist.new_group(ranks) if len(ranks) < context.world else None
                if context.rank in ranks:
                    mine[index] = group
    return mine


def _warm_up(group, device: str) -> None:
    """One small all-reduce in `group`, which all its ranks make together: NCCL sets up a
    group's communicator at its first call, which all members must join, and a pipeline's
    first point-to-point exchange is between two of its stages only."""
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag, group=group)
