"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """Four gloo processes started once for the TP x PP, TP-from-IR and DP x TP clipping
    tests (tests/test_pipeline_tp.py's spawn_four)."""
    pytest.importorskip("torch")
    from tests.test_pipeline_tp import spawn_four

    return spawn_four(tmp_path_factory)
