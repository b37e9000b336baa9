"""The reference runtime executes the memory planner's decisions (`--memory-budget`):
values decided `recompute` are dropped after the forward and replayed (whole op, or a
norm's `apply_saved`) when the backward reads them, values decided `swap` go to a host
copy and come back. In float64 the results are the plain run's bit for bit; on the arena
the released bytes are overwritten first, so a backward that skipped a restore would read
NaN."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.decisions import Decisions  # noqa: E402
from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.runtime_models import TINY, token_inputs  # noqa: E402

BUDGETS = {"llama": 343_000, "example_gpt2": 545_000, "mixtral": 807_000,
           "gemma": 420_000}  # gemma: its `(1 + w)` norms replayed by apply_saved
# planned for the H100 these tiny models swap (their copies hide under the GEMMs' waves,
# modulec/plan/devices.py); planned for an executor that does not swap, they recompute
DEVICES = {"h100": "swapped_out", "h100-noswap": "recomputed"}


def _run(name: str, budget, dtype=torch.float64, arena=False, device="h100"):
    path, settings = TINY[name]
    model = Model.from_module(path, settings=settings, dtype=dtype, memory_budget=budget)
    if budget is not None:
        model.source.planning.device = device
    model.init_random(0, std=0.3)
    model.arena = arena
    outputs = model.forward(**token_inputs(model))
    seeds = {k: torch.full_like(v, 0.01) for k, v in outputs.items() if v.is_floating_point()}
    return outputs, model.backward(**seeds).params, model._decisions()


_PLAIN: dict = {}


def _plain(name: str, dtype=torch.float64, arena=False):
    """`_run` without a budget, where the device plays no part: once per model, dtype and
    arena for the file (both devices' cases compare with it; nothing writes to it)."""
    key = (name, dtype, arena)
    if key not in _PLAIN:
        _PLAIN[key] = _run(name, None, dtype, arena=arena)
    return _PLAIN[key]


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_planned_recompute_and_swap_give_the_plain_results_exactly(name, device):
    plain_out, plain_grads, none = _plain(name)
    out, grads, decisions = _run(name, BUDGETS[name], device=device)
    assert none is None
    counts = decisions.counts
    assert counts[DEVICES[device]] > 0, counts
    if device == "h100":
        assert counts["swapped_in"] > 0, counts
    else:
        assert counts["dropped"] > 0 and counts["swapped_out"] == 0, counts
    assert all(torch.equal(plain_out[k], out[k]) for k in plain_out)
    assert all(torch.equal(plain_grads[k], grads[k]) for k in plain_grads)


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_on_the_arena_released_bytes_are_restored_before_they_are_read(name, device):
    _, plain_grads, _ = _plain(name, torch.bfloat16, arena=True)
    _, grads, _ = _run(name, BUDGETS[name], torch.bfloat16, arena=True, device=device)
    for key, want in plain_grads.items():
        got = grads[key]
        assert not got.isnan().any(), key
        # apply_saved normalizes the saved bf16 residual, the forward its fp32 sum
        assert (got.double() - want.double()).abs().max() <= 0.03 * want.double().abs().max()


def test_released_values_are_really_gone(monkeypatch):
    monkeypatch.setattr(Decisions, "restore", lambda self, interpreter, frame, value: False)
    with pytest.raises(RuntimeUserError, match="read before it is computed"):
        _run("llama", BUDGETS["llama"])


def test_an_unmeetable_budget_is_a_user_error():
    with pytest.raises(RuntimeUserError, match="cannot be met"):
        _run("llama", 1000)


def test_on_the_arena_a_run_holds_saved_bytes_only_for_what_it_keeps():
    """The saved region packs each run's record with the storages it keeps: the values
    the planner decided to recompute or swap take no bytes there."""
    from modulec.plan.memory import SAVED

    sizes = {}
    for budget in (None, BUDGETS["llama"]):
        path, settings = TINY["llama"]
        model = Model.from_module(path, settings=settings, dtype=torch.bfloat16,
                                  memory_budget=budget)
        model.arena = True
        model.program = model.source.program_for(token_inputs(model))
        sizes[budget] = model._arena().bytes_of()[SAVED]
    assert 0 < sizes[BUDGETS["llama"]] < sizes[None]
