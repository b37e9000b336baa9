"""The memory plan as a picture: `modulec plan X.module --picture mem.png`.

x is the schedule step (one op of the function's Graph IR; the forward's ops, then its
backward's), y the byte offset in a region's arena. Each rectangle is one tensor's storage,
from the op that writes it to the last op that reads it (a view, or an output written in
place, shares the rectangle of the tensor it lives in); a call reserves its callee's whole
arena for the op (gray). Regions are stacked bands, each with its own offsets and colors;
in each band a dashed red line is the region's lower bound (its peak live bytes: no
planner can do better) and a black line the arena the planner chose.

The plans are the ones `modulec plan` totals (modulec.plan.from_graph): each function is
planned once, its callees' arenas reserved at their call. By default the picture shows the
model's entry function and its backward: the step's transient activations, the largest
region the activation planner places; a function of choice with `scope`.
"""

from __future__ import annotations

from modulec.plan.units import byte_unit, size_text

from dataclasses import dataclass
from pathlib import Path

from modulec.ir.graph import Function, Graph
from modulec.pictures import PictureError
from modulec.pictures.canvas import Canvas, fit, text_width
from modulec.pictures.select import select
from modulec.plan.memory import SAVED, TRANSIENT, MemoryPlan
from modulec.plan.memory.model import region_order

REGION_COLORS = {  # shades cycled over the rectangles of one band, so neighbours differ
    TRANSIENT: ("#4c78a8", "#72a0cf", "#2f5b8a", "#9cbde0"),
    SAVED: ("#f58518", "#f9ae5c", "#c96a0c", "#fbc98f"),
}
OTHER_COLORS = ("#54a24b", "#88c77f", "#3a7d33", "#b3dcab")
CALL_COLORS = ("#a8a8a8", "#c4c4c4")
LOWER_BOUND_COLOR = "#d62728"
ARENA_COLOR = "#111111"
REGION_TITLES = {TRANSIENT: "transient activations", SAVED: "saved activations"}

WIDTH_MIN, WIDTH_MAX, HEIGHT = 1280, 2600, 760
LEFT, RIGHT, TOP, BOTTOM = 96, 280, 104, 66
BAND_GAP, MIN_BAND_SHARE = 26, 0.22


@dataclass(frozen=True)
class Phase:
    kind: str  # forward | backward
    function: Function
    plan: MemoryPlan | None
    start: int  # its first op's step in the picture


def function_plans(graph: Graph) -> dict[str, MemoryPlan | None]:
    """Every function's memory plan, as `plan_step` makes it (arena metric): callees first,
    each call reserving its callee's transient arena."""
    from modulec.plan.from_graph import METRICS, _callees_first, _planned

    arenas: dict[str, tuple[int, ...]] = {}
    plans: dict[str, MemoryPlan | None] = {}
    handed: dict[str, dict] = {}
    twins: dict[str, dict] = {}
    for function in _callees_first(graph):
        plan = _planned(graph, function, arenas, "arena", handed, twins=twins)
        plans[function.name] = plan
        region = plan.regions.get(TRANSIENT) if plan is not None else None
        arenas[function.name] = (region.arena_bytes if region else 0,) * len(METRICS)
    return plans


def draw_memory_plan(graph: Graph, path: Path | str, scope: str | None = None,
                     phase: str | None = None) -> Path:
    """Write the picture of the memory plan to `path`: SVG when it ends in `.svg`, else PNG
    (Pillow). `scope` and `phase` choose the function as `modulec graph` does (default: the
    entry function, forward and backward). Raises PictureError (Pillow missing, unknown
    function) and modulec.plan.from_graph.ShapeUnknown (free dims without sizes)."""
    from modulec.pictures.render import write_bytes

    path = Path(path)
    canvas = memory_picture(graph, scope, phase)
    data = canvas.to_svg().encode("utf-8") if path.suffix.lower() == ".svg" else canvas.to_png()
    write_bytes(path, data)
    return path


def memory_picture(graph: Graph, scope: str | None = None, phase: str | None = None) -> Canvas:
    selection = select(graph, scope, phase)
    plans = function_plans(graph)
    phases, start = [], 0
    for kind, function in (("forward", selection.forward), ("backward", selection.backward)):
        if function is not None:
            phases.append(Phase(kind, function, plans.get(function.name), start))
            start += len(function.nodes)
    if start == 0:
        raise PictureError(f"{selection.title} has no ops: no memory to draw")
    return _Picture(graph, selection.title, phases, start).draw()


# ====================================================================== drawing
@dataclass
class _Band:
    region: str
    bytes: int
    bottom: float = 0.0
    height: float = 0.0

    def y(self, offset: int) -> float:
        return self.bottom - offset * self.height / self.bytes


class _Picture:
    def __init__(self, graph: Graph, title: str, phases: list[Phase], steps: int) -> None:
        self.graph = graph
        self.title = title
        self.phases = phases
        self.steps = steps
        self.slot = max(14.0, min(90.0, 1600.0 / steps))
        width = round(LEFT + RIGHT + self.slot * steps)
        self.canvas = Canvas(max(WIDTH_MIN, min(WIDTH_MAX, width)), HEIGHT)
        self.slot = (self.canvas.width - LEFT - RIGHT) / steps
        self.bands = self._bands()
        self.calls = False
        self.kept = False

    # ------------------------------------------------------------------ layout
    def _bands(self) -> list[_Band]:
        sizes: dict[str, int] = {}
        for phase in self.phases:
            for name, region in (phase.plan.regions.items() if phase.plan else ()):
                sizes[name] = max(sizes.get(name, 0), region.arena_bytes)
        names = sorted((r for r, b in sizes.items() if b > 0),
                       key=lambda r: (r != TRANSIENT, region_order(r)))
        bands = [_Band(r, sizes[r]) for r in names]
        if not bands:
            return bands
        space = HEIGHT - TOP - BOTTOM - BAND_GAP * (len(bands) - 1)
        total = sum(b.bytes for b in bands)
        shares = [max(b.bytes / total, MIN_BAND_SHARE) if len(bands) > 1 else 1.0
                  for b in bands]
        bottom = HEIGHT - BOTTOM
        for band, share in zip(bands, shares):  # bottom up
            band.bottom = bottom
            band.height = space * share / sum(shares)
            bottom -= band.height + BAND_GAP
        return bands

    def x(self, step: float) -> float:
        return LEFT + step * self.slot

    # ------------------------------------------------------------------ the picture
    def draw(self) -> Canvas:
        c = self.canvas
        c.text(LEFT, 30, f"memory plan: {self.graph.model}, {self.title}", 18, bold=True)
        c.text(LEFT, 52, self._subtitle(), 12, "#444444")
        for band in self.bands:
            self._band(band)
        self._phases()
        self._steps()
        self._legend()
        if not self.bands:
            c.text(LEFT, HEIGHT / 2, "no buffers: nothing to place", 14, "#666666")
        return c

    def _subtitle(self) -> str:
        parts = []
        for phase in self.phases:
            region = phase.plan.regions.get(TRANSIENT) if phase.plan else None
            if region is not None:
                parts.append(f"{phase.kind}: transient arena {size_text(region.arena_bytes)}, "
                             f"lower bound {size_text(region.lower_bound_bytes)}")
        return "; ".join(parts) or "no transient activations"

    def _band(self, band: _Band) -> None:
        c = self.canvas
        top = band.bottom - band.height
        right = self.x(self.steps)
        c.rect(LEFT, top, right - LEFT, band.height, "#f7f7f7", "#cccccc")
        arena = [p.plan.regions[band.region] for p in self.phases
                 if p.plan and band.region in p.plan.regions]
        detail = ", ".join(f"{p.kind} arena {size_text(p.plan.regions[band.region].arena_bytes)}"
                           for p in self.phases
                           if p.plan and band.region in p.plan.regions)
        c.text(LEFT, top - 7, f"{REGION_TITLES.get(band.region, band.region)}" +
               (f"  ({detail})" if arena else ""), 12, "#333333", bold=True)
        self._ticks(band)
        for phase in self.phases:
            region = phase.plan.regions.get(band.region) if phase.plan else None
            if region is None:
                continue
            for index, block in enumerate(region.blocks):
                self._block(band, phase, block, region.block_offsets[block.id], index)
                if band.region == SAVED:
                    self._kept(band, phase, block, region.block_offsets[block.id], index)
            x0, x1 = self.x(phase.start), self.x(phase.start + len(phase.function.nodes))
            y = band.y(region.arena_bytes)
            c.line(x0, y, x1, y, ARENA_COLOR, 1)
            y = band.y(region.lower_bound_bytes)
            c.line(x0, y, x1, y, LOWER_BOUND_COLOR, 2, (7, 4))

    def _ticks(self, band: _Band) -> None:
        c = self.canvas
        name, unit = byte_unit(band.bytes)
        step = nice_step(band.bytes / unit / max(1.0, band.height / 38))
        count = 0
        while count * step * unit <= band.bytes:
            y = band.y(count * step * unit)
            c.line(LEFT - 5, y, LEFT, y, "#555555")
            c.text(LEFT - 8, y + 4, f"{round(count * step, 6):g} {name}", 10, "#444444", "end")
            count += 1
        c.line(LEFT, band.bottom, LEFT, band.bottom - band.height, "#555555")

    def _block(self, band: _Band, phase: Phase, block, offset: int, index: int) -> None:
        c = self.canvas
        x0 = self.x(phase.start + block.start)
        x1 = self.x(phase.start + block.end + 1)
        y1, y0 = band.y(offset), band.y(offset + block.size)
        call = isinstance(block.id, str) and block.id.startswith("call:")
        self.calls = self.calls or call
        colors = CALL_COLORS if call else REGION_COLORS.get(band.region, OTHER_COLORS)
        labels = self._labels(phase, block.id)
        tooltip = (f"{' '.join(labels[0])}: {block.size} bytes at offset {offset}, ops "
                   f"{phase.function.nodes[block.start].id}..{phase.function.nodes[block.end].id}")
        c.rect(x0, y0, x1 - x0, y1 - y0, colors[index % len(colors)], "#ffffff", tooltip)
        size, room = 10, x1 - x0 - 6
        lines = int((y1 - y0 - 3) // (size + 3))
        if lines >= 3:  # a tall one: long names wrap at their words (CamelCase too)
            labels = labels[:1] + [wrap(labels[0][0], size, room)] + labels[1:]
        chosen = next((c for c in labels if len(c) <= lines
                       and all(text_width(t, size) <= room for t in c)), None)
        if chosen is None and lines >= 1:
            chosen = (fit(labels[-1][0], size, room),)
        color = "#111111" if call else "#ffffff"
        for i, text in enumerate(chosen or ()):
            if text:
                middle = (y0 + y1) / 2 + size / 2 - 1 + (i - (len(chosen) - 1) / 2) * (size + 3)
                c.text((x0 + x1) / 2, middle, text, size, color, "middle")

    def _kept(self, band: _Band, phase: Phase, block, offset: int, index: int) -> None:
        """A saved tensor stays until the backward's last read of it: drawn there lighter."""
        backward = next((p for p in self.phases if p.kind == "backward"), None)
        if phase.kind != "forward" or backward is None or phase.plan is None:
            return
        members = {bid for bid, p in phase.plan.placements.items() if p.block == block.id}
        reads = [i for i, node in enumerate(backward.function.nodes)
                 if members.intersection(node.inputs)]
        if not reads:
            return
        x0, x1 = self.x(backward.start), self.x(backward.start + max(reads) + 1)
        y1, y0 = band.y(offset), band.y(offset + block.size)
        color = lighter(REGION_COLORS[SAVED][index % len(REGION_COLORS[SAVED])])
        self.kept = True
        self.canvas.rect(x0, y0, x1 - x0, y1 - y0, color, "#ffffff",
                         f"{' '.join(self._labels(phase, block.id)[0])}: kept until "
                         f"{backward.function.nodes[max(reads)].id} reads it")

    def _labels(self, phase: Phase, block_id) -> list[tuple[str, ...]]:
        """What to write on a rectangle, one tuple of lines each, the most telling first:
        the first that fits is drawn."""
        function = phase.function
        if isinstance(block_id, str) and block_id.startswith("call:"):
            node = next((n for n in function.nodes if n.id == block_id[5:]), None)
            if node is not None:
                repeat = f"x{node.repeat}" if str(node.repeat) != "1" else ""
                module = node.target.split("#")[0]
                return [(f"{node.target} {repeat} arena".replace("  ", " "),),
                        (node.target, f"{repeat} arena".strip()),
                        (f"{node.target} {repeat}".strip(),), (module, repeat),
                        (f"{module} {repeat}".strip(),), (f"call {repeat}".strip(),)]
        info = function.value(str(block_id))
        name = info.name if info and info.name else str(block_id)
        shared = sum(1 for out, _ in (phase.plan.inplace.items() if phase.plan else ())
                     if phase.plan.placements[out].block == block_id)
        more = f"+{shared} in place"
        return ([(f"{name} {more}",), (name, more)] if shared else []) + \
            [(name,), (str(block_id),)]

    def _phases(self) -> None:
        c = self.canvas
        for phase in self.phases:
            x0, x1 = self.x(phase.start), self.x(phase.start + len(phase.function.nodes))
            c.text((x0 + x1) / 2, 80, fit(f"{phase.kind}: {phase.function.name}", 13, x1 - x0),
                   13, "#3f6f9f" if phase.kind == "forward" else "#b0413e", "middle", True)
            if phase.start:
                c.line(x0, 86, x0, HEIGHT - BOTTOM + 30, "#777777", 1, (4, 4))

    def _steps(self) -> None:
        c = self.canvas
        y = HEIGHT - BOTTOM
        every = 1
        while text_width("f000", 10) > self.slot * every:
            every += 1
        for phase in self.phases:
            for index, node in enumerate(phase.function.nodes):
                x = self.x(phase.start + index)
                c.line(x, y, x, y + 4, "#555555")
                if index % every:
                    continue
                middle = x + self.slot / 2
                c.text(middle, y + 16, node.id, 10, "#333333", "middle")
                target = fit(node.target, 9, self.slot * every - 4)
                if target:
                    c.text(middle, y + 28, target, 9, "#666666", "middle")
        c.line(LEFT, y, self.x(self.steps), y, "#555555")
        c.text(LEFT + (self.x(self.steps) - LEFT) / 2, HEIGHT - 14,
               "schedule step (one op of the Graph IR)", 12, "#333333", "middle")

    def _legend(self) -> None:
        c = self.canvas
        x = self.x(self.steps) + 30
        y = TOP + 10
        c.text(x, y, "legend", 13, bold=True)
        y += 22
        for band in self.bands:
            colors = REGION_COLORS.get(band.region, OTHER_COLORS)
            c.rect(x, y - 11, 12, 12, colors[0])
            c.rect(x + 14, y - 11, 12, 12, colors[1])
            c.text(x + 34, y, REGION_TITLES.get(band.region, band.region), 12)
            y += 22
        if self.kept:
            c.rect(x, y - 11, 12, 12, lighter(REGION_COLORS[SAVED][0]))
            c.rect(x + 14, y - 11, 12, 12, lighter(REGION_COLORS[SAVED][1]))
            c.text(x + 34, y, "saved, kept for the backward", 12)
            y += 22
        if self.calls:
            c.rect(x, y - 11, 12, 12, CALL_COLORS[0])
            c.rect(x + 14, y - 11, 12, 12, CALL_COLORS[1])
            c.text(x + 34, y, "a callee's arena (call)", 12)
            y += 22
        c.line(x, y - 5, x + 26, y - 5, LOWER_BOUND_COLOR, 2, (7, 4))
        c.text(x + 34, y, "lower bound (peak live bytes)", 12)
        y += 22
        c.line(x, y - 5, x + 26, y - 5, ARENA_COLOR, 1)
        c.text(x + 34, y, "arena size (the plan)", 12)
        y += 34
        for line in ("x: schedule step (op)", "y: offset in the region's arena",
                     "one rectangle per tensor's storage,", "from its first write to its",
                     "last read; views and in-place", "outputs share their source's"):
            c.text(x, y, line, 11, "#555555")
            y += 16


def wrap(text: str, size: int, room: float) -> tuple[str, ...]:
    """`text` on as many lines as it takes to fit `room`, broken at spaces and before
    capitals (`DenseTransformerBlock#1` -> `DenseTransformer`, `Block#1`)."""
    import re

    words = [w for w in re.split(r" |(?<=[a-z0-9])(?=[A-Z])", text) if w]
    lines: list[str] = []
    for word in words:
        if lines:
            glue = " " if f"{lines[-1]} {word}" in text else ""
            if text_width(lines[-1] + glue + word, size) <= room:
                lines[-1] += glue + word
                continue
        lines.append(word)
    return tuple(lines)


def lighter(color: str) -> str:
    """`color` mixed half and half with white."""
    channels = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in channels)


def nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least `raw`."""
    power = 1e-3
    while True:
        for factor in (1, 2, 5):
            if factor * power >= raw:
                return round(factor * power, 6)
        power *= 10
