"""How weight-mapping diagnostics name things: the smallest span of an entry, values and
plans shown as the user wrote them, lists of names in prose."""

from __future__ import annotations

from modulec.check.instance import Instance
from modulec.source import Span
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show


def describe_plan(plan: dict) -> str:
    if plan["kind"] == "direct":
        return f'"{plan["hf"][0]}"'
    return f"{plan['kind']}({', '.join(repr(h) for h in plan['hf'])})"


def listed(items, last: str = "and") -> str:
    quoted = [f"`{i}`" for i in items]
    if len(quoted) <= 1:
        return "".join(quoted) or "nothing"
    return ", ".join(quoted[:-1]) + f" {last} " + quoted[-1]


def show_value(node) -> str:
    try:
        return show(node)
    except Exception:  # noqa: BLE001 - a value the printer does not know (NamedValue)
        return type(node).__name__


def head_span(item) -> Span:
    """The smallest span that names an item: a section's or entry's key, else the item."""
    key = getattr(item, "key", None)
    if key is not None and hasattr(key, "span"):
        return key.span
    if isinstance(item, A.Flow):
        return item.source.span
    return item.span


def value_head(node) -> Span:
    """A call's function name, else the node."""
    if isinstance(node, A.Call):
        return node.func.span
    return node.span


def values_note(instance: Instance, condition) -> str:
    names = sorted({n.id for n in names_in(condition) if n.id in instance.values})
    shown = ", ".join(f"{n} = {short_value(instance.values[n])}" for n in names)
    return f"in `{instance.name}`, with {shown}" if shown else \
        f"in `{instance.name}`, the guard is false"


def names_in(node) -> list:
    if isinstance(node, A.Name):
        return [node]
    found = []
    for name in getattr(node, "__dataclass_fields__", {}):
        child = getattr(node, name)
        for c in child if isinstance(child, tuple) else (child,):
            if hasattr(c, "__dataclass_fields__"):
                found += names_in(c)
            elif isinstance(c, tuple):
                for inner in c:
                    if hasattr(inner, "__dataclass_fields__"):
                        found += names_in(inner)
    return found


def short_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "None"
    return str(value)
