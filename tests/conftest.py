"""Fixtures shared by several test files, and the order `make test` runs the files in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One intra-op thread a process (set before any test imports torch; the gloo ranks and
# subprocesses the tests start inherit it): the tensors are tiny, and with two workers on
# two cores torch's second thread only spins waiting for the first (tests/test_train.py
# under -n 2: 33 -> 23 CPU-s). Set it yourself to run with others.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The files that hold the longest tests (`--durations` on the 2-core CI machine; docs/
# decisions.md, "CI time budget"), longest first, run before the others: under `make
# test`'s two workers (--dist worksteal) a minute-long test started last leaves the other
# core idle for that minute; started first, the short tests of both workers fill in
# around it. Whole files move, so their module fixtures are still built once a worker.
FIRST = ("test_soundness.py", "test_fuzz.py", "test_check_properties.py",
         "test_train_dist.py", "test_cuda_kernels.py", "test_tutorial.py",
         "test_dist_bench.py", "test_dist_zero.py", "test_train.py", "test_pipeline_run.py",
         "test_pipeline_precision.py", "test_pipeline_packed_eval.py")


def pytest_collection_modifyitems(items):
    """The files of FIRST first, in its order; every other test keeps its place (the sort
    is stable, so each file's tests keep theirs)."""
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(FIRST)))


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """Four gloo processes started once for the TP x PP, TP-from-IR and DP x TP clipping
    tests (tests/test_pipeline_tp.py's spawn_four)."""
    pytest.importorskip("torch")
    from tests.test_pipeline_tp import spawn_four

    return spawn_four(tmp_path_factory)
