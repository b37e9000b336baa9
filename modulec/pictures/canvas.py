"""A small drawing: rectangles, lines and text on a white page, written as SVG (plain
text, no dependency) or PNG (Pillow). Both writers draw the same items in the same order,
so the two files show the same picture; the output is deterministic."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from modulec.pictures import PictureError

CHAR_WIDTH = 0.56  # average glyph width of a sans-serif font, in font sizes: for layout only


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    outline: str | None = None
    tooltip: str = ""


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    color: str
    width: int = 1
    dash: tuple[int, int] | None = None


@dataclass(frozen=True)
class Text:
    x: float
    y: float  # the baseline
    text: str
    size: int = 12
    color: str = "#222222"
    anchor: str = "start"  # start | middle | end
    bold: bool = False


@dataclass
class Canvas:
    width: int
    height: int
    background: str = "#ffffff"
    items: list = field(default_factory=list)

    def rect(self, x, y, w, h, fill, outline=None, tooltip="") -> None:
        self.items.append(Rect(x, y, w, h, fill, outline, tooltip))

    def line(self, x1, y1, x2, y2, color, width=1, dash=None) -> None:
        self.items.append(Line(x1, y1, x2, y2, color, width, dash))

    def text(self, x, y, text, size=12, color="#222222", anchor="start", bold=False) -> None:
        self.items.append(Text(x, y, str(text), size, color, anchor, bold))

    # ------------------------------------------------------------------ SVG
    def to_svg(self) -> str:
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
               f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
               f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
               f'<rect x="0" y="0" width="{self.width}" height="{self.height}" '
               f'fill="{self.background}"/>']
        for item in self.items:
            if isinstance(item, Rect):
                stroke = f' stroke="{item.outline}"' if item.outline else ""
                body = f"<title>{escape(item.tooltip)}</title>" if item.tooltip else ""
                out.append(f'<rect x="{n(item.x)}" y="{n(item.y)}" width="{n(item.w)}" '
                           f'height="{n(item.h)}" fill="{item.fill}"{stroke}>{body}</rect>'
                           if body else
                           f'<rect x="{n(item.x)}" y="{n(item.y)}" width="{n(item.w)}" '
                           f'height="{n(item.h)}" fill="{item.fill}"{stroke}/>')
            elif isinstance(item, Line):
                dash = f' stroke-dasharray="{item.dash[0]},{item.dash[1]}"' if item.dash else ""
                out.append(f'<line x1="{n(item.x1)}" y1="{n(item.y1)}" x2="{n(item.x2)}" '
                           f'y2="{n(item.y2)}" stroke="{item.color}" '
                           f'stroke-width="{item.width}"{dash}/>')
            else:
                weight = ' font-weight="bold"' if item.bold else ""
                out.append(f'<text x="{n(item.x)}" y="{n(item.y)}" font-size="{item.size}" '
                           f'fill="{item.color}" text-anchor="{item.anchor}"{weight}>'
                           f'{escape(item.text)}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"

    # ------------------------------------------------------------------ PNG
    def to_png(self) -> bytes:
        try:
            from PIL import Image, ImageDraw
        except ImportError:
            raise PictureError("a PNG picture needs Pillow (`pip install pillow`; `make setup` "
                               "installs it), or write the picture as .svg") from None
        image = Image.new("RGB", (self.width, self.height), self.background)
        draw = ImageDraw.Draw(image)
        fonts: dict = {}
        for item in self.items:
            if isinstance(item, Rect):
                box = [round(item.x), round(item.y), round(item.x + item.w) - 1,
                       round(item.y + item.h) - 1]
                if box[2] < box[0] or box[3] < box[1]:
                    continue
                draw.rectangle(box, fill=item.fill, outline=item.outline)
            elif isinstance(item, Line):
                _line(draw, item)
            else:
                font = fonts.get((item.size, item.bold))
                if font is None:
                    font = fonts[(item.size, item.bold)] = _font(item.size, item.bold)
                left, top, right, bottom = draw.textbbox((0, 0), item.text, font=font)
                width = right - left
                x = item.x - {"start": 0, "middle": width / 2, "end": width}[item.anchor]
                ascent = font.getmetrics()[0] if hasattr(font, "getmetrics") else bottom
                draw.text((round(x), round(item.y - ascent)), item.text, fill=item.color,
                          font=font)
        stream = io.BytesIO()
        image.save(stream, format="PNG", optimize=False)
        return stream.getvalue()


def _line(draw, item: Line) -> None:
    start, end = (item.x1, item.y1), (item.x2, item.y2)
    if item.dash is None:
        draw.line([start, end], fill=item.color, width=item.width)
        return
    on, off = item.dash
    length = ((end[0] - start[0]) ** 2 + (end[1] - start[1]) ** 2) ** 0.5
    if length == 0:
        return
    ux, uy = (end[0] - start[0]) / length, (end[1] - start[1]) / length
    position = 0.0
    while position < length:
        stop = min(position + on, length)
        draw.line([(start[0] + ux * position, start[1] + uy * position),
                   (start[0] + ux * stop, start[1] + uy * stop)], fill=item.color,
                  width=item.width)
        position += on + off


def _font(size: int, bold: bool):
    """Pillow's own scalable font (the same on every machine: the PNG bytes do not depend
    on the fonts installed); PNG text is never bold."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1, with FreeType
    except (TypeError, ImportError):
        return ImageFont.load_default()


def text_width(text: str, size: int) -> float:
    """About how wide `text` is drawn, for fitting labels (the same in SVG and PNG)."""
    return len(text) * size * CHAR_WIDTH


def fit(text: str, size: int, width: float) -> str:
    """`text`, cut with `..` to fit `width` pixels; "" when not even two characters fit."""
    if text_width(text, size) <= width:
        return text
    keep = int(width / (size * CHAR_WIDTH)) - 2
    return text[:keep] + ".." if keep >= 2 else ""


def n(value: float) -> str:
    """A coordinate as short, stable text."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


__all__ = ["Canvas", "Line", "Rect", "Text", "fit", "text_width"]
