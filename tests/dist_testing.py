"""Shared by the distributed tests (CPU gloo and GPU NCCL): a free TCP port on this host for
a process group's rendezvous (`tcp://127.0.0.1:<port>`, `--master-port`); the CPU tests'
`spawn` of their ranks (forked from one server per test process); and by every GPU test,
one GPU or several: `needs_gpus(n)`, the `cuda` mark and the skip without n GPUs."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket holds now (the OS picks it; the group binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_moved_alike(masters: dict, want: dict, initial: dict, skip=(),
                       least: float = 0.95) -> None:
    """A sharded bf16 run's masters hold the paths of one GPU's (`want`, `skip` left out of
    the comparison), and each moved from `initial` the way one GPU's did (cosine > least):
    bf16 rounding differs between the layouts, the update's direction must not."""
    from tests.bf16_parity import cosine

    assert set(masters) == set(want)
    for path in [p for p in want if p not in skip]:
        cos = cosine(masters[path] - initial[path], want[path] - initial[path])
        assert cos > least, (path, cos)


def needs_gpus(count: int) -> "Marks":
    """The marks of a test that runs on `count` GPUs: `-m cuda`, and skipped where this
    machine has fewer (or no CUDA). A module's `pytestmark = needs_gpus(2)`, or one
    test's decorator `@needs_gpus(1)`."""
    import pytest
    import torch

    return Marks([pytest.mark.cuda,
                  pytest.mark.skipif(not torch.cuda.is_available() or
                                     torch.cuda.device_count() < count,
                                     reason=f"needs {count} GPU{'s' if count > 1 else ''}")])


class Marks(list):
    """pytest marks that are also one decorator (a list is a module's `pytestmark`)."""

    def __call__(self, test):
        for mark in reversed(self):
            test = mark(test)
        return test


def train_records(processes: int, *args: str) -> list[dict]:
    """The JSON records (`--format json` lines) of `modulec train ARGS` on `processes`
    (1: one process, else under torchrun), NVLink multicast off. A failed run's whole
    stderr is the assertion's message: the first failing rank's error is not at its end."""
    import json
    import os
    import subprocess
    import sys

    head = [sys.executable, "-m", "modulec"] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
         "--master-port", str(free_port()), "-m", "modulec"]
    done = subprocess.run([*head, "train", *args], capture_output=True, text=True,
                          env=dict(os.environ, NCCL_NVLS_ENABLE="0"), timeout=600)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


# What the fork server imports once, so that each process forked from it starts with it:
# torch, the runtime, the compiler, its parser and std parsed (a fresh interpreter spent
# ~3 s of CPU on them, more than a tiny model's steps take on a rank).
PRELOAD = ["tests.rank_preload"]


def spawn(fn, nprocs: int, args: tuple = ()) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), the processes forked from a server
    (multiprocessing's forkserver) that imported PRELOAD once, instead of each started as a
    fresh interpreter that imports them again. The server is started by a test process's
    first call and serves its later ones; each rank is a fork of that server (single-
    threaded, no process group, no test's state), never of the test process, and sets its
    own rendezvous environment as before. Each rank is still a process of its own with its
    own gloo group: what the tests check of the processes is unchanged."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
