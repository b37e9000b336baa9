"""Lark callbacks that build the syntax tree (modulec.syntax.ast) while the LALR parser reduces.

Each method is named after a grammar rule or alias and receives that rule's kept children:
tokens for named terminals, already-built nodes for sub-rules, None for an absent `[...]`.
"""

from __future__ import annotations

from lark import Token, Transformer

from modulec.source import Span
from modulec.syntax import ast as A
from modulec.syntax.precedence import group


def _kept(children) -> list:
    return [child for child in children if child is not None]


def _of(children, kind) -> tuple:
    return tuple(child for child in children if isinstance(child, kind))


class Builder(Transformer):
    """Builds nodes with spans; `file` is set by the parser before each parse."""

    def __init__(self) -> None:
        super().__init__(visit_tokens=False)
        self.file = "<input>"

    # ------------------------------------------------------------ spans
    def span(self, first, last=None) -> Span:
        if last is None:
            last = first
        if first.__class__ is Token:
            start, line, column = first.start_pos, first.line, first.column
        else:
            span = first.span
            start, line, column = span.start, span.line, span.column
        if last.__class__ is Token:
            return Span(self.file, start, last.end_pos, line, column, last.end_line, last.end_column)
        span = last.span
        return Span(self.file, start, span.end, line, column, span.end_line, span.end_column)

    def spanned(self, children) -> Span:
        kept = _kept(children)
        return self.span(kept[0], kept[-1])

    # ------------------------------------------------------------ program and imports
    def start(self, children):
        return A.Program(tuple(children), file=self.file)

    def import_stmt(self, children):
        (path, names, first, last), alias = children
        span = self.span(first, alias if alias is not None else last)
        return A.Import(path, alias.value if alias is not None else None, names, span)

    def import_path(self, children):
        names = [c for c in children if isinstance(c, Token)]
        items = children[-1] if isinstance(children[-1], tuple) else None
        last = items[-1] if items else names[-1]
        return tuple(n.value for n in names), items, names[0], last

    def from_stmt(self, children):
        (path, first), items = children[0], _of(children[1:], tuple)[0]
        return A.FromImport(path, items, self.span(first, items[-1]))

    def dotted_name(self, children):
        return tuple(c.value for c in children), children[0]

    def import_items(self, children):
        return tuple(_kept(children))

    def import_item(self, children):
        name, alias = children
        return A.ImportItem(name.value, alias.value if alias else None,
                            self.span(name, alias or name))

    # ------------------------------------------------------------ declarations
    def decl(self, children):
        (kind, abstract, first), name, params, extends = children[:4]
        annotations = _of(children[4:], A.Annotation)
        suite = children[-1] if isinstance(children[-1], list) else []
        last = suite[-1] if suite else (annotations[-1] if annotations else name)
        span = self.span(first, last)
        return A.Decl(kind, name.value, params, tuple(suite), abstract, extends,
                      annotations, span, self.span(name))

    def decl_kind(self, children):
        return children[-1].value, len(children) == 2, children[0]

    def decl_params(self, children):
        return _of(children, A.DeclParam)

    def decl_param(self, children):
        name, type_, default = children
        span = self.span(name, default or type_ or name)
        return A.DeclParam(name.value, type_, default, span)

    # ------------------------------------------------------------ items
    def suite(self, children):
        return list(children)

    def section(self, children):
        key, annotations = children[0], _of(children, A.Annotation)
        suite = children[-1] if isinstance(children[-1], list) else []
        last = suite[-1] if suite else (annotations[-1] if annotations else key)
        return A.Section(key, tuple(suite), annotations, self.span(key, last))

    def valued_section(self, children):
        entry, suite = children
        return A.Section(entry.key, tuple(suite), entry.annotations,
                         self.span(entry, suite[-1]), entry.value)

    def entry(self, children):
        key, value, default = children[:3]
        annotations = _of(children[3:], A.Annotation)
        last = annotations[-1] if annotations else (default or value)
        return A.Entry(key, value, default, annotations, self.span(key, last))

    def value(self, children):
        return children[0]

    def named_value(self, children):
        name, value = children
        return A.NamedValue(name.value, value, self.span(name, value))

    def binding(self, children):
        target, value = children[:2]
        annotations = _of(children[2:], A.Annotation)
        return A.Binding(target, value, annotations, self.span(target, (annotations or [value])[-1]))

    def flow(self, children):
        return A.Flow(tuple(children), self.span(children[0], children[-1]))

    def step(self, children):
        expr, annotations = children[0], tuple(children[1:])
        return A.Step(expr, annotations, self.span(expr, (annotations or [expr])[-1]))

    def constraint(self, children):
        condition, message = children
        return A.Constraint(condition, A.String(message.value, self.span(message)),
                            self.span(condition, message))

    def if_block(self, children):
        keyword, test, body, _else, orelse = children
        last = (orelse or body)[-1]
        return A.IfBlock(test, tuple(body), tuple(orelse) if orelse is not None else None,
                         self.span(keyword, last))

    def impl_block(self, children):
        keyword, rest = children[0], _kept(children[1:])
        if rest and isinstance(rest[0], Token):
            return A.ImplBlock(rest[0].value.rstrip(), (), self.span(keyword, rest[0]))
        entries = tuple(rest)
        return A.ImplBlock(None, entries, self.span(keyword, entries[-1] if entries else keyword))

    def impl_entry(self, children):
        name, text = children
        return A.ImplEntry(name.value, text.value.rstrip(), self.span(name, text))

    def list_item(self, children):
        dash, item = children
        return A.ListItem(item, self.span(dash, item))

    def prose_item(self, children):
        dash, *words = children
        return A.Prose(tuple(w.value for w in words), self.span(dash, words[-1]))

    def docstring_item(self, children):
        return A.Docstring(children[0].value, self.span(children[0]))

    def annotation_item(self, children):
        return A.AnnotationLine(tuple(children), self.span(children[0], children[-1]))

    def annotation(self, children):
        name, lpar, args, rpar = children
        if lpar is None:
            return A.Annotation(name.value, None, self.span(name))
        return A.Annotation(name.value, args or (), self.span(name, rpar))

    # ------------------------------------------------------------ expressions
    def ifexp(self, children):
        body, _if, test, _else, orelse = children
        return A.IfExp(body, test, orelse, self.span(body, orelse or test))

    def flat(self, children):
        return group(children, self.span)

    def array_generic(self, children):
        keyword, _lt, count, element, _gt = children
        return A.ArrayType(count, element, self.span(keyword, _gt))

    def attribute(self, children):
        value, name = children
        return A.Attribute(value, name.value, self.span(value, name))

    def call(self, children):
        func, _lpar, args, rpar = children
        return A.Call(func, args or (), self.span(func, rpar))

    def index(self, children):
        value, _lsqb, subscripts, rsqb = children
        return A.Index(value, subscripts, self.span(value, rsqb))

    def optional(self, children):
        value, mark = children
        return A.OptionalType(value, self.span(value, mark))

    def subscripts(self, children):
        return tuple(_kept(children))

    def slice(self, children):
        lower, upper = children
        bounds = _kept(children)
        span = self.span(bounds[0], bounds[-1]) if bounds else A.NO_SPAN
        return A.Slice(lower, upper, span)

    def args(self, children):
        return tuple(c if isinstance(c, A.Arg) else A.Arg(None, c, False, c.span)
                     for c in _kept(children))

    def keyword(self, children):
        name, value = children
        return A.Arg(A.Name(name.value, self.span(name)), value, False, self.span(name, value))

    def keyword_colon(self, children):
        name, value = children
        return A.Arg(A.Name(name.value, self.span(name)), value, True, self.span(name, value))

    def string_keyword(self, children):
        key, value = children
        return A.Arg(A.String(key.value, self.span(key)), value, True, self.span(key, value))

    # ------------------------------------------------------------ atoms
    def name(self, children):
        return A.Name(children[0].value, self.span(children[0]))

    def number(self, children):
        return A.Number(children[0].value, self.span(children[0]))

    def string(self, children):
        return A.String(children[0].value, self.span(children[0]))

    def true(self, children):
        return A.Bool(True, self.span(children[0]))

    def false(self, children):
        return A.Bool(False, self.span(children[0]))

    def none(self, children):
        return A.NoneLit(self.span(children[0]))

    def ellipsis(self, children):
        return A.Ellipsis_(self.span(children[0]))

    def placeholder(self, children):
        return A.Placeholder(children[0].value, self.span(children[0]))

    def star(self, children):
        return A.Star(None, self.span(children[0]))

    def star_name(self, children):
        star, name = children
        return A.Star(name.value, self.span(star, name))

    def empty_tuple(self, children):
        return A.TupleExpr((), self.spanned(children))

    def paren(self, children):
        lpar, element, rpar = children
        plain = element.name is None and not element.annotations
        return element.value if plain else A.TupleExpr((element,), self.span(lpar, rpar))

    def tuple_one(self, children):
        lpar, element, rpar = children
        return A.TupleExpr((element,), self.span(lpar, rpar))

    def tuple(self, children):
        elements = _of(children, A.Element)
        return A.TupleExpr(elements, self.span(children[0], children[-1]))

    def list(self, children):
        items = tuple(c for c in children[1:-1] if c is not None)
        return A.ListExpr(items, self.span(children[0], children[-1]))

    def element(self, children):
        value, annotations = children[0], tuple(children[1:])
        return A.Element(None, value, annotations, self.span(value, (annotations or [value])[-1]))

    def named_element(self, children):
        name, value, annotations = children[0], children[1], tuple(children[2:])
        return A.Element(name.value, value, annotations,
                         self.span(name, (annotations or [value])[-1]))
