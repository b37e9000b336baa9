"""The one error the HF weight functions raise for a user's mistake, and its did-you-mean.

A wrong checkpoint directory, a missing tensor, a tensor of the wrong shape are everyday
mistakes: they are reported all at once, as a message and help lines, never as a traceback
from inside safetensors or torch.
"""

from __future__ import annotations

from modulec.diagnostics.spelling import edit_distance

SHOWN = 12  # problems of one kind listed in full; the rest are counted


class WeightLoadError(Exception):
    """A checkpoint (or a tensor dict to export) that does not fit the weight schema.

    `message`: what is wrong (may span lines, one problem a line); `help`: what to do.
    `str(error)` is both, ready to print.
    """

    def __init__(self, message: str, help: list[str] | None = None):
        self.message = message
        self.help = list(help or [])
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join([f"error: {self.message}"] + [f"  help: {h}" for h in self.help])


def listing(title: str, lines: list[str], total: int | None = None) -> list[str]:
    """`title` and up to SHOWN of `lines` indented under it, the rest (of `total`) counted."""
    total = len(lines) if total is None else total
    shown = [f"  {line}" for line in lines[:SHOWN]]
    if total > len(shown):
        shown.append(f"  ... and {total - len(shown)} more")
    return [title] + shown


def closest(name: str, candidates, n: int = 2) -> list[str]:
    """The candidates within a few typos of `name` (edit distance at most a fifth of its
    length, and at least 2), nearest first. Candidates whose length alone rules them out
    are skipped, so a checkpoint of thousands of names stays quick."""
    limit = max(2, len(name) // 5)
    scored = []
    for candidate in candidates:
        if abs(len(candidate) - len(name)) > limit:
            continue
        distance = edit_distance(name, candidate)
        if distance <= limit:
            scored.append((distance, candidate))
    return [c for _, c in sorted(scored)[:n]]


def did_you_mean(name: str, candidates) -> str:
    """` (did you mean `x`?)` for the nearest candidate, or ``."""
    near = closest(name, candidates, 1)
    return f" (did you mean `{near[0]}`?)" if near else ""


def shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
