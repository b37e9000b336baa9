"""A read-only mapping whose values load on first access: the standard library's
primitives are one per file, named like the file, so a check that uses two of them reads
two files, not forty-six."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterable


class LazyMapping(Mapping):
    """`keys` known up front; `load(key)` returns {name: value} for that key's file (one
    file may define more than one name: all of them are kept, a missing one raises)."""

    def __init__(self, keys: Iterable[str], load: Callable[[str], dict]):
        self._keys = list(dict.fromkeys(keys))
        self._load = load
        self._values: dict = {}
        self._tried: set[str] = set()

    def __getitem__(self, key: str):
        if key not in self._values and key not in self._tried and key in self._keys:
            self._tried.add(key)
            self._values.update(self._load(key))
        return self._values[key]

    def __contains__(self, key) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
