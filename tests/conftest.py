"""Fixtures shared by several test files, and the order `make test` runs the files in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread a process (set before any test imports torch; the gloo ranks and
# subprocesses the tests start inherit it): the tensors are tiny, and with two workers on
# two cores torch's second thread only spins waiting for the first (tests/test_train.py
# under -n 2: 33 -> 23 CPU-s). Set it yourself to run with others.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Bytecode written and read (here, in the workers and in every process the tests start):
# under PYTHONDONTWRITEBYTECODE (set on the dev machine) each gloo rank, torchrun rank and
# CLI subprocess compiled modulec's and runtime's modules from source again, ~0.5 s of
# CPU a process (benchmarks/build_speed.py drops it for the same reason). __pycache__ is
# git-ignored, and a stale file is never read (Python compares the source's mtime and size).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The files that hold the longest tests, the longest file first (the sum of its tests'
# `--durations` under `make test`'s options on the 2-core machine, over two runs: the
# shared machine's load moves a file by 2x between runs; docs/decisions.md, "CI time
# budget") run before the others. `make test` hands whole files to its two workers in
# collection order (--dist loadfile --no-loadscope-reorder): a minute-long file handed out
# last leaves the other core idle for that minute, handed out first the short files of both
# workers fill in around it. A file is one unit, so its module fixtures are built once; the
# three files of the session fixture `four_ranks` (four gloo processes) are one unit
# (pytest_xdist_make_scheduler below), handed out where the first of them stands.
FIRST = ("test_soundness.py", "test_fuzz.py", "test_check_properties.py",
         "test_train_dist.py", "test_pipeline_packed_eval.py", "test_pipeline_tp.py",
         "test_tp_clip.py", "test_dist_bench.py", "test_pipeline_run.py",
         "test_cuda_kernels.py", "test_syntax_properties.py", "test_tutorial.py",
         "test_dist_zero.py", "test_pipeline_precision.py", "test_tensor_parallel.py",
         "test_dist_packed_eval.py", "test_runtime_arena.py", "test_tp_eval.py",
         "test_tp_ir.py", "test_tp_lora.py", "test_sequence_parallel.py", "test_train.py",
         "test_cuda_step.py", "test_train_optim.py", "test_runtime_decisions.py",
         "test_pipeline_shared.py", "test_build.py", "test_consolidated_save.py",
         "test_pipeline_aux.py", "test_tp_packed.py")
FOUR_RANKS = ("test_pipeline_packed_eval.py", "test_pipeline_tp.py", "test_tp_clip.py")


def pytest_collection_modifyitems(items):
    """The files of FIRST first, in its order; every other file keeps its place (the sort
    is stable, so each file's tests keep theirs)."""
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(FIRST)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: no error where it is missing
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of FOUR_RANKS one unit (their session fixture)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "four_ranks" if Path(scope).name in FOUR_RANKS else scope

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """Four gloo processes started once for the TP x PP, TP-from-IR and DP x TP clipping
    tests (tests/test_pipeline_tp.py's spawn_four)."""
    pytest.importorskip("torch")
    from tests.test_pipeline_tp import spawn_four

    return spawn_four(tmp_path_factory)
