"""The LoRA slots filled at the step's start (runtime/cuda/slot_refresh.py): what a fill
notes, what `refresh` writes and marks fresh, that a fresh slot is taken once and only
for the pieces it was filled with; in a LoRA step on the arena, the second run takes
every slot the first one filled and computes the same bits; on the GPU, the one-launch
kernel (csrc/kernels/scaled_copies.cu) writes torch.mul's bits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda import slot_refresh  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

BF16 = torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpus(1))]


@pytest.fixture(autouse=True)
def _nothing_fresh():
    slot_refresh.finish()
    yield
    slot_refresh.finish()


def _laid(rows: int, cols: int, spare: int, device: str):
    """A weight laid with `spare` columns beside each row, and its side slot."""
    laid = torch.randn(rows, cols + spare, device=device).to(BF16)
    return laid, laid[:, cols:]


def _blocks(device: str):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(24, 8, generator=g) * 0.3).to(BF16).to(device),
            (torch.randn(16, 8, generator=g) * 0.3).to(BF16).to(device)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_noted_slot_is_filled_at_the_start_and_taken_once(device):
    _, slot = _laid(40, 32, 16, device)
    b0, b1 = _blocks(device)
    pieces = [(b0, 0, 0), (b1, 24, 8)]
    slot.zero_()
    slot_refresh.note(slot, pieces, 0.37)
    assert slot_refresh.refresh([slot]) == 2
    assert torch.equal(slot[:24, :8], torch.mul(b0, 0.37))
    assert torch.equal(slot[24:, 8:], torch.mul(b1, 0.37))
    assert not slot[:24, 8:].any() and not slot[24:, :8].any()  # the zero blocks untouched
    assert not slot_refresh.take(slot, pieces, 0.5)  # another scale: not this fill
    slot_refresh.refresh([slot])
    assert slot_refresh.take(slot, pieces, 0.37)
    assert not slot_refresh.take(slot, pieces, 0.37)  # once a refresh


def test_a_slot_is_taken_only_for_the_pieces_it_was_filled_with():
    _, slot = _laid(40, 32, 16, "cpu")
    b0, b1 = _blocks("cpu")
    slot_refresh.note(slot, [(b0, 0, 0), (b1, 24, 8)], 2.0)
    for other in ([(b0, 0, 0)], [(b0, 0, 0), (b1, 24, 0)], [(b0, 0, 0), (b1.clone(), 24, 8)]):
        slot_refresh.refresh([slot])
        assert not slot_refresh.take(slot, other, 2.0)


def test_finish_leaves_nothing_fresh_and_refresh_fills_the_slots_it_is_given():
    _, slot = _laid(40, 32, 16, "cpu")
    _, other = _laid(40, 32, 16, "cpu")
    b0, b1 = _blocks("cpu")
    slot_refresh.note(slot, [(b0, 0, 0)], 1.0)
    slot_refresh.note(other, [(b1, 0, 0)], 1.0)
    other.zero_()
    assert slot_refresh.refresh([slot]) == 1
    assert not other.any()
    slot_refresh.finish()
    assert not slot_refresh.take(slot, [(b0, 0, 0)], 1.0)


def test_a_slot_whose_parameter_is_gone_is_forgotten():
    _, slot = _laid(40, 32, 16, "cpu")
    b0, _ = _blocks("cpu")
    slot_refresh.note(slot, [(b0, 0, 0)], 1.0)
    del b0
    assert slot_refresh.refresh([slot]) == 0
    assert slot_refresh.view_key(slot) not in slot_refresh._noted


def test_the_switch_turns_it_off(monkeypatch):
    _, slot = _laid(40, 32, 16, "cpu")
    b0, _ = _blocks("cpu")
    slot_refresh.note(slot, [(b0, 0, 0)], 1.0)
    monkeypatch.setenv("MODULEC_SLOT_REFRESH", "0")
    assert slot_refresh.refresh([slot]) == 0
    assert not slot_refresh.take(slot, [(b0, 0, 0)], 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_second_step_takes_every_slot_the_first_filled(monkeypatch, device):
    """A LoRA step on the arena with side and tail slots (rank 8: q/k/v, o, gate/up and
    down laid with side columns, down with tail rows): the first run fills the slots it
    uses and notes their parameters (the block-diagonal B's blocks at their places);
    `refresh` writes the same bits into emptied slots; the second run takes each of them
    (none left fresh) and computes the first run's outputs and gradients bit for bit."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter
    from runtime.cuda.state import region_of, stacked_order
    from runtime_models import token_inputs
    from tests.test_lora_step import _arena_step, _lora_model

    monkeypatch.setenv("MODULEC_LORA_KCAT_MIN", "1.4")
    model = _lora_model(rank=8)
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    sides, tails = kcat.side_columns(shapes, frozen), kcat.tail_rows(shapes, frozen)
    order = stacked_order(model.source.program_for(token_inputs(model)).graph, sorted(shapes))
    _, (views,) = region_of(shapes, [(BF16, order)], device=device, sides=sides, tails=tails)
    for path, view in views.items():
        view.copy_(model.params[path])
    slots = [*kcat.lay_sides(views, sides).values(), *kcat.lay_tails(views, tails).values()]
    first = _arena_step(model, monkeypatch, True, device, params=views)
    noted = [(s, s.clone()) for s in slots if slot_refresh.view_key(s) in slot_refresh._noted]
    assert len(noted) >= 6  # each layer's q/k/v and gate/up sides and down's tail at least
    for slot in slots:
        slot.zero_()
    assert slot_refresh.refresh(slots) > len(noted)  # the fused projections' several blocks
    assert all(torch.equal(slot, filled) for slot, filled in noted)
    monkeypatch.setenv("MODULEC_LORA_KCAT_MIN", "1.4")
    second = _arena_step(model, monkeypatch, True, device, params=views)
    assert not slot_refresh._fresh
    for one, two in zip(first[0], second[0]):
        assert torch.equal(one, two)
    assert all(torch.equal(first[1][p], second[1][p]) for p in first[1])


@needs_gpus(1)
def test_the_kernel_writes_torch_muls_bits():
    """Many pieces of several shapes into strided slots, one launch: each piece equals
    torch.mul(source, alpha) bit for bit, and nothing else in the slots changes."""
    g = torch.Generator().manual_seed(3)
    copies = []
    for rows, width, spare in ((4096, 16, 48), (1024, 16, 48), (14336, 16, 32), (16, 14336, 0)):
        laid = torch.randn(rows + 16, 64 + spare + width, generator=g).to(BF16).cuda()
        target = laid[:rows, 64 + spare:]
        source = torch.randn(rows, width, generator=g).to(BF16).cuda()
        copies.append((source, target, laid))
    slots = []
    for i, (source, target, laid) in enumerate(copies):
        slot_refresh.note(target, [(source, 0, 0)], [2.0, 0.37, 1.0, 1.5][i])
        slots.append(target)
    before = [laid.clone() for _, _, laid in copies]
    assert slot_refresh.refresh(slots) == 4
    for (source, target, laid), was, alpha in zip(copies, before, [2.0, 0.37, 1.0, 1.5]):
        assert torch.equal(target, torch.mul(source, alpha))
        rest = torch.ones_like(laid, dtype=torch.bool)
        rest[:source.shape[0], laid.shape[1] - source.shape[1]:] = False
        assert torch.equal(laid[rest], was[rest])
