"""The process groups of a pipeline run with data parallel over its pipelines (DP x PP),
from the `mesh` of the IR's `pipeline` section (docs/distributed.md, "Internet scale on
paper"): rank r = ((dp_index x PP) + pp_index) x TP + tp_index, TP 1 here, so

- the PP group of data-parallel index d is ranks d x PP .. d x PP + PP - 1 (one pipeline:
  its sends and receives),
- the DP group of stage s is ranks s, s + PP, s + 2 PP, ... (the replicas of one stage:
  the all-reduce of its gradients).

Every rank creates every group (`torch.distributed.new_group` is collective over the
default group, in the same order everywhere) and keeps its own two. With dp 1 the
pipeline is the default group and there is no DP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.errors import RuntimeUserError


@dataclass(frozen=True)
class PipelineMesh:
    dp: int
    pp: int
    rank: int
    pp_group: object = None  # None: the default group (dp 1)
    dp_group: object = None  # None: no data parallel (dp 1)

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def dp_index(self) -> int:
        return self.rank // self.pp

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline."""
        return self.dp_index * self.pp + stage

    @classmethod
    def of(cls, context, mesh: dict) -> "PipelineMesh":
        """This rank's place in the IR's `mesh` ({dp, pp, tp}), whose product must be the
        number of processes."""
        dp, pp, tp = (int(mesh[k]) for k in ("dp", "pp", "tp"))
        if dp * pp * tp != context.world:
            raise RuntimeUserError(
                f"the IR's pipeline mesh is dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} "
                f"processes; this run has {context.world}",
                help=[f"launch torchrun --nproc-per-node {dp * pp * tp}, or build the IR "
                      f"for this launch: modulec build ... --pp {pp} --dp "
                      f"{max(context.world // (pp * tp), 1)}"])
        if dp == 1:
            return cls(dp, pp, context.rank)
        pipelines = [dist.new_group(list(range(d * pp, (d + 1) * pp))) for d in range(dp)]
        replicas = [dist.new_group(list(range(s, context.world, pp))) for s in range(pp)]
        own = cls(dp, pp, context.rank, pipelines[context.rank // pp],
                  replicas[context.rank % pp])
        for group in (own.pp_group, own.dp_group):  # every member at once (below)
            _warm_up(group, context.device)
        return own


def _warm_up(group, device: str) -> None:
    """One small all-reduce in `group`, which all its ranks make together: NCCL sets up a
    group's communicator at its first call, which all members must join, and a pipeline's
    first point-to-point exchange is between two of its stages only."""
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag, group=group)
