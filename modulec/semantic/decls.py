"""Typed views of declarations: what the generic section items of the syntax tree mean.

`module_def(decl)` reads a declaration's sections into a `ModuleDef`: its parameters, let
bindings, tensor parameters, and the forward and backward phases with their signatures
(every spelling the spec uses: `in: [B, T]`, `in: x: [*]`, `in: (a: T, b: T)`,
`in: (d_y, x)`, `inputs:` blocks, backward `d_out: T` entries, `out: d_x = expr`).
Nothing is evaluated here; shapes stay expressions until an instance binds its sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.source import Span
from modulec.syntax import ast as A


@dataclass(frozen=True)
class TensorSig:
    """One input or output of a phase."""

    name: str
    type: A.Expr | None
    span: Span
    optional: bool = False
    annotations: tuple[A.Annotation, ...] = ()
    formula: A.Expr | None = None  # `out: d_x = expr` (primitive backward shorthand)


@dataclass(frozen=True)
class TensorParam:
    """`name: type [if cond] @annotations` in `params:`; `extend` for `+name` (§4.3)."""

    name: str
    type: A.Expr
    span: Span
    condition: A.Expr | None = None
    annotations: tuple[A.Annotation, ...] = ()
    extend: bool = False


@dataclass(frozen=True)
class Phase:
    """A forward or backward section."""

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    graph: A.Section | None
    save: A.Entry | None
    recompute: A.Entry | None
    formulas: tuple[A.Binding, ...]
    span: Span
    declared_io: bool  # whether `in:`/`out:`/`inputs:`/`outputs:` (or d_ entries) appear


@dataclass(frozen=True)
class ModuleDef:
    decl: A.Decl
    lets: tuple = ()
    constraints: tuple[A.Constraint, ...] = ()
    params: tuple[TensorParam, ...] = ()
    forward: Phase | None = None
    backward: Phase | None = None
    save: A.Entry | None = None  # primitive-level `save:`
    sections: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def kind(self) -> str:
        return self.decl.kind


def module_def(decl: A.Decl) -> ModuleDef:
    sections = {}
    for item in decl.body:
        key = _section_name(item)
        if key is not None:
            sections.setdefault(key, item)
    lets, constraints = _lets(sections.get("let"), sections.get("constants"))
    return ModuleDef(decl, lets, constraints, _params(sections.get("params")),
                     _phase(sections.get("forward"), backward=False),
                     _phase(sections.get("backward"), backward=True),
                     sections.get("save") if isinstance(sections.get("save"), A.Entry) else None,
                     sections)


# ====================================================================== sections
def _section_name(item) -> str | None:
    if isinstance(item, (A.Section, A.Entry)) and isinstance(item.key, A.Name):
        return item.key.id
    if isinstance(item, A.ImplBlock):
        return "impl"
    return None


def _lets(*sections) -> tuple[tuple, tuple]:
    bindings, constraints = [], []
    for section in sections:
        if not isinstance(section, A.Section):
            continue
        for item in section.body:
            if isinstance(item, A.Binding):
                bindings.append(item)
            elif isinstance(item, A.Section) and item.name == "constraint":
                constraints += [c for c in item.body if isinstance(c, A.Constraint)]
    return tuple(bindings), tuple(constraints)


def _params(section) -> tuple[TensorParam, ...]:
    if not isinstance(section, A.Section):
        return ()
    return tuple(_param(item) for item in section.body if isinstance(item, A.Entry))


def _param(entry: A.Entry) -> TensorParam:
    key, extend = entry.key, False
    if isinstance(key, A.Unary) and key.op == "+":
        key, extend = key.operand, True
    name = key.id if isinstance(key, A.Name) else _text(key)
    type_, condition = entry.value, None
    if isinstance(type_, A.IfExp) and type_.orelse is None:
        type_, condition = type_.body, type_.test
    return TensorParam(name, type_, entry.span, condition, entry.annotations, extend)


def _phase(section, backward: bool) -> Phase | None:
    if not isinstance(section, A.Section):
        return None
    inputs, outputs, formulas = [], [], []
    graph = save = recompute = None
    declared = False
    for item in section.body:
        name = _section_name(item)
        if name in ("in", "inputs"):
            inputs += _signature(item)
            declared = True
        elif name in ("out", "outputs"):
            outputs += _signature(item)
            declared = True
        elif name == "graph" and isinstance(item, A.Section):
            graph = item
        elif name == "save" and isinstance(item, A.Entry):
            save = item
        elif name == "recompute" and isinstance(item, A.Entry):
            recompute = item
        elif backward and name and name.startswith("d_") and isinstance(item, A.Entry):
            declared = True
            _gradient_entry(item, inputs, outputs)
        elif isinstance(item, A.Binding):
            formulas.append(item)
    return Phase(tuple(inputs), tuple(outputs), graph, save, recompute, tuple(formulas),
                 section.span, declared)


def _gradient_entry(entry: A.Entry, inputs: list, outputs: list) -> None:
    """Backward `d_<name>: T` entries: the first run are gradient inputs (one per forward
    output), the rest gradient outputs; which is which is settled against the forward
    signature by the checker, so all are collected as inputs here and split later."""
    inputs.append(_sig(entry.key, entry.value, entry.span, entry.annotations))


# ====================================================================== signatures
def _signature(item) -> list[TensorSig]:
    if isinstance(item, A.Section):  # inputs:/outputs: block of entries
        return [_sig(e.key, e.value, e.span, e.annotations) for e in item.body
                if isinstance(e, A.Entry)]
    value, default = item.value, item.default
    default_name = item.key.id
    if isinstance(value, A.NamedValue):
        return [_sig(A.Name(value.name, value.span), value.value, item.span, item.annotations,
                     default)]
    if isinstance(value, A.TupleExpr):
        formulas = _tuple_formulas(default, len(value.items))
        return [_element_sig(element, formula) for element, formula in zip(value.items, formulas)]
    if isinstance(value, (A.Name, A.OptionalType)) and _is_plain_name(value) and \
            default_name in ("in", "out") and _looks_like_tensor_name(value):
        return [_sig(value, None, item.span, item.annotations, default)]
    return [_sig(A.Name(default_name, item.key.span), value, item.span, item.annotations,
                 default)]


def _element_sig(element: A.Element, formula) -> TensorSig:
    if element.name is not None:
        return _sig(A.Name(element.name, element.span), element.value, element.span,
                    element.annotations, formula)
    return _sig(element.value, None, element.span, element.annotations, formula)


def _sig(name_expr, type_expr, span, annotations=(), formula=None) -> TensorSig:
    optional = False
    if isinstance(name_expr, A.OptionalType):
        name_expr, optional = name_expr.value, True
    if isinstance(type_expr, A.OptionalType):
        type_expr, optional = type_expr.value, True
    name = name_expr.id if isinstance(name_expr, A.Name) else _text(name_expr)
    return TensorSig(name, type_expr, span, optional, tuple(annotations), formula)


def _tuple_formulas(default, count: int) -> list:
    if isinstance(default, A.TupleExpr) and len(default.items) == count:
        return [item.value for item in default.items]
    return [default if count == 1 else None] * count


def _is_plain_name(value) -> bool:
    inner = value.value if isinstance(value, A.OptionalType) else value
    return isinstance(inner, A.Name)


def _looks_like_tensor_name(value) -> bool:
    """`in: d_out` names a tensor; `out: scalar` or `out: reduced` is a (named) type."""
    inner = value.value if isinstance(value, A.OptionalType) else value
    return inner.id.startswith("d_") or inner.id in ("x", "y", "out", "in")


def _text(node) -> str:
    from modulec.syntax.printer import expr

    return expr(node)
