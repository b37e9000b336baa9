"""lark's LALR parse with its per-token calls folded into one loop (lark 1.3.1, pinned in
pyproject.toml): the same tables, lexers, postlexer (our Indenter) and callbacks, the same
tree, the same exceptions.

`Lark.parse` calls `ParserState.feed_token` once per token, which reads the state's stacks
and tables again each time and checks two asserts, and the contextual lexer's
`next_token` per token, through the scanner's `match`, `Token(...)` and
`LineCounter.feed`. Written into one loop, with the stacks and tables read once a parse,
std/ and examples/ parse in two thirds of the time (0.42 -> 0.28 s for all of them);
parsing is most of the property tests' time (the fuzz run's, the checker's mutants', the
printer's round trips) and a part of every process's start (std is parsed in each).

What the loop does not handle goes through lark's own code, so that it behaves as lark
does: a token with no action is fed to `ParserState.feed_token`, which raises lark's
UnexpectedToken from the same state; the end of input is fed there too; where no terminal
matches, lark's `next_token` raises its UnexpectedCharacters from the same position; an
UnexpectedInput gets its `interactive_parser` as `_Parser.parse_from_state` gives it.
tests/test_grammar.py compares this loop's trees and errors with `Lark.parse`'s.
"""

from __future__ import annotations

from lark import Lark
from lark.exceptions import LexError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import Token
from lark.parsers.lalr_analysis import Shift
from lark.parsers.lalr_parser import InteractiveParser
from lark.parsers.lalr_parser_state import ParseConf, ParserState


def parse(lark: Lark, text: str):
    """`lark.parse(text)` for a Lark built with parser="lalr" and one start rule."""
    frontend = lark.parser
    stream = frontend._make_lexer_thread(text)
    parser = frontend.parser.parser  # lark.parsers.lalr_parser._Parser
    conf = ParseConf(parser.parse_table, parser.callbacks, frontend._verify_start())
    state = ParserState(conf, stream)
    states, callbacks = conf.states, conf.callbacks
    state_stack, value_stack = state.state_stack, state.value_stack  # the state's own lists
    token = None
    connector = frontend.lexer  # lark's PostLexConnector: the contextual lexer, our Indenter
    try:
        for token in connector.postlexer.process(_lex(connector.lexer, stream.state, state)):
            kind = token.type
            while True:
                try:
                    action, arg = states[state_stack[-1]][kind]
                except KeyError:
                    state.feed_token(token)  # raises UnexpectedToken, as lark does
                    raise
                if action is Shift:
                    state_stack.append(arg)
                    value_stack.append(callbacks[kind](token) if kind in callbacks else token)
                    break
                size = len(arg.expansion)  # reduce by rule `arg`, then its goto
                if size:
                    children = value_stack[-size:]
                    del state_stack[-size:]
                    del value_stack[-size:]
                else:
                    children = []
                value_stack.append(callbacks[arg](children))
                state_stack.append(states[state_stack[-1]][arg.origin.name][1])
        end = Token.new_borrow_pos("$END", "", token) if token else Token("$END", "", 0, 1, 1)
        return state.feed_token(end, True)
    except UnexpectedInput as error:
        error.interactive_parser = InteractiveParser(parser, state, state.lexer)
        raise


def _lex(contextual, lex_state, parser_state):
    """`ContextualLexer.lex` with `BasicLexer.next_token` folded in: the state's lexer
    matched at the current position, ignored terminals skipped, the line counter fed,
    callbacks run, as there. Where nothing matches, lark's own `next_token` runs from the
    same position and raises its UnexpectedCharacters, handled as `lex` handles it."""
    lexers, stack = contextual.lexers, parser_state.state_stack
    line_ctr, text = lex_state.line_ctr, lex_state.text
    source, end, newline = text.text, text.end, line_ctr.newline_char
    new_token = Token._future_new  # what Token(...) calls, without its keyword checks
    try:
        while line_ctr.char_pos < end:
            lexer = lexers[stack[-1]]
            pos = line_ctr.char_pos
            for pattern in lexer.scanner._mres:
                match = pattern.match(source, pos, end)
                if match:
                    break
            else:
                lexer.next_token(lex_state, parser_state)  # raises UnexpectedCharacters
                raise AssertionError("lark's lexer matched where its scanner did not")
            value, kind = match.group(0), match.lastgroup
            ignored = kind in lexer.ignore_types
            callback = lexer.callback
            token = None
            if not ignored or kind in callback:
                token = new_token(kind, value, pos, line_ctr.line, line_ctr.column)
            if kind in lexer.newline_types:  # LineCounter.feed
                newlines = value.count(newline)
                if newlines:
                    line_ctr.line += newlines
                    line_ctr.line_start_pos = pos + value.rindex(newline) + 1
            line_ctr.char_pos = pos + len(value)
            line_ctr.column = line_ctr.char_pos - line_ctr.line_start_pos + 1
            if token is not None:
                token.end_line, token.end_column = line_ctr.line, line_ctr.column
                token.end_pos = line_ctr.char_pos
                if token.type in callback:
                    token = callback[token.type](token)
                if not ignored:
                    if not isinstance(token, Token):
                        raise LexError(f"Callbacks must return a token (returned {token!r})")
                    lex_state.last_token = token
                    yield token
    except UnexpectedCharacters as error:  # as ContextualLexer.lex: the global terminals
        try:
            last_token = lex_state.last_token
            token = contextual.root_lexer.next_token(lex_state, parser_state)
            raise UnexpectedToken(token, error.allowed, state=parser_state,
                                  token_history=[last_token],
                                  terminals_by_name=contextual.root_lexer.terminals_by_name)
        except UnexpectedCharacters:
            raise error  # noqa: B904 - as lark raises it
