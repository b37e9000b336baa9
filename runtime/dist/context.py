"""The process group a distributed run uses, taken from the environment `torchrun` sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT, or its rendezvous): NCCL for
CUDA, gloo for the CPU. Nothing here launches processes or moves bytes itself.

    ctx = DistContext.from_env(device="cuda")        # one process: world 1, no group
    step = TrainStep.from_module(..., dist=ctx.data_parallel(zero=2))

A collective that does not finish within `timeout` (a rank that died, a hang) ends the
process with NCCL's or gloo's error instead of waiting for ever; torchrun then ends the
other ranks and names the one that failed.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.errors import RuntimeUserError

DEFAULT_TIMEOUT_S = 600
# True once from_env joined a process group for this process (a torchrun rank): the
# command line then ends the process with end_joined_process, not the interpreter's exit
_joined = False
# NVLink multicast (NVLS) can take the host's shared GPUs down: never on
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str | None = None  # None: a single process, no process group

    @classmethod
    def from_env(cls, device: str = "cuda", timeout_s: int = DEFAULT_TIMEOUT_S
                 ) -> "DistContext":
        """The run's context: a single process when torchrun set no WORLD_SIZE (or 1);
        otherwise joins (or reuses) the default process group."""
        world = _env_int("WORLD_SIZE", 1)
        if world == 1:
            return cls(device=device)
        rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            if not torch.cuda.is_available() or local >= torch.cuda.device_count():
                raise RuntimeUserError(
                    f"rank {rank}: LOCAL_RANK {local} has no GPU (this host has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})",
                    help=["start at most one process per GPU: torchrun --nproc-per-node "
                          "<GPUs on this host>"])
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
            global _joined
            _joined = True
        return cls(rank, world, local, device, backend)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints progress and writes consolidated files."""
        return self.rank == 0

    def data_parallel(self, zero: int = 2, tp: int = 1, sp: bool = False,
                      tp_overlap: bool = True) -> "DataParallelRun":
        """Data parallel over the ranks' TP slices: with `tp` > 1, ranks r and r + 1 ..
        (tp consecutive) form a tensor-parallel group each, and the ranks at the same
        position of every slice a data-parallel group (dp = world / tp). `sp`: the
        program is built with sequence parallel (`--sp`) over each TP group;
        `tp_overlap=False`: without the backward collectives' overlap (`--no-tp-overlap`)."""
        check_tensor_parallel(tp, sp, self.world)
        return DataParallelRun(self, zero, tp, *self._groups(tp), sp=sp,
                               tp_overlap=tp_overlap)

    def _groups(self, tp: int) -> tuple:
        """(this rank's TP group, its DP group, its rank in the DP group); None groups
        where one group holds every rank (the default group) or the size is 1."""
        dp = self.world // tp
        if tp == 1 or dp == 1:
            return None, None, self.rank // tp
        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(dp)]
        dp_groups = [dist.new_group(list(range(p, self.world, tp))) for p in range(tp)]
        return tp_groups[self.rank // tp], dp_groups[self.rank % tp], self.rank // tp

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def same_everywhere(self, what: str, value: str) -> None:
        """Every rank must hold the same `value` (an IR digest, a setting): a clear error
        at start instead of a hang or a wrong result later."""
        if not self.distributed:
            return
        values = [None] * self.world
        dist.all_gather_object(values, value)
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            raise RuntimeUserError(f"{what} differs between ranks: rank {differing[0]} has "
                                   f"{values[differing[0]]!r}, rank 0 {values[0]!r}",
                                   help=["start every rank with the same command and files"])

    def same_program(self, document: dict) -> None:
        """Every rank runs the same IR document (a digest compared at start)."""
        import hashlib
        import json

        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        self.same_everywhere("the IR document (its sha256)",
                             hashlib.sha256(text.encode()).hexdigest()[:16])

    def close(self) -> None:
        """Leave the group. With NCCL, a process group some CUDA graph captured
        collectives of can hang in destroy_process_group (seen with torch 2.11 on two
        H100s), so it is left to the process's exit (`exit_now`) there."""
        if self.distributed and dist.is_initialized() and self.backend != "nccl":
            dist.destroy_process_group()

    def exit_now(self, code: int = 0) -> None:
        """End this process at once (outputs flushed): under NCCL after a captured step,
        the interpreter's own shutdown can hang in the process group's destructor."""
        if self.backend == "nccl":
            _exit_flushed(code)
        _flush()


# How long a failed rank waits before it ends: torchrun names as the root cause the rank
# it saw fail first, to the second, ties to the lowest rank; so a rank ending at once
# because a collective broke (another rank died) would be named in the dead rank's place.
# torchrun polls every 0.1 s (--monitor-interval) and ends the waiting rank itself.
LAUNCHER_GRACE_S = 2.0


def end_joined_process(code: int) -> None:
    """End a torchrun rank's process once its command has reported (outputs flushed),
    skipping the interpreter's shutdown, where a process that joined a group from_env
    made can abort after the run finished: torch 2.13's teardown with gloo ended ~1 in 50
    finished two-rank runs on two loaded cores with "terminate called without an active
    exception" (SIGABRT, no Python frame left, the group already destroyed), so torchrun
    reported a failed run. A failed rank first waits LAUNCHER_GRACE_S (torchrun usually
    ends it meanwhile). A process that joined no group returns."""
    if not _joined:
        return
    if code != 0:
        _flush()
        time.sleep(LAUNCHER_GRACE_S)
    _exit_flushed(code)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _exit_flushed(code: int) -> None:
    """End the process now, without the interpreter's shutdown, its outputs written."""
    _flush()
    os._exit(code)


@contextmanager
def collective_failures(context: DistContext, timeout_s: int):
    """A collective's failure as a user error naming this rank (no traceback): another
    rank died, or hangs past the timeout."""
    if not context.distributed:
        yield
        return
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        if not _is_collective_failure(exc):
            raise
        raise RuntimeUserError(
            f"rank {context.rank} of {context.world}: a collective failed or did not finish "
            f"within {timeout_s} s ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            help=["another rank died or hangs: torchrun's report names the rank that "
                  "failed first", "resume from the last checkpoint with --resume DIR "
                  "(--save-every K keeps one every K steps)"]) from None


def _is_collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "timed out", "timeout", "connection",
                                  "peer", "socket"))


@dataclass(frozen=True)
class DataParallelRun:
    """The context's ranks as `tp`-wide tensor-parallel slices (Megatron-style, the
    program built with `--tp`), data parallel with ZeRO stage `zero` (0-3) across them."""

    context: DistContext
    zero: int = 2
    tp: int = 1
    tp_group: object = None  # None: the default group (every rank), or no TP
    dp_group: object = None  # None: the default group (every rank)
    dp_rank: int = 0
    sp: bool = False  # sequence parallel over each TP group (the program built with --sp)
    # the program's TP backward collectives overlapped (False: built with --no-tp-overlap)
    tp_overlap: bool = True

    @property
    def dp(self) -> int:
        return self.context.world // self.tp

    def options(self):
        """The IR's distributed section options (None: one data-parallel rank)."""
        from modulec.plan.distributed import DataParallel

        if self.dp == 1:
            return None
        try:
            return DataParallel(self.dp, self.zero)
        except ValueError as exc:
            raise RuntimeUserError(str(exc)) from None

    def use_tensor_parallel_group(self) -> None:
        """The TP pair's all-reduces run on this rank's TP slice."""
        if self.tp > 1:
            from runtime.kernels.comm import set_tp_group

            set_tp_group(self.tp_group)


def launch_world() -> int:
    """The processes torchrun launched (WORLD_SIZE; 1 without torchrun), read before any
    process group is joined."""
    return _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise RuntimeUserError(f"the environment variable {name}={text!r} is not a "
                               "number", help=["launch with torchrun, which sets it"]) from None


def check_tensor_parallel(tp: int, sp: bool, world: int) -> None:
    """`--tp` must divide the processes, and `--sp` needs a TP group to split over."""
    if tp < 1 or world % tp:
        raise RuntimeUserError(f"--tp {tp} must divide the {world} processes",
                               help=[f"launch a multiple of {tp} processes: torchrun "
                                     "--nproc-per-node N"])
    from modulec.lower.tensor_parallel import sequence_parallel_problem

    problem = sequence_parallel_problem(tp, sp)
    if problem:
        raise RuntimeUserError(problem)
