"""`@profile` regions in the reference runtime (runtime/profiling.py): per layer and
phase, timed, with result bytes for `memory=true`; nothing recorded while disabled."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.model import Model  # noqa: E402

STACK = Path(__file__).parent / "data" / "profiled_stack.module"  # 3 layers, d = 4


def _step(model: Model) -> None:
    model.forward(x=torch.randn(2, 4, dtype=torch.float64))
    model.backward(y=torch.ones(2, 4, dtype=torch.float64))


def test_regions_per_layer_and_phase():
    model = Model.from_module(STACK).init_random(0).enable_profiling()
    _step(model)
    _step(model)
    report = {(r["name"], r["layer"], r["phase"]): r for r in model.profile_report()}
    assert set(report) == {("stack", None, "forward"), ("stack", None, "backward")} | {
        ("proj", layer, phase) for layer in range(3) for phase in ("forward", "backward")}
    assert all(r["calls"] == 2 and r["ms"] > 0 for r in report.values())
    assert report[("proj", 1, "forward")]["bytes"] == 2 * 4 * 8  # h: [2, 4] float64
    assert report[("stack", None, "forward")]["bytes"] == 0  # memory not asked for
    layers = sum(report[("proj", i, "forward")]["ms"] for i in range(3))
    assert report[("stack", None, "forward")]["ms"] >= layers  # the stack encloses them


def test_profiling_is_off_by_default_and_can_be_turned_off():
    model = Model.from_module(STACK).init_random(0)
    _step(model)
    assert model.profiler is None
    with pytest.raises(RuntimeUserError, match="profiling is off"):
        model.profile_report()
    model.enable_profiling()
    model.disable_profiling()
    _step(model)
    assert model.profiler is None


def test_profile_annotations_reach_the_ir():
    model = Model.from_module(STACK)
    graph = model.source.program(planned=False).graph
    notes = [a for f in graph.functions for n in f.nodes for a in n.annotations]
    assert ("profile", ('"proj"', "memory=true", "on=h", "value=%1")) in notes
