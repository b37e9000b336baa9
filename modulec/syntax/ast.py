"""The syntax tree: immutable values with source spans.

Spans never take part in equality, so `parse(print(tree)) == tree` compares meaning, not
layout. Section bodies are generic items (`Entry`, `Section`, `Flow`, ...): which items a
section may hold is the business of `modulec.syntax.sections`, not of the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from modulec.source import Span

NO_SPAN = Span("<none>", 0, 0, 1, 1, 1, 1)


def _span() -> Span:
    return field(default=NO_SPAN, compare=False, repr=False)


# ====================================================================== expressions
@dataclass(frozen=True, slots=True)
class Name:
    id: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Number:
    text: str  # as written (`1e-6`, `32_000`); `value` gives the number
    span: Span = _span()

    @property
    def value(self) -> int | float:
        text = self.text.replace("_", "")
        is_float = any(ch in text for ch in ".eE")
        return float(text) if is_float else int(text)


@dataclass(frozen=True, slots=True)
class String:
    text: str  # as written, quotes included; `value` gives the contents
    span: Span = _span()

    @property
    def value(self) -> str:
        body = self.text[1:-1]
        return body.encode("latin-1", "backslashreplace").decode("unicode_escape") \
            if "\\" in body else body


@dataclass(frozen=True, slots=True)
class Bool:
    value: bool
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class NoneLit:
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Ellipsis_:
    """`...`: a subscript meaning "the remaining dimensions"; elsewhere a placeholder."""

    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Placeholder:
    """`{i}` in a weight-mapping key: the layer index."""

    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Star:
    """`*` (variadic dims) or `*suffix` (a wildcard in a tensor list)."""

    suffix: str | None = None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Attribute:
    value: "Expr"
    attr: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Arg:
    """A call argument: positional (`key is None`), `key=value`, or `key: value`."""

    key: "Name | String | None"
    value: "Expr"
    colon: bool = False
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Call:
    func: "Expr"
    args: tuple[Arg, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Slice:
    lower: "Expr | None"
    upper: "Expr | None"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Index:
    value: "Expr"
    subscripts: tuple["Expr | Slice", ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Unary:
    op: str  # "-", "+", "not"
    operand: "Expr"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # "+", "-", "*", "/", "//", "%", "**", "and", "or"
    left: "Expr"
    right: "Expr"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Compare:
    first: "Expr"
    rest: tuple[tuple[str, "Expr"], ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class IfExp:
    """`a if cond else b`; without `else` (a conditional parameter) `orelse` is None."""

    body: "Expr"
    test: "Expr"
    orelse: "Expr | None"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ListExpr:
    items: tuple["Expr", ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Annotation:
    """`@name` or `@name(args)`; `args is None` when written without parentheses."""

    name: str
    args: tuple[Arg, ...] | None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Element:
    """One element of a parenthesized tuple: `x`, `x: [B, T]`, `mask @gradient(skip)`."""

    name: str | None
    value: "Expr | None"
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class TupleExpr:
    items: tuple[Element, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class OptionalType:
    """`T?`: may be None."""

    value: "Expr"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ArrayType:
    """`[n] x T`, `[n] × T` or `Array<n, T>`."""

    count: "Expr"
    element: "Expr"
    span: Span = _span()


Expr = Union[Name, Number, String, Bool, NoneLit, Ellipsis_, Placeholder, Star, Attribute,
             Call, Index, Unary, Binary, Compare, IfExp, ListExpr, TupleExpr, OptionalType,
             ArrayType]


# ====================================================================== items
@dataclass(frozen=True, slots=True)
class NamedValue:
    """`out: C: [M, N]`: the value of an entry that names its tensor."""

    name: str
    value: Expr
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Entry:
    """`key: value [= default] @annotations`."""

    key: Expr
    value: "Expr | NamedValue"
    default: Expr | None = None
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Section:
    """`key:` followed by an indented block (possibly empty); `key: value` + block when
    the section has a value (`pattern: sequential_residual`)."""

    key: Expr
    body: tuple["Item", ...]
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()
    value: Expr | None = None

    @property
    def name(self) -> str | None:
        return self.key.id if isinstance(self.key, Name) else None


@dataclass(frozen=True, slots=True)
class Binding:
    """`name = expr` (let bindings, backward shorthand `d_A = matmul(...)`)."""

    target: Expr
    value: Expr
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Step:
    """One element of a flow, with the annotations written after it."""

    expr: Expr
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Flow:
    """`source -> op(...) -> ... -> destination`; a lone expression has one step."""

    steps: tuple[Step, ...]
    span: Span = _span()

    @property
    def source(self) -> Step:
        return self.steps[0]

    @property
    def destination(self) -> Step:
        return self.steps[-1]

    @property
    def operations(self) -> tuple[Step, ...]:
        return self.steps[1:-1]


@dataclass(frozen=True, slots=True)
class Constraint:
    """`condition, "message"` inside `constraint:`."""

    condition: Expr
    message: String
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class IfBlock:
    test: Expr
    body: tuple["Item", ...]
    orelse: tuple["Item", ...] | None = None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ImplEntry:
    name: str
    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ImplBlock:
    """`impl: kernels.x` or an `impl:` block of `forward:` / `backward:` kernel references."""

    text: str | None
    entries: tuple[ImplEntry, ...] = ()
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ListItem:
    """`- item` (fusion patterns, invariants, sublayers, constraints)."""

    item: "Item"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Prose:
    """`- x must be contiguous`: a list item in words, kept as documentation."""

    words: tuple[str, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Docstring:
    text: str  # as written, triple quotes included
    span: Span = _span()

    @property
    def value(self) -> str:
        return self.text[3:-3]


@dataclass(frozen=True, slots=True)
class AnnotationLine:
    """Annotations on a line of their own (`@recipe(FP8)` in a model body)."""

    annotations: tuple[Annotation, ...]
    span: Span = _span()


Item = Union[Entry, Section, Binding, Flow, Step, Constraint, IfBlock, ImplBlock, ListItem, Prose,
             Docstring, AnnotationLine]


# ====================================================================== declarations
@dataclass(frozen=True, slots=True)
class ImportItem:
    name: str
    alias: str | None = None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Import:
    """`import a.b.C [as X]` or `import a.b.{C, D as E}`."""

    path: tuple[str, ...]
    alias: str | None = None
    names: tuple[ImportItem, ...] | None = None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class FromImport:
    """`from a.b import C, D as E`."""

    path: tuple[str, ...]
    names: tuple[ImportItem, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class DeclParam:
    name: str
    type: Expr | None = None
    default: Expr | None = None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Decl:
    """`module`, `abstract module`, `block`, `model`, `primitive` or `recipe`."""

    kind: str
    name: str
    params: tuple[DeclParam, ...] | None
    body: tuple[Item, ...]
    abstract: bool = False
    extends: Expr | None = None
    annotations: tuple[Annotation, ...] = ()
    span: Span = _span()
    name_span: Span = _span()

    @property
    def docstring(self) -> Docstring | None:
        first = self.body[0] if self.body else None
        return first if isinstance(first, Docstring) else None

    def sections(self, name: str) -> list[Section]:
        return [item for item in self.body if isinstance(item, Section) and item.name == name]


TopItem = Union[Import, FromImport, Decl, Docstring]


@dataclass(frozen=True, slots=True)
class Program:
    items: tuple[TopItem, ...]
    file: str = field(default="<input>", compare=False)

    @property
    def decls(self) -> list[Decl]:
        return [item for item in self.items if isinstance(item, Decl)]


def qualified_name(node) -> str | None:
    """`F.Proj` or `std.modules.linear.Linear` as a dotted string; `Proj` as itself; None
    for anything that is not a (dotted) name."""
    if isinstance(node, Name):
        return node.id
    if isinstance(node, Attribute):
        prefix = qualified_name(node.value)
        return None if prefix is None else f"{prefix}.{node.attr}"
    return None
