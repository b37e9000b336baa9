"""The placer's index (issue 16, linear-time builds): placing with the time-bucket index,
stacking blocks that are all live at once, and greedy_by_breadth's range-minimum order give
exactly the offsets of the plain algorithm (each block compared with every block placed
before it; each op's live blocks scanned in turn), over random lifetimes of every shape."""

from __future__ import annotations

import random

import numpy as np
import pytest

from modulec.plan.memory import offsets as O
from modulec.plan.memory.lifetimes import Block


def _reference_place(order, fit: str) -> dict:
    placed = []  # (start, end, offset, top)
    offsets = {}
    for b in order:
        live = sorted((p for p in placed if p[0] <= b.end and p[1] >= b.start and p[3] > p[2]),
                      key=lambda p: p[2])
        chosen = O._choose_gap(np.array([p[2] for p in live], dtype=np.int64),
                               np.array([p[3] for p in live], dtype=np.int64), b, fit)
        placed.append((b.start, b.end, chosen, chosen + b.size))
        offsets[b.id] = chosen
    return offsets


def _reference_breadth_order(blocks) -> list:
    times = sorted({b.start for b in blocks})
    breadth = {t: sum(b.size for b in blocks if b.start <= t <= b.end) for t in times}
    order, seen = [], set()
    for t in sorted(times, key=lambda t: (-breadth[t], t)):
        live = [b for b in blocks if b.start <= t <= b.end and b.key not in seen]
        for b in sorted(live, key=lambda b: (-b.size, b.key)):
            seen.add(b.key)
            order.append(b)
    return order


ORDERS = {  # each strategy's order and fit, as offsets.py defines them
    "greedy_by_size": (lambda b: (-b.size, b.start, b.key), "best"),
    "greedy_by_size_first_fit": (lambda b: (-b.size, b.start, b.key), "first"),
    "greedy_by_lifetime": (lambda b: (b.start - b.end, -b.size, b.key), "best"),
    "greedy_by_area": (lambda b: (-b.size * (b.end - b.start + 1), b.start, b.key), "best"),
    "first_fit_schedule": (lambda b: (b.start, -b.size, b.key), "first"),
    "best_fit_schedule": (lambda b: (b.start, -b.size, b.key), "best"),
}


def _blocks(rng: random.Random, n: int, kind: str) -> list[Block]:
    found = []
    for i in range(n):
        alignment = 256 if kind != "two alignments" else rng.choice([256, 512])
        if kind == "all live at once":
            start, end = rng.randint(0, n), n + rng.randint(0, n)
        elif kind == "short":
            start = rng.randint(0, 4 * n)
            end = start + rng.randint(0, 3)
        else:  # long and short together
            start = rng.randint(0, 2 * n)
            end = start + (rng.randint(0, 2 * n) if rng.random() < 0.2 else rng.randint(0, 40))
        found.append(Block(f"b{i}", i, "r", alignment * rng.randint(1, 20), alignment,
                           start, end))
    return found


@pytest.mark.parametrize("kind", ["all live at once", "short", "mixed", "two alignments"])
def test_the_indexed_placer_places_as_the_plain_one(kind):
    rng = random.Random(kind)
    for n in (1, 2, 7, 60, 400):
        blocks = _blocks(rng, n, kind)
        for name, (key, fit) in ORDERS.items():
            expected = _reference_place(sorted(blocks, key=key), fit)
            assert O.STRATEGIES[name](blocks) == expected, (kind, n, name)
        assert O.greedy_by_breadth(blocks) == _reference_place(
            _reference_breadth_order(blocks), "best"), (kind, n)


@pytest.mark.parametrize("kind", ["all live at once", "short", "mixed", "two alignments"])
def test_the_plain_placer_places_as_the_arrays(kind):
    """A few blocks (at most O.PLAIN) are placed in plain Python, more with the arrays:
    both give the same offsets and greedy_by_breadth the same order, zero-size blocks
    and a stack's blocks out of order included."""
    rng = random.Random(f"plain {kind}")
    for n in (1, 3, 12, O.PLAIN):
        for _ in range(8):
            blocks = _blocks(rng, n, kind)
            blocks += [Block(f"z{i}", n + i, "r", 0, 256, b.start, b.end)
                       for i, b in enumerate(rng.sample(blocks, min(2, n)))]
            rng.shuffle(blocks)
            for fit in ("first", "best"):
                placer = O._Placer(len(blocks))
                assert O._place_plainly(blocks, fit) == \
                    {b.id: placer.place(b, fit) for b in blocks}, (kind, n, fit)
            assert O._breadth_order_plainly(blocks) == _reference_breadth_order(blocks)
