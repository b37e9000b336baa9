"""ZeRO's all-gathers of updated weights on the copy engines, not on SMs.

A ZeRO-1/2 step gathers every layer's updated weights on the communication stream while
the backward's GEMMs run on the compute stream; NCCL's ring all-gather takes thread
blocks (SMs) from those GEMMs for as long as it runs. NCCL >= 2.28 runs an all-gather
with no thread block when its communicator's CTA policy is zero and the buffer lies in a
symmetric window (`torch.distributed._symmetric_memory`, NCCL backend): the copies go to
the copy engines (the trace shows `Memcpy PtoP` nodes instead of
`ncclDevKernel_AllGather`), and they are captured in the step's CUDA graph like any
collective. So the whole compute weights of a ZeRO-1/2 bucket are allocated in such a
window and gathered on a second communicator of the same ranks with that policy; the
reduce-scatters stay on the data-parallel group (they add: SM work). Measured on two
H100s, TinyLlama ZeRO-2 (docs/distributed-measured.md): ~4 ms a step.

Where it cannot run, the gathers stay on SMs and `refusal` says why (ZeroRun's
`gather_transport`): `MODULEC_ZERO_CE_GATHER=0`, not CUDA / NCCL, NCCL older than 2.28 or
a torch without the option, ZeRO-0 / ZeRO-3 (gathers into slots), a data-parallel
group narrower than the world (beside tensor or pipeline parallel: `new_group` is
collective over the world, and each rank would need every DP group's twin), or ranks on
several nodes (torchrun's LOCAL_WORLD_SIZE below the world: the copy engines reach
NVLink peers only).

Where NCCL allocates the windows outside torch's caching allocator,
`torch.cuda.max_memory_allocated` does not see them: `window_bytes()` is what it misses
(measured at each allocation), and `peak_allocated` adds it (runtime/train/backends.py,
benchmarks/dist_measure.py, benchmarks/gpu/dist_probe.py)."""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

MIN_NCCL = (2, 28)
_live: dict[int, int] = {}  # id of a live window tensor -> its bytes
_backend_set = False  # symm_mem's backend set to NCCL in this process


def refusal(device, group, zero: int) -> str | None:
    """Why this run's all-gathers stay on SMs, or None where they go to the copy engines."""
    if os.environ.get("MODULEC_ZERO_CE_GATHER", "1") == "0":
        return "MODULEC_ZERO_CE_GATHER=0"
    if torch.device(device).type != "cuda" or not dist.is_initialized() or \
            dist.get_backend(group) != "nccl":
        return "not NCCL on CUDA"
    if zero not in (1, 2):
        return f"ZeRO-{zero} gathers into slots" if zero == 3 else f"ZeRO-{zero} gathers nothing"
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return "the data-parallel group is narrower than the world"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if local != dist.get_world_size():  # torchrun's count of this node's ranks
        return "ranks on several nodes (copy-engine gathers need one NVLink domain)"
    version = tuple(torch.cuda.nccl.version()[:2])
    if version < MIN_NCCL:
        return f"NCCL {'.'.join(map(str, version))} (copy-engine collectives need 2.28)"
    if not hasattr(getattr(dist, "ProcessGroupNCCL", None), "NCCL_CTA_POLICY_ZERO"):
        return "this torch has no NCCL CTA policy option"
    return None


def copy_engine_gather(device, group, zero: int) -> tuple[CopyEngineGather | None, str]:
    """(the gather, "copy engines") where it runs, else (None, "SMs: why")."""
    why = refusal(device, group, zero)
    return (CopyEngineGather(group), "copy engines") if why is None else (None, f"SMs: {why}")


class CopyEngineGather:
    """The zero-CTA communicator over `group`'s ranks and the windows it gathers into."""

    def __init__(self, group=None):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        options = dist.ProcessGroupNCCL.Options()
        options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
        self.group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD),
                                    pg_options=options)
        _nccl_windows(symm_mem)
        # the communicator is made by its first collective; a window needs it
        dist.all_reduce(torch.ones(1, device="cuda"), group=self.group)

    def empty(self, numel: int, dtype, device) -> torch.Tensor:
        """A flat tensor in a symmetric window of this communicator (collective)."""
        before = torch.cuda.memory_allocated(device)
        tensor = self.symm_mem.empty(numel, dtype=dtype, device=device)
        self.symm_mem.rendezvous(tensor, group=self.group.group_name)
        size = tensor.numel() * tensor.element_size()
        if torch.cuda.memory_allocated(device) - before < size:  # not in torch's stats
            _live[id(tensor)] = size
            weakref.finalize(tensor, _live.pop, id(tensor), None)
        return tensor


def _nccl_windows(symm_mem) -> None:
    """Symmetric memory from NCCL, chosen once a process (a second step, as an A/B builds
    two, finds it chosen and windows already made under it)."""
    global _backend_set
    if not _backend_set:
        symm_mem.set_backend("NCCL")
        _backend_set = True


def window_bytes() -> int:
    """The bytes of live windows that torch's allocator statistics do not count."""
    return sum(_live.values())


def peak_allocated() -> int:
    """torch.cuda.max_memory_allocated with the windows it misses: every reported GPU
    peak (the trainer's, the benchmarks')."""
    return torch.cuda.max_memory_allocated() + window_bytes()
