"""Source files and spans: the coordinates every diagnostic and syntax node points into."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

_NEWLINE = re.compile("\n")


class Span(NamedTuple):
    """A region of one source file. Lines and columns are 1-based; `end_column` is exclusive.

    `start`/`end` are character offsets into the file's text (end exclusive). A named tuple
    rather than a frozen dataclass: the parser makes one per syntax node, and tuples are
    several times cheaper to build.
    """

    file: str
    start: int
    end: int
    line: int
    column: int
    end_line: int
    end_column: int

    def cover(self, other: "Span | None") -> "Span":
        """The smallest span containing both (same file)."""
        if other is None:
            return self
        first = self if self.start <= other.start else other
        last = self if self.end >= other.end else other
        return Span(self.file, first.start, last.end, first.line, first.column,
                    last.end_line, last.end_column)


@dataclass(frozen=True)
class SourceFile:
    """A file's name and text, with a line index for offset -> (line, column) lookups."""

    name: str
    text: str
    _line_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts = [0] + [match.end() for match in _NEWLINE.finditer(self.text)]
        object.__setattr__(self, "_line_starts", tuple(starts))

    @classmethod
    def read(cls, path: str | Path) -> "SourceFile":
        path = Path(path)
        return cls(str(path), path.read_text(encoding="utf-8"))

    @property
    def line_count(self) -> int:
        return len(self._line_starts)

    def position(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        offset = max(0, min(offset, len(self.text)))
        index = bisect.bisect_right(self._line_starts, offset) - 1
        return index + 1, offset - self._line_starts[index] + 1

    def line_text(self, line: int) -> str:
        """The text of a 1-based line, without its newline."""
        if not 1 <= line <= len(self._line_starts):
            return ""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start:] if end < 0 else self.text[start:end]

    def offset(self, line: int, column: int) -> int:
        """Character offset of a 1-based (line, column), clipped to the text."""
        line = max(1, min(line, len(self._line_starts)))
        return min(self._line_starts[line - 1] + column - 1, len(self.text))

    def respan(self, span: Span) -> Span:
        """The same line/column region, with offsets recomputed for this file's text
        (columns past a line's end, possible on a patched copy of it, are clipped)."""
        line, column = self._clip(span.line, span.column)
        end_line, end_column = self._clip(span.end_line, span.end_column)
        start = self.offset(line, column)
        end = max(start, self.offset(end_line, end_column))
        end_line, end_column = self.position(end)
        return Span(span.file, start, end, line, column, end_line, end_column)

    def _clip(self, line: int, column: int) -> tuple[int, int]:
        line = max(1, min(line, len(self._line_starts)))
        return line, max(1, min(column, self._line_length(line) + 1))

    def _line_length(self, line: int) -> int:
        """len(line_text(line)) from the line index, without copying the line (respanning
        each node of a 200 kB line copied it once per node)."""
        starts = self._line_starts
        end = starts[line] - 1 if line < len(starts) else len(self.text)
        return end - starts[line - 1]

    def span(self, start: int, end: int | None = None) -> Span:
        """A span from character offsets (end defaults to start + 1, clipped to the text)."""
        end = start + 1 if end is None else end
        end = max(end, start)
        line, column = self.position(start)
        end_line, end_column = self.position(end)
        return Span(self.name, start, end, line, column, end_line, end_column)
