"""Training curves (`modulec report RUN_DIR`): the loss (train and eval) and the
throughput of a run, read from its metrics records (runtime/train/metrics.py), drawn on a
`Canvas` as two panels over the step axis, each with its axes, ticks, labels and legend.
PNG (Pillow) or SVG; the same records give the same bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from modulec.pictures.canvas import Canvas

WIDTH, HEIGHT = 960, 680
LEFT, RIGHT, TOP = 84, 24, 56
PANEL_GAP = 70
COLORS = {"loss": "#1f77b4", "eval_loss": "#ff7f0e", "tokens_per_s": "#2ca02c"}
AXIS, GRID, LABEL = "#444444", "#e4e4e4", "#222222"


@dataclass(frozen=True)
class Panel:
    """A plot area (pixels) and the data range it shows."""

    x: float
    y: float
    w: float
    h: float
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def point(self, xv: float, yv: float) -> tuple[float, float]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        px = self.x + (xv - x0) / (x1 - x0) * self.w
        py = self.y + self.h - (yv - y0) / (y1 - y0) * self.h
        return px, py


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the records with a finite number under `key`, by step (the last
    record of a step wins: a resumed run rewrites the steps after its checkpoint)."""
    found = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            found[int(record["step"])] = float(value)
    return sorted(found.items())


def layout(records: list[dict]) -> dict[str, Panel]:
    """The two panels: `loss` (train and eval) above, `tokens_per_s` below."""
    points = series(records, "loss") + series(records, "eval_loss")
    speed = series(records, "tokens_per_s")
    steps = [s for s, _ in points + speed] or [0, 1]
    x_range = nice_range(min(steps), max(steps), zero=False)
    height = (HEIGHT - TOP - 2 * PANEL_GAP) / 2
    width = WIDTH - LEFT - RIGHT
    loss_range = nice_range(*_extent([v for _, v in points]), zero=False)
    speed_range = nice_range(0.0, max([v for _, v in speed] or [1.0]), zero=True)
    return {"loss": Panel(LEFT, TOP, width, height, x_range, loss_range),
            "tokens_per_s": Panel(LEFT, TOP + height + PANEL_GAP, width, height, x_range,
                                  speed_range)}


def draw(records: list[dict], title: str) -> Canvas:
    canvas = Canvas(WIDTH, HEIGHT)
    panels = layout(records)
    canvas.text(LEFT, 28, title, size=16, bold=True)
    canvas.text(WIDTH - RIGHT, 28, _summary(records), size=12, anchor="end")
    loss, speed = panels["loss"], panels["tokens_per_s"]
    _axes(canvas, loss, "loss", _plain)
    _axes(canvas, speed, "tokens / s", _thousands)
    _curve(canvas, loss, series(records, "loss"), COLORS["loss"])
    _curve(canvas, loss, series(records, "eval_loss"), COLORS["eval_loss"], markers=True)
    _curve(canvas, speed, series(records, "tokens_per_s"), COLORS["tokens_per_s"])
    _legend(canvas, loss, [("train loss", COLORS["loss"])] +
            ([("eval loss", COLORS["eval_loss"])] if series(records, "eval_loss") else []))
    _legend(canvas, speed, [("tokens/s", COLORS["tokens_per_s"])])
    return canvas


def _summary(records: list[dict]) -> str:
    parts = []
    train, evals = series(records, "loss"), series(records, "eval_loss")
    if train:
        parts.append(f"steps {train[0][0]}..{train[-1][0]}, loss {train[0][1]:.3f} -> "
                     f"{train[-1][1]:.3f}")
    if evals:
        parts.append(f"eval {evals[-1][1]:.3f} at step {evals[-1][0]}")
    speed = sorted(v for _, v in series(records, "tokens_per_s"))
    if speed:
        parts.append(f"median {_thousands(speed[len(speed) // 2])} tokens/s")
    return "; ".join(parts)


def _axes(canvas: Canvas, panel: Panel, label: str, fmt) -> None:
    x, y, w, h = panel.x, panel.y, panel.w, panel.h
    for value in ticks(*panel.y_range):
        _, py = panel.point(panel.x_range[0], value)
        canvas.line(x, py, x + w, py, GRID)
        canvas.line(x - 5, py, x, py, AXIS)
        canvas.text(x - 8, py + 4, fmt(value), size=11, anchor="end")
    for value in ticks(*panel.x_range):
        px, _ = panel.point(value, panel.y_range[0])
        canvas.line(px, y + h, px, y + h + 5, AXIS)
        canvas.text(px, y + h + 19, _plain(value), size=11, anchor="middle")
    canvas.line(x, y, x, y + h, AXIS)
    canvas.line(x, y + h, x + w, y + h, AXIS)
    canvas.text(x + w / 2, y + h + 38, "step", size=12, anchor="middle")
    canvas.text(x, y - 8, label, size=12, bold=True)


def _curve(canvas: Canvas, panel: Panel, points, color: str, markers: bool = False) -> None:
    pixels = [panel.point(s, v) for s, v in points]
    for (x1, y1), (x2, y2) in zip(pixels, pixels[1:]):
        canvas.line(x1, y1, x2, y2, color, width=2)
    if markers or len(pixels) == 1:
        for px, py in pixels:
            canvas.rect(px - 3, py - 3, 7, 7, color)


def _legend(canvas: Canvas, panel: Panel, entries) -> None:
    x = panel.x + panel.w - 150
    y = panel.y + 10
    canvas.rect(x - 8, y - 4, 150, 22 * len(entries) + 6, "#ffffff", outline="#bbbbbb")
    for index, (name, color) in enumerate(entries):
        row = y + 22 * index
        canvas.line(x, row + 8, x + 28, row + 8, color, width=3)
        canvas.text(x + 36, row + 13, name, size=12)


# ---------------------------------------------------------------------- numbers
def _extent(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (0.0, 1.0)


def nice_step(span: float, count: int = 5) -> float:
    """A step of 1, 2 or 5 times a power of ten giving about `count` intervals."""
    raw = span / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def nice_range(low: float, high: float, zero: bool) -> tuple[float, float]:
    """[low, high] widened to whole tick steps (from 0 when `zero`); never empty."""
    if zero:
        low = min(low, 0.0)
    if high <= low:
        high = low + (abs(low) * 0.1 or 1.0)
    step = nice_step(high - low)
    return math.floor(low / step) * step, math.ceil(high / step) * step


def ticks(low: float, high: float) -> list[float]:
    step = nice_step(high - low)
    first = math.ceil(low / step - 1e-9)
    values, k = [], first
    while k * step <= high + step * 1e-9:
        values.append(round(k * step, 10))
        k += 1
    return values


def _plain(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _thousands(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.3g}k"
    return _plain(value)
