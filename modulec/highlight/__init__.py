"""Syntax highlighting of the Module DSL: the Pygments lexer (`modulec.highlight.lexer`),
the word lists it shares with the TextMate grammar (`modulec.highlight.keywords`) and a
one-line highlighter for diagnostics (`modulec.highlight.rich_line`).

Nothing is imported here, so that importing one of them stays cheap.
"""
