"""Byte counts for people: the unit that keeps the number short."""

from __future__ import annotations


def byte_unit(count: int) -> tuple[str, int]:
    for name, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return name, size
    return "B", 1


def size_text(count: int) -> str:
    """Bytes in a short unit: `512 B`, `64 KiB`, `1.5 MiB`."""
    name, size = byte_unit(count)
    value = count / size
    return f"{value:.0f} {name}" if value == int(value) or value >= 100 else f"{value:.1f} {name}"


def gib_text(count: int) -> str:
    """GiB with two decimals (how budgets are written), or a shorter unit where that
    would read 0.00 GiB."""
    if count >= 2 ** 30 // 100:
        return f"{count / 2 ** 30:,.2f} GiB"
    return size_text(count)
