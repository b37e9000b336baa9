"""Deciding equalities the algebra leaves open, by evaluation on sample sizes.

Two dimensions whose normal forms differ may still be equal under the module's
constraints (`num_heads * (d_model // num_heads) == d_model` when `d_model % num_heads ==
0`). `Assumptions.same(a, b)` evaluates both on a few deterministic sample assignments that
satisfy every known fact: equal on all → True, different on all → False, else None
(unknown: the checker reports nothing rather than guess).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping

from modulec.types.dims import Dim, Opaque

POOL = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 3, 6, 12, 24, 48, 96, 192, 384,
        768, 1536, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 7, 14, 28, 56, 112, 224, 448)
SAMPLES = 3
TRIES = 300

Fact = Callable[[Mapping[str, int]], bool]  # a constraint evaluated on sample sizes


@dataclass
class Assumptions:
    """Facts (constraints) known to hold, and sample sizes that satisfy them."""

    facts: list[tuple[frozenset[str], Fact]] = field(default_factory=list)
    _cache: dict[frozenset[str], list[dict[str, int]]] = field(default_factory=dict)

    def add_fact(self, symbols: set[str], fact: Fact) -> None:
        self.facts.append((frozenset(symbols), fact))
        self._cache.clear()

    def same(self, a: Dim, b: Dim) -> bool | None:
        if a == b:
            return True
        return self.same_difference(a - b)

    def same_difference(self, difference: Dim) -> bool | None:
        """`same(a, b)` given `a - b`, for `a` and `b` not equal."""
        if difference.is_const:
            return False
        # Whoever writes `d_model // num_heads` means an exact division: sample sizes
        # where every such division is exact, so that only real mismatches show.
        divisions = tuple(sorted(_divisions(difference), key=str))
        verdicts = {difference.evaluate(env) == 0
                    for env in self.samples(difference.symbols(), divisions)}
        return verdicts.pop() if len(verdicts) == 1 else None

    def samples(self, symbols: set[str], divisions: tuple = ()) -> list[dict[str, int]]:
        relevant = self._closure(set(symbols))
        key = (frozenset(relevant), divisions)
        if key not in self._cache:
            self._cache[key] = self._draw(sorted(relevant), divisions)
        return self._cache[key]

    def _closure(self, symbols: set[str]) -> set[str]:
        """The symbols plus those of every fact that mentions one of them (transitively)."""
        grew = True
        while grew:
            grew = False
            for fact_symbols, _ in self.facts:
                if fact_symbols & symbols and not fact_symbols <= symbols:
                    symbols |= fact_symbols
                    grew = True
        return symbols

    def _draw(self, symbols: list[str], divisions: tuple) -> list[dict[str, int]]:
        """Samples where no two symbols share a value first: a coincidence (`B` and
        `tied_to` both drawn 56) made two free dims "maybe equal", so whether `[A, d] +
        [B, d]` was refused (E004) depended on the names' spelling. Samples with a shared
        value fill in only where the facts leave too few without (`a == b`).

        The draw is a function of the symbols, the divisions and the facts: when every
        fact says what it is a function of (its `key`), the samples are kept for the
        process (the same module checked again, by `build` after `check` or in the next
        program, draws nothing)."""
        key = self._draw_key(symbols, divisions)
        if key is not None and key in _DRAWN:
            _DRAWN[key] = samples = _DRAWN.pop(key)  # the most recently used
            return samples
        samples = self._drawn(symbols, divisions)
        if key is not None:
            if len(_DRAWN) >= DRAWN:
                del _DRAWN[next(iter(_DRAWN))]  # the least recently used
            _DRAWN[key] = samples
        return samples

    def _draw_key(self, symbols: list[str], divisions: tuple):
        """What `_draw` is a function of, or None where a fact has no `key`."""
        facts = []
        for fact_symbols, fact in self.facts:
            fact_key = getattr(fact, "key", None)
            if fact_key is None:
                return None
            facts.append((fact_symbols, fact_key))
        key = (type(self), tuple(facts), tuple(symbols), divisions)
        try:
            hash(key)
        except TypeError:  # a value no dict can hold
            return None
        return key

    def _drawn(self, symbols: list[str], divisions: tuple) -> list[dict[str, int]]:
        rng = random.Random(" ".join(symbols))
        found: list[dict[str, int]] = []
        coincident: list[dict[str, int]] = []
        for env in itertools.islice(self._candidates(symbols, rng), TRIES):
            if self._holds(env) and all(_exact(term, env) for term in divisions):
                (found if len(set(env.values())) == len(env) else coincident).append(env)
                if len(found) == SAMPLES:
                    break
        return found + coincident[:SAMPLES - len(found)]

    def _candidates(self, symbols, rng):
        while True:
            yield {s: rng.choice(POOL) for s in symbols}

    def _holds(self, env: Mapping[str, int]) -> bool:
        for symbols, fact in self.facts:
            if symbols <= env.keys():
                try:
                    if not fact(env):
                        return False
                except (ZeroDivisionError, KeyError, ValueError, TypeError):
                    return False
        return True


DRAWN = 512
_DRAWN: dict[tuple, list[dict[str, int]]] = {}  # _draw_key -> samples, oldest first


def typed(value):
    """`value` for a key that tells `True` from `1` and `1.0` (equal, and of one hash, in
    Python): its type beside it, through tuples."""
    if isinstance(value, tuple):
        return tuple, tuple(typed(item) for item in value)
    return type(value), value


def _divisions(dim: Dim) -> set[Opaque]:
    found: set[Opaque] = set()
    for monomial, _ in dim.terms:
        for atom in monomial:
            if isinstance(atom, Opaque):
                if atom.op == "//":
                    found.add(atom)
                for arg in atom.args:
                    found |= _divisions(arg)
    return found


def _exact(term: Opaque, env: Mapping[str, int]) -> bool:
    numerator, denominator = (arg.evaluate(env) for arg in term.args)
    return denominator > 0 and numerator % denominator == 0 and numerator // denominator > 0
