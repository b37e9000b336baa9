"""The canonical printer: syntax tree -> text, such that `parse(print(tree)) == tree`.

Layout is canonical (two-space indentation, one item per line, ` -> ` between flow steps,
minimal parentheses, ASCII `x` for arrays); docstrings, numbers and strings are printed as
written. Comments are not part of the tree; `modulec fmt` re-attaches them.
"""

from __future__ import annotations

from functools import singledispatch

from modulec.syntax import ast as A
from modulec.syntax.precedence import INFIX, PREFIX

INDENT = "  "
ATOM = 100  # precedence of atoms and postfix expressions


def print_program(program: A.Program) -> str:
    chunks = []
    previous = None
    for item in program.items:
        if previous is not None and _blank_line_between(previous, item):
            chunks.append("")
        chunks.extend(top_lines(item))
        previous = item
    return "\n".join(chunks) + "\n" if chunks else ""


def _blank_line_between(previous, item) -> bool:
    imports = (A.Import, A.FromImport)
    return not (isinstance(previous, imports) and isinstance(item, imports))


# ====================================================================== top level
@singledispatch
def top_lines(item) -> list[str]:
    raise TypeError(f"cannot print {type(item).__name__} at top level")


@top_lines.register
def _(item: A.Import) -> list[str]:
    path = ".".join(item.path)
    if item.names is not None:
        path += ".{" + ", ".join(map(import_item, item.names)) + "}"
    alias = f" as {item.alias}" if item.alias else ""
    return [f"import {path}{alias}"]


@top_lines.register
def _(item: A.FromImport) -> list[str]:
    names = ", ".join(map(import_item, item.names))
    return [f"from {'.'.join(item.path)} import {names}"]


@top_lines.register
def _(item: A.Docstring) -> list[str]:
    return [item.text]


@top_lines.register
def _(decl: A.Decl) -> list[str]:
    return [decl_header(decl)] + body_lines(decl.body, 1)


def import_item(item: A.ImportItem) -> str:
    return item.name + (f" as {item.alias}" if item.alias else "")


def decl_header(decl: A.Decl) -> str:
    head = ("abstract " if decl.abstract else "") + f"{decl.kind} {decl.name}"
    if decl.params is not None:
        head += "(" + ", ".join(map(decl_param, decl.params)) + ")"
    if decl.extends is not None:
        head += " extends " + expr(decl.extends)
    return head + ":" + annotations_suffix(decl.annotations)


def decl_param(param: A.DeclParam) -> str:
    text = param.name
    if param.type is not None:
        text += ": " + expr(param.type)
    if param.default is not None:
        text += " = " + expr(param.default)
    return text


# ====================================================================== items
def body_lines(items, depth: int) -> list[str]:
    lines = []
    for item in items:
        lines.extend(item_lines(item, depth))
    return lines


def item_lines(item, depth: int) -> list[str]:
    pad = INDENT * depth
    if isinstance(item, A.Section):
        value = " " + value_text(item.value) if item.value is not None else ""
        return [pad + expr(item.key) + ":" + value + annotations_suffix(item.annotations)] + \
            body_lines(item.body, depth + 1)
    if isinstance(item, A.IfBlock):
        return if_lines(item, depth)
    if isinstance(item, A.ImplBlock):
        return impl_lines(item, depth)
    if isinstance(item, A.ListItem):
        return [pad + "- " + item_text(item.item)]
    return [pad + item_text(item)]


def if_lines(block: A.IfBlock, depth: int) -> list[str]:
    pad = INDENT * depth
    lines = [pad + "if " + expr(block.test) + ":"] + body_lines(block.body, depth + 1)
    if block.orelse is not None:
        lines += [pad + "else:"] + body_lines(block.orelse, depth + 1)
    return lines


def impl_lines(block: A.ImplBlock, depth: int) -> list[str]:
    pad = INDENT * depth
    if block.text is not None:
        return [pad + "impl: " + block.text]
    return [pad + "impl:"] + [pad + INDENT + f"{e.name}: {e.text}" for e in block.entries]


@singledispatch
def item_text(item) -> str:
    raise TypeError(f"cannot print {type(item).__name__} as an item")


@item_text.register
def _(item: A.Entry) -> str:
    text = expr(item.key) + ": " + value_text(item.value)
    if item.default is not None:
        text += " = " + expr(item.default)
    return text + annotations_suffix(item.annotations)


@item_text.register
def _(item: A.Binding) -> str:
    return expr(item.target) + " = " + expr(item.value) + annotations_suffix(item.annotations)


@item_text.register
def _(item: A.Flow) -> str:
    return " -> ".join(map(step_text, item.steps))


@item_text.register
def _(item: A.Step) -> str:
    return step_text(item)


@item_text.register
def _(item: A.Constraint) -> str:
    return expr(item.condition) + ", " + item.message.text


@item_text.register
def _(item: A.Prose) -> str:
    return "- " + " ".join(item.words)


@item_text.register
def _(item: A.Docstring) -> str:
    return item.text


@item_text.register
def _(item: A.AnnotationLine) -> str:
    return " ".join(map(annotation, item.annotations))


def value_text(value) -> str:
    if isinstance(value, A.NamedValue):
        return f"{value.name}: {expr(value.value)}"
    return expr(value)


def step_text(step: A.Step) -> str:
    return expr(step.expr) + annotations_suffix(step.annotations)


def annotations_suffix(annotations) -> str:
    return "".join(" " + annotation(a) for a in annotations)


def annotation(note: A.Annotation) -> str:
    if note.args is None:
        return "@" + note.name
    return "@" + note.name + "(" + args_text(note.args) + ")"


def args_text(args) -> str:
    return ", ".join(map(arg_text, args))


def arg_text(arg: A.Arg) -> str:
    if arg.key is None:
        return expr(arg.value)
    return expr(arg.key) + (": " if arg.colon else "=") + expr(arg.value)


# ====================================================================== expressions
def expr(node, minimum: int = 0) -> str:
    """Print `node`, parenthesized when its precedence is below `minimum`."""
    text = _expr_text(node)
    return f"({text})" if precedence(node) < minimum else text


def precedence(node) -> int:
    if isinstance(node, A.Binary):
        return INFIX[node.op][0]
    if isinstance(node, A.Compare):
        return INFIX["=="][0]
    if isinstance(node, A.Unary):
        return PREFIX[node.op]
    if isinstance(node, A.ArrayType):
        return INFIX["x"][0]
    if isinstance(node, A.IfExp):
        return 0
    return ATOM


@singledispatch
def _expr_text(node) -> str:
    raise TypeError(f"cannot print {type(node).__name__} as an expression")


@_expr_text.register
def _(node: A.Name) -> str:
    return node.id


@_expr_text.register
def _(node: A.Number) -> str:
    return node.text


@_expr_text.register
def _(node: A.String) -> str:
    return node.text


@_expr_text.register
def _(node: A.Bool) -> str:
    return "true" if node.value else "false"


@_expr_text.register
def _(node: A.NoneLit) -> str:
    return "None"


@_expr_text.register
def _(node: A.Ellipsis_) -> str:
    return "..."


@_expr_text.register
def _(node: A.Placeholder) -> str:
    return "{" + node.name + "}"


@_expr_text.register
def _(node: A.Star) -> str:
    return "*" + (node.suffix or "")


@_expr_text.register
def _(node: A.Attribute) -> str:
    return expr(node.value, ATOM) + "." + node.attr


@_expr_text.register
def _(node: A.Call) -> str:
    return expr(node.func, ATOM) + "(" + args_text(node.args) + ")"


@_expr_text.register
def _(node: A.Index) -> str:
    return expr(node.value, ATOM) + "[" + ", ".join(map(subscript, node.subscripts)) + "]"


@_expr_text.register
def _(node: A.OptionalType) -> str:
    return expr(node.value, ATOM) + "?"


@_expr_text.register
def _(node: A.Unary) -> str:
    operand = expr(node.operand, PREFIX[node.op])
    return ("not " if node.op == "not" else node.op) + operand


@_expr_text.register
def _(node: A.Binary) -> str:
    left_power, right_power = INFIX[node.op]
    left_minimum = left_power + 1 if right_power < left_power else left_power
    return f"{expr(node.left, left_minimum)} {node.op} {expr(node.right, right_power)}"


@_expr_text.register
def _(node: A.Compare) -> str:
    tighter = INFIX["=="][1]
    parts = [expr(node.first, tighter)]
    parts += [f"{op} {expr(operand, tighter)}" for op, operand in node.rest]
    return " ".join(parts)


@_expr_text.register
def _(node: A.IfExp) -> str:
    text = f"{expr(node.body, 1)} if {expr(node.test, 1)}"
    return text if node.orelse is None else text + f" else {expr(node.orelse)}"


@_expr_text.register
def _(node: A.ArrayType) -> str:
    left_power, right_power = INFIX["x"]
    return f"[{expr(node.count)}] x {expr(node.element, right_power)}"


@_expr_text.register
def _(node: A.ListExpr) -> str:
    return "[" + ", ".join(expr(item) for item in node.items) + "]"


@_expr_text.register
def _(node: A.TupleExpr) -> str:
    items = [element(item) for item in node.items]
    plain_single = len(items) == 1 and node.items[0].name is None and not node.items[0].annotations
    return "(" + ", ".join(items) + ("," if plain_single else "") + ")"


def element(item: A.Element) -> str:
    text = expr(item.value)
    if item.name is not None:
        text = f"{item.name}: {text}"
    return text + annotations_suffix(item.annotations)


def subscript(node) -> str:
    if isinstance(node, A.Slice):
        lower = expr(node.lower) if node.lower is not None else ""
        upper = expr(node.upper) if node.upper is not None else ""
        return f"{lower}:{upper}"
    return expr(node)
