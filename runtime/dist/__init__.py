"""Training on several processes through torch.distributed: the process group from
torchrun's environment (`context`), and data parallel with ZeRO sharding executed from
the Schedule IR's `distributed` section (`zero`). docs/distributed.md."""

from runtime.dist.context import DataParallelRun, DistContext

__all__ = ["DataParallelRun", "DistContext"]
