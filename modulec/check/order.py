"""Statement order: a graph's statements run in dependency order (§5.11.5).

Each statement defines some names (its destinations) and uses others (names in its
source and arguments). Statements are ordered topologically, keeping the written order
where dependencies allow; a dependency cycle is reported once, with the statements that
form it, and those statements are then checked in written order.
"""

from __future__ import annotations

import heapq

from modulec.diagnostics import Label
from modulec.syntax import ast as A


def defined_names(statement) -> set[str]:
    if isinstance(statement, A.Flow):
        return _destination_names(statement.destination.expr)
    if isinstance(statement, A.IfBlock):
        return _all(defined_names, statement.body + (statement.orelse or ()))
    if isinstance(statement, A.Section):
        return _all(defined_names, statement.body)
    return set()


def used_names(statement) -> set[str]:
    if isinstance(statement, A.Flow):
        names: set[str] = set()
        for step in statement.steps[:-1]:
            names |= _names(step.expr)
        return names
    if isinstance(statement, A.IfBlock):
        return _names(statement.test) | _all(used_names, statement.body + (statement.orelse or ()))
    if isinstance(statement, A.Section):
        return _all(used_names, statement.body)
    return set()


def order_statements(statements: list, world, cycle_code: str) -> tuple[list, set[str]]:
    """(statements in dependency order, names defined by statements caught in a cycle)."""
    definers: dict[str, list[int]] = {}
    for index, statement in enumerate(statements):
        for name in defined_names(statement):
            definers.setdefault(name, []).append(index)
    needs = [{d for name in used_names(s) for d in definers.get(name, []) if d != i}
             for i, s in enumerate(statements)]
    # Kahn's algorithm, the lowest ready index first (a heap: the written order where
    # dependencies allow, in n log n; scanning every statement for the next was quadratic)
    waiting = [len(n) for n in needs]
    needed_by: dict[int, list[int]] = {}
    for i, need in enumerate(needs):
        for d in need:
            needed_by.setdefault(d, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order, placed, cyclic = [], set(), set()
    while len(order) < len(statements):
        if not ready:
            stuck = _report_cycle(statements, needs, placed, world, cycle_code)
            order += stuck
            placed |= set(stuck)
            cyclic |= {name for i in stuck for name in defined_names(statements[i])}
            continue
        i = heapq.heappop(ready)
        order.append(i)
        placed.add(i)
        for later in needed_by.get(i, ()):
            waiting[later] -= 1
            if waiting[later] == 0:
                heapq.heappush(ready, later)
    return [statements[i] for i in order], cyclic


def _report_cycle(statements, needs, placed, world, code: str) -> list[int]:
    remaining = [i for i in range(len(statements)) if i not in placed]
    cycle = _find_cycle(remaining, needs)
    first = statements[cycle[0]]
    names = " -> ".join(min(defined_names(statements[i]) or {"?"}) for i in cycle + cycle[:1])
    what = {"E019": "gradient", "E022": "recompute"}.get(code, "data")
    world.error(code, f"circular {what} dependency: {names}", first.span,
                "this statement depends on its own result",
                secondary=[Label(statements[i].span, "part of the cycle") for i in cycle[1:]],
                notes=["a graph is acyclic: every tensor must be computable from inputs, "
                       "parameters and tensors defined before it"])
    return remaining


def _find_cycle(remaining: list[int], needs) -> list[int]:
    start = remaining[0]
    path, seen = [start], {start}
    current = start
    while True:
        following = next((n for n in sorted(needs[current]) if n in remaining), None)
        if following is None:
            return path
        if following in seen:
            return path[path.index(following):]
        path.append(following)
        seen.add(following)
        current = following


def _destination_names(expr) -> set[str]:
    if isinstance(expr, A.Name):
        return {expr.id} - {"_"}
    if isinstance(expr, A.TupleExpr):
        return {e.value.id for e in expr.items if isinstance(e.value, A.Name)} - {"_"}
    return set()


def _names(node) -> set[str]:
    if isinstance(node, A.Name):
        return {node.id}
    found: set[str] = set()
    if isinstance(node, A.Attribute):
        return _names(node.value) if not _is_saved(node) else set()
    for child in _children(node):
        found |= _names(child)
    return found


def _is_saved(node: A.Attribute) -> bool:
    return isinstance(node.value, A.Name) and node.value.id == "saved"


def _children(node):
    if isinstance(node, A.Call):
        return [node.func] + [a.value for a in node.args]
    if isinstance(node, A.TupleExpr):
        return [e.value for e in node.items if e.value is not None]
    if isinstance(node, A.ListExpr):
        return list(node.items)
    if isinstance(node, A.Index):
        return [node.value] + [s for s in node.subscripts if not isinstance(s, A.Slice)]
    if isinstance(node, (A.Binary,)):
        return [node.left, node.right]
    if isinstance(node, A.Unary):
        return [node.operand]
    return []


def _all(function, items) -> set[str]:
    found: set[str] = set()
    for item in items:
        found |= function(item)
    return found
