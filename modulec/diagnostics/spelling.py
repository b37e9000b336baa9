"""How far apart two names are, for "did you mean" help."""

from __future__ import annotations


# Longer names are never compared: the distance costs len(a) * len(b) steps (a 440 kB
# hook name from the fuzz run took a minute), and no one mistypes a name that long.
LONGEST = 100


def edit_distance(a: str, b: str) -> int:
    """Edit distance where swapping two neighbouring letters counts as one edit (optimal
    string alignment): `frist` is one typo away from `first`, as a person sees it. Past
    LONGEST characters, the longer length: an upper bound, far more than any "did you
    mean" threshold (a third of the name) allows."""
    if max(len(a), len(b)) > LONGEST:
        return max(len(a), len(b))
    before, previous = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i]
        for j in range(1, len(b) + 1):
            substitute = previous[j - 1] + (a[i - 1] != b[j - 1])
            cost = min(previous[j] + 1, current[j - 1] + 1, substitute)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, previous = previous, current
    return previous[-1]
