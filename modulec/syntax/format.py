"""`modulec fmt`: the canonical layout of the printer, with the file's comments kept.

Items print as the canonical printer prints them; comments go back where they were:
full-line comments before the item that follows them (at its indentation), trailing
comments after the item's line, and comments inside a statement that spans several
lines before that statement. One blank line separates items where the source had at
least one. The result parses to the same tree and formatting it again changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.syntax import ast as A
from modulec.syntax import printer as P
from modulec.syntax import wrap
from modulec.syntax.comments import Comment, comments_of

BLOCKS = (A.Section, A.IfBlock, A.Decl)


@dataclass
class _Writer:
    comments: list[Comment]
    source: list[str]
    lines: list[str] = field(default_factory=list)
    last_line: int = 0  # the last source line already placed

    def leading(self, before_line: int, indent: str) -> None:
        """Comments that stand before source line `before_line`, at this indentation."""
        while self.comments and self.comments[0].line < before_line:
            comment = self.comments.pop(0)
            self.lines.append(indent + comment.text)

    def trailing(self, on_line: int) -> str:
        if self.comments and self.comments[0].line == on_line and not self.comments[0].full_line:
            return "  " + self.comments.pop(0).text
        return ""

    def gap(self, line: int) -> None:
        """One blank line where the source has a blank line between the items."""
        between = self.source[self.last_line:max(line - 1, self.last_line)]
        if self.lines and self.lines[-1] != "" and any(not text.strip() for text in between):
            self.lines.append("")

    def rest(self, indent: str = "") -> None:
        self.lines += [indent + c.text for c in self.comments]
        self.comments.clear()


def format_source(program: A.Program, text: str) -> str:
    writer = _Writer(comments_of(text), text.splitlines())
    for index, item in enumerate(program.items):
        if index and _separate(program.items[index - 1], item) and writer.lines and \
                writer.lines[-1] != "":
            writer.lines.append("")
        _top(writer, item)
    writer.rest()
    return "\n".join(writer.lines).rstrip("\n") + "\n" if writer.lines else ""


def _separate(previous, item) -> bool:
    imports = (A.Import, A.FromImport)
    return not (isinstance(previous, imports) and isinstance(item, imports))


def _top(writer: _Writer, item) -> None:
    writer.leading(item.span.line, "")
    if isinstance(item, A.Decl):
        _header(writer, item)
        _body(writer, item.body, 1)
    else:
        _lines(writer, P.top_lines(item), item)


def _header(writer: _Writer, decl: A.Decl) -> None:
    end = decl.body[0].span.line if decl.body else decl.span.end_line + 1
    header_end = max(decl.name_span.line, _last_line_before(decl, end))
    header = wrap.decl_header(decl)
    header[-1] += writer.trailing(header_end)
    writer.lines += header
    _inner_comments(writer, decl.span.line, header_end, P.INDENT)
    writer.last_line = header_end


def _last_line_before(decl: A.Decl, body_start: int) -> int:
    return body_start - 1 if decl.body else decl.span.end_line


def _body(writer: _Writer, items, depth: int) -> None:
    indent = P.INDENT * depth
    for item in items:
        writer.gap(item.span.line)
        writer.leading(item.span.line, indent)
        if isinstance(item, A.Section):
            _section(writer, item, depth)
        elif isinstance(item, A.IfBlock):
            _if(writer, item, depth)
        else:
            _lines(writer, wrap.item(item, depth, P.item_lines(item, depth)), item)


def _section(writer: _Writer, section: A.Section, depth: int) -> None:
    head = P.item_lines(A.Section(section.key, (), section.annotations, section.span,
                                  section.value), depth)[0]
    line = section.body[0].span.line - 1 if section.body else section.span.end_line
    writer.lines.append(head + writer.trailing(section.span.line))
    writer.last_line = max(section.span.line, writer.last_line)
    _inner_comments(writer, section.span.line, line, P.INDENT * (depth + 1))
    _body(writer, section.body, depth + 1)


def _if(writer: _Writer, block: A.IfBlock, depth: int) -> None:
    indent = P.INDENT * depth
    writer.lines.append(indent + "if " + P.expr(block.test) + ":" +
                        writer.trailing(block.span.line))
    writer.last_line = block.span.line
    _body(writer, block.body, depth + 1)
    if block.orelse is not None:
        else_line = block.body[-1].span.end_line + 1 if block.body else block.span.line + 1
        writer.leading(else_line, indent)
        writer.lines.append(indent + "else:" + writer.trailing(else_line))
        writer.last_line = else_line
        _body(writer, block.orelse, depth + 1)


def _lines(writer: _Writer, printed: list[str], item) -> None:
    start, end = item.span.line, item.span.end_line
    indent = printed[0][:len(printed[0]) - len(printed[0].lstrip())]
    _inner_comments(writer, start, end - 1, indent)
    printed = list(printed)
    printed[-1] += writer.trailing(end) or writer.trailing(start)
    writer.lines += printed
    writer.last_line = end


def _inner_comments(writer: _Writer, first: int, last: int, indent: str) -> None:
    """Comments on lines first..last of a statement printed on one line: keep them above."""
    inner = [c for c in writer.comments if first <= c.line <= last]
    for comment in inner:
        writer.comments.remove(comment)
    writer.lines += [indent + c.text for c in inner]
