"""Token-level mutations of Module DSL programs for the hostile-program fuzz test (issue 16).

`mutant(index, seed)` is a pure function of its arguments: program `index` of a run with
`seed` is the same program in the CI slice and in the full run (tests/fuzz/run_fuzz.py).
Each mutant is a source file of std/ or examples/ with one to three edits: a token
deleted, duplicated or swapped with its neighbour, a number made huge or odd, a name
replaced by another of the file, an expression nested hundreds deep, unicode inserted, a
line deleted or duplicated, a token repeated thousands of times.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = re.compile(r'"""[\s\S]*?"""|"(?:[^"\\\n]|\\.)*"|#[^\n]*|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?'
                   r"|[^\W\d]\w*|->|==|!=|<=|>=|//|\*\*|\n[ \t]*|[ \t]+|.", re.UNICODE)
HUGE = ["99999999999999999999999999", "18446744073709551616", "4294967296", "1e308",
        "1e999", "0", "-1", "0.0", "-0", "2147483648", "1" * 400, "3.4028236e38", "nan"]
UNICODE = ["\u200b", "\u202e", "\ufeff", "\u00a0", "\U0001f600", "e\u0301", "\uff41",
           "\u0000", "\u2028", "\u03bb", "\\", "\t", "\r", "\x7f", "\udcff"]
SMALL = ["0", "1", "2", "3", "5", "6", "7", "8", "-1", "0.5", "1.5", "2.0", "1e999", "1e-30",
         "1e20", "64", "100000", "true", "false"]
REPEAT_CHARS = 500_000  # about the most one repeat edit writes
PUNCTUATION = [":", "->", "(", ")", "[", "]", ",", "=", "@", "if", "else", "x", "*", "-",
               "...", "'", '"', "in:", "out:", "graph:", "params:", "{", "}", ";", "."]


@dataclass(frozen=True)
class Mutant:
    index: int
    source: str  # the file it was made from, relative to the repository
    edits: tuple[str, ...]
    text: str


@cache
def sources() -> tuple[tuple[str, str], ...]:
    """(relative path, text) of every std/ and examples/ file, in a fixed order."""
    paths = sorted(ROOT.glob("std/**/*.module")) + sorted(ROOT.glob("examples/*.module"))
    return tuple((str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in paths)


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def gentle_mutant(index: int, seed: int = 0) -> Mutant:
    """`run_fuzz.py --gentle`: a model or a file with `verify_backward:` sizes, with one or two
    edits that mostly keep it a program: a number or a bool replaced by a small or odd value
    (`0`, `3`, `0.5`, `1e999`, `true`), else a token deleted, duplicated or swapped, a name
    replaced, a line deleted or duplicated. More of these check clean, so `build` (and
    `--verify-backward`) meet what `check` accepted at sizes it did not see."""
    rng = random.Random(f"gentle:{seed}:{index}")
    source, text = rng.choice(gentle_sources())
    parts, edits = tokens(text), []
    for _ in range(rng.choice((1, 1, 2))):
        name, edit = rng.choice(GENTLE_EDITS)
        edits.append(edit(rng, parts) or name)
    return Mutant(index, source, tuple(edits), "".join(parts))


@cache
def gentle_sources() -> tuple[tuple[str, str], ...]:
    return tuple((path, text) for path, text in sources()
                 if "\nmodel " in text or "verify_backward:" in text)


def mutant(index: int, seed: int = 0) -> Mutant:
    rng = random.Random(f"{seed}:{index}")
    source, text = rng.choice(sources())
    parts, edits = tokens(text), []
    for _ in range(rng.choice((1, 1, 2, 3))):
        name, edit = rng.choice(EDITS)
        edits.append(edit(rng, parts) or name)
    return Mutant(index, source, tuple(edits), "".join(parts))


def _significant(parts: list[str]) -> list[int]:
    return [i for i, t in enumerate(parts) if t.strip()]


def _pick(rng: random.Random, parts: list[str], test=lambda t: True) -> int | None:
    found = [i for i in _significant(parts) if test(parts[i])]
    return rng.choice(found) if found else None


def _delete(rng, parts):
    i = _pick(rng, parts)
    if i is not None:
        return f"delete `{parts.pop(i)[:20]}`"


def _duplicate(rng, parts):
    i = _pick(rng, parts)
    if i is not None:
        parts.insert(i, parts[i])
        return f"duplicate `{parts[i][:20]}`"


def _swap(rng, parts):
    significant = _significant(parts)
    if len(significant) > 1:
        k = rng.randrange(len(significant) - 1)
        a, b = significant[k], significant[k + 1]
        parts[a], parts[b] = parts[b], parts[a]
        return f"swap `{parts[b][:20]}` and `{parts[a][:20]}`"


def _number(rng, parts):
    i = _pick(rng, parts, lambda t: t[0].isdigit())
    if i is not None:
        old, parts[i] = parts[i], rng.choice(HUGE)
        return f"number {old} -> {parts[i][:20]}"


def _rename(rng, parts):
    names = sorted({t for t in parts if t[0].isalpha() or t[0] == "_"})
    i = _pick(rng, parts, lambda t: t[0].isalpha() or t[0] == "_")
    if i is not None and names:
        old, parts[i] = parts[i], rng.choice(names)
        return f"name {old} -> {parts[i]}"


def _nest(rng, parts):
    i = _pick(rng, parts, lambda t: t[0].isalnum() or t[0] == "_")
    if i is None:
        return None
    depth = rng.choice((40, 150, 400, 2000))
    open_, close = rng.choice((("(", ")"), ("[", "]"), ("-", ""), ("not ", ""), ("f(", ")")))
    parts[i] = open_ * depth + parts[i] + close * depth
    return f"nest `{parts[i][depth * len(open_):][:20]}` {depth} deep in {open_.strip()}"


def _unicode(rng, parts):
    i = rng.randrange(len(parts) + 1)
    text = "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 3)))
    parts.insert(i, text)
    return f"unicode {text.encode('unicode_escape', 'backslashreplace').decode()[:30]}"


def _punctuation(rng, parts):
    i = _pick(rng, parts)
    if i is not None:
        old, parts[i] = parts[i], rng.choice(PUNCTUATION)
        return f"token `{old[:20]}` -> `{parts[i]}`"


def _line(rng, parts):
    breaks = [i for i, t in enumerate(parts) if t.startswith("\n")]
    if len(breaks) < 2:
        return None
    k = rng.randrange(len(breaks) - 1)
    start, end = breaks[k], breaks[k + 1]
    line = parts[start:end]
    if rng.random() < 0.5:
        del parts[start:end]
        return "delete a line"
    parts[end:end] = line
    return "duplicate a line"


def _repeat(rng, parts):
    i = _pick(rng, parts)
    if i is not None:
        times = rng.choice((1000, 20000))
        joined = rng.random() >= 0.5
        # a token an earlier edit made long (nested 2,000 deep, repeated already) is
        # repeated fewer times: repeats compounded to 9 MB and 1.2 GB files, which no
        # command reads under the time cap however linear it is
        times = max(1, min(times, REPEAT_CHARS // max(1, len(parts[i]))))
        parts[i] = ", ".join([parts[i]] * times) if joined else parts[i] * times
        return f"repeat a token {times} times"


def _value(rng, parts):
    i = _pick(rng, parts, lambda t: t[0].isdigit() or t in ("true", "false"))
    if i is not None:
        old, parts[i] = parts[i], rng.choice(SMALL)
        return f"value {old} -> {parts[i]}"


EDITS = [("delete", _delete), ("duplicate", _duplicate), ("swap", _swap),
         ("number", _number), ("rename", _rename), ("nest", _nest), ("unicode", _unicode),
         ("punctuation", _punctuation), ("line", _line), ("repeat", _repeat)]
GENTLE_EDITS = [("value", _value)] * 6 + [
    ("delete", _delete), ("duplicate", _duplicate), ("swap", _swap), ("rename", _rename),
    ("line", _line)]
