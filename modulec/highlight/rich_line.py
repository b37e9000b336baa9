"""Highlight one echoed source line of a diagnostic (modulec/diagnostics/render_human.py).

`highlight_line(text)` returns a `rich.text.Text` whose plain text is exactly `text`
(the carets under it are placed by column), styled with a small theme in the 16 standard
colors. Red, yellow and blue stay free for the diagnostic itself (error and warning levels,
the gutter), so the source line never looks like a mark.

The line is lexed on its own, without the lines around it: a line inside a multi-line
docstring or bracket is highlighted as if it stood alone, which is close enough for an
excerpt. Characters the lexer does not know are left unstyled.
"""

from __future__ import annotations

from pygments.token import (Comment, Error, Keyword, Name, Number, Operator, String,
                            _TokenType)
from rich.text import Text

# Token type -> rich style; a token without an entry takes its nearest ancestor's.
THEME: dict[_TokenType, str] = {
    Comment: "dim",
    String: "green",
    String.Interpol: "bold green",
    String.Escape: "bold green",
    Keyword: "magenta",
    Keyword.Declaration: "bold magenta",
    Keyword.Constant: "cyan",
    Keyword.Type: "cyan",
    Operator.Word: "magenta",
    Name.Class: "bold",
    Name.Builtin: "cyan",
    Name.Decorator: "magenta",
    Number: "cyan",
    Error: "",
}

_lexer = None


def _get_lexer():
    global _lexer
    if _lexer is None:
        from modulec.highlight.lexer import ModuleLexer

        _lexer = ModuleLexer(stripnl=False, ensurenl=False)
    return _lexer


def style_for(token: _TokenType) -> str:
    while token is not None:
        style = THEME.get(token)
        if style is not None:
            return style
        token = token.parent
    return ""


def highlight_line(text: str) -> Text:
    """`text` (one line, no newline) as a styled `Text` with the same plain text."""
    result = Text()
    run, run_style = [], ""
    # get_tokens_unprocessed: no newline added or stripped, so the text is the input's.
    for _, token, value in _get_lexer().get_tokens_unprocessed(text):
        style = style_for(token) if value.strip() else run_style  # blanks join their run
        if style != run_style and run:
            result.append("".join(run), style=run_style or None)
            run = []
        run.append(value)
        run_style = style
    if run:
        result.append("".join(run), style=run_style or None)
    return result
