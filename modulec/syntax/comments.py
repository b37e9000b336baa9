"""Comments of a source file, for the formatter: the syntax tree holds none.

A comment starts at `#` outside a string or docstring and runs to the end of the line;
it is *full-line* when only indentation precedes it, else *trailing*.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Comment:
    line: int  # 1-based
    text: str  # from `#`, trailing spaces removed
    full_line: bool


def comments_of(text: str) -> list[Comment]:
    found: list[Comment] = []
    in_docstring = False
    for number, line in enumerate(text.splitlines(), start=1):
        column, in_docstring = _comment_column(line, in_docstring)
        if column is not None:
            found.append(Comment(number, line[column:].rstrip(), not line[:column].strip()))
    return found


def _comment_column(line: str, in_docstring: bool) -> tuple[int | None, bool]:
    """(column of the line's comment or None, whether a docstring is open after the line)."""
    index, in_string = 0, False
    while index < len(line):
        if in_docstring:
            end = line.find('"""', index)
            if end < 0:
                return None, True
            index, in_docstring = end + 3, False
            continue
        if line.startswith('"""', index) and not in_string:
            index, in_docstring = index + 3, True
            continue
        char = line[index]
        if char == '"':
            in_string = not in_string
        elif char == "\\" and in_string:
            index += 1
        elif char == "#" and not in_string:
            return index, False
        index += 1
    return None, in_docstring
