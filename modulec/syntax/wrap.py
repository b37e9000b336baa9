"""Line wrapping for `modulec fmt`: lines over WIDTH columns break where the language
allows a line to continue (inside brackets, before `->`, before `@`), always so that the
text parses to the same tree."""

from __future__ import annotations

from modulec.syntax import ast as A
from modulec.syntax import printer as P

WIDTH = 100


def decl_header(decl: A.Decl) -> list[str]:
    """`module M(` + one parameter per line + `):` when the header is too long."""
    line = P.decl_header(decl)
    if len(line) <= WIDTH or not decl.params:
        return [line]
    head = ("abstract " if decl.abstract else "") + f"{decl.kind} {decl.name}("
    params = [P.INDENT + P.decl_param(p) + ("," if i < len(decl.params) - 1 else "")
              for i, p in enumerate(decl.params)]
    tail = ")" + (" extends " + P.expr(decl.extends) if decl.extends is not None else "")
    return [head] + params + [tail + ":" + P.annotations_suffix(decl.annotations)]


def item(node, depth: int, printed: list[str]) -> list[str]:
    """The printed lines of an item, wrapped when its one line is too long."""
    if len(printed) != 1 or len(printed[0]) <= WIDTH:
        return printed
    indent = P.INDENT * depth
    if isinstance(node, A.Flow):
        return _flow(node, indent)
    if isinstance(node, A.Entry) and _call_of(node.value) is not None \
            and node.default is None and not node.annotations:
        return _call_entry(node, indent)
    if isinstance(node, A.Entry) and isinstance(node.value, A.ListExpr) and \
            len(node.value.items) > 1 and node.default is None and not node.annotations:
        return _list_entry(node, indent)
    if isinstance(node, A.Entry) and isinstance(node.value, A.TupleExpr) and \
            len(node.value.items) > 1 and node.default is None and not node.annotations:
        return _tuple_entry(node, indent)
    return printed


def _flow(flow: A.Flow, indent: str) -> list[str]:
    steps = list(flow.steps)
    last = steps[-1]
    body = " -> ".join(P.expr(s.expr) + P.annotations_suffix(s.annotations) for s in steps[:-1])
    line = indent + body + " -> " + P.expr(last.expr)
    notes = [indent + P.INDENT + P.annotation(a) for a in last.annotations]
    if len(line) <= WIDTH:
        return [line] + notes
    cont = indent + P.INDENT
    lines = _step(indent, steps[0], P.annotations_suffix(steps[0].annotations), cont)
    for step in steps[1:-1]:
        lines += _step(cont + "-> ", step, P.annotations_suffix(step.annotations), cont)
    return lines + _step(cont + "-> ", last, "", cont) + notes


def _step(prefix: str, step: A.Step, suffix: str, indent: str) -> list[str]:
    """One step of a wrapped flow: a call still over WIDTH gets its arguments packed into
    lines of their own, `op(` ... `)`, the closing parenthesis at `indent`."""
    line = prefix + P.expr(step.expr) + suffix
    call = step.expr
    if len(line) <= WIDTH or not isinstance(call, A.Call) or not call.args:
        return [line]
    lines = _packed([P.arg_text(a) for a in call.args], indent + P.INDENT)
    return [prefix + P.expr(call.func, P.ATOM) + "("] + lines + [indent + ")" + suffix]


def _packed(texts: list[str], inner: str) -> list[str]:
    """`texts`, comma-separated, packed into lines of at most WIDTH columns at `inner`."""
    lines, current = [], ""
    for index, text in enumerate(texts):
        piece = text + ("," if index < len(texts) - 1 else "")
        if current and len(inner + current + " " + piece) > WIDTH:
            lines.append(inner + current)
            current = piece
        else:
            current = f"{current} {piece}" if current else piece
    return lines + [inner + current]


def _call_of(value) -> A.Call | None:
    """The call an entry's value ends in: `Block(...)`, `[n] x Block(...)`, either guarded
    (`... if cond`, no else)."""
    if isinstance(value, A.IfExp) and value.orelse is None:
        value = value.body
    if isinstance(value, A.ArrayType):
        value = value.element
    return value if isinstance(value, A.Call) and value.args else None


def _call_entry(entry: A.Entry, indent: str) -> list[str]:
    call, value, guard = _call_of(entry.value), entry.value, ""
    if isinstance(value, A.IfExp):
        value, guard = value.body, " if " + P.expr(value.test)
    prefix = f"[{P.expr(value.count)}] x " if isinstance(value, A.ArrayType) else ""
    head = indent + P.expr(entry.key) + ": " + prefix + P.expr(call.func, P.ATOM) + "("
    args = [indent + P.INDENT + P.arg_text(a) + ("," if i < len(call.args) - 1 else "")
            for i, a in enumerate(call.args)]
    return [head] + args + [indent + ")" + guard]


def _tuple_entry(entry: A.Entry, indent: str) -> list[str]:
    """`in: (` + one element per line + `)`, the layout the specification uses."""
    items = entry.value.items
    elements = [indent + P.INDENT + P.element(e) + ("," if i < len(items) - 1 else "")
                for i, e in enumerate(items)]
    return [indent + P.expr(entry.key) + ": ("] + elements + [indent + ")"]


def _list_entry(entry: A.Entry, indent: str) -> list[str]:
    """`save: [` + the items packed into lines of at most WIDTH columns + `]`."""
    lines = _packed([P.expr(item) for item in entry.value.items], indent + P.INDENT)
    return [indent + P.expr(entry.key) + ": ["] + lines + [indent + "]"]
