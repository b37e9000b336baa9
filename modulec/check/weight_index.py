"""Index expressions in checkpoint names: `"model.layers.{i + first_k_dense}.mlp..."`.

A `{...}` in a checkpoint name of `hf_mapping` is a placeholder the key binds (`{i}`), or
an integer expression of placeholders, integer literals and the model's integer
parameters and `let` constants, with `+ - * // %` and parentheses (`{i + n_dense}`,
`{i * step + step - 1}`). Parameters are replaced by their values in the weight schema,
so the runtime sees only placeholders and integers (`{i + 3}`); runtime/hf_weights/schema.py
evaluates that form. docs/decisions.md, "Mixed layer stacks".
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

BRACES = re.compile(r"\{([^{}]*)\}")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
MAX_CHECKED = 100_000  # index combinations evaluated to find clashes


class IndexError_(Exception):
    """A `{...}` that is not an index expression; the message says why."""


@dataclass(frozen=True)
class IndexExpr:
    text: str          # as written between the braces
    tree: ast.expr
    names: tuple       # free names, in order of appearance

    @property
    def bare(self) -> str | None:
        """The name of a plain placeholder (`{i}`), else None."""
        return self.tree.id if isinstance(self.tree, ast.Name) else None


def index_exprs(string: str) -> list[IndexExpr]:
    """Every `{...}` of a checkpoint name, parsed; raises IndexError_ for one that is not
    an index expression."""
    return [parse_index(m[1]) for m in BRACES.finditer(string)]


def parse_index(text: str) -> IndexExpr:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise IndexError_(f"`{{{text}}}` is not an index expression") from None
    names: list[str] = []
    _check(tree, text, names)
    return IndexExpr(text, tree, tuple(dict.fromkeys(names)))


def _check(node, text: str, names: list) -> None:
    if isinstance(node, ast.Name):
        names.append(node.id)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        pass
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        _check(node.left, text, names)
        _check(node.right, text, names)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check(node.operand, text, names)
    else:
        raise IndexError_(f"`{{{text}}}` is not an index expression: it may use "
                          "placeholders, integers, integer parameters, `+ - * // %` and "
                          "parentheses")


def substitute(expr: IndexExpr, rename: dict[str, str], constants: dict[str, int]) -> str:
    """The expression's text for the weight schema: placeholders renamed (canonical
    levels), parameters replaced by their integer values."""
    if expr.bare is not None and expr.bare in rename:
        return "{" + rename[expr.bare] + "}"
    return "{" + _text(expr.tree, rename, constants) + "}"


def _text(node, rename: dict, constants: dict) -> str:
    if isinstance(node, ast.Name):
        if node.id in rename:
            return rename[node.id]
        return str(constants.get(node.id, node.id))
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.UnaryOp):
        return f"-{_operand(node.operand, rename, constants, 3)}"
    rank = _RANK[type(node.op)]
    return (f"{_operand(node.left, rename, constants, rank)} {_OPS[type(node.op)]} "
            f"{_operand(node.right, rename, constants, rank + 1)}")


_RANK = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.FloorDiv: 2, ast.Mod: 2}


def _operand(node, rename: dict, constants: dict, least: int) -> str:
    """An operand, in parentheses when its operator binds less than `least`."""
    text = _text(node, rename, constants)
    weaker = isinstance(node, ast.BinOp) and _RANK[type(node.op)] < least
    return f"({text})" if weaker else text


def evaluate_index(expr: IndexExpr, values: dict[str, int]) -> int:
    return _value(expr.tree, values)


def _value(node, values: dict) -> int:
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand, values)
    left, right = _value(node.left, values), _value(node.right, values)
    op = type(node.op)
    if op in (ast.FloorDiv, ast.Mod) and right == 0:
        raise ZeroDivisionError
    return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
            ast.FloorDiv: left // right if right else 0,
            ast.Mod: left % right if right else 0}[op]


# ====================================================================== checks
def integer_constants(instance) -> dict[str, int]:
    """The instance's integer parameters and `let` constants with a value."""
    from modulec.types.dims import Dim

    return {name: value.value for name, value in instance.values.items()
            if isinstance(value, Dim) and value.is_const}


def canonical_string(text: str, rename: dict[str, str], constants: dict[str, int]) -> str:
    """A checkpoint name as the weight schema holds it (see `substitute`)."""
    def one(match) -> str:
        try:
            return substitute(parse_index(match[1]), rename, constants)
        except IndexError_:
            return match[0]
    return BRACES.sub(one, text)


def free_names(text: str, constants: dict[str, int]) -> set[str]:
    """The names of a checkpoint name's `{...}` that are no parameter (placeholders)."""
    try:
        return {n for e in index_exprs(text) for n in e.names if n not in constants}
    except IndexError_:
        return set()


def check_string(analysis, string, target, extra: frozenset) -> bool:
    """E010 for a `{...}` that is not an index expression, a name in one that is neither a
    placeholder of the key (or the expert index) nor an integer parameter, a placeholder
    of the key the name does not use, and indices that are negative or that two layers
    share. `analysis` is weights._Analysis."""
    try:
        exprs = index_exprs(string.value)
    except IndexError_ as exc:
        analysis.error(str(exc), string.span,
                       help=["write a placeholder of the key (`{i}`) or arithmetic on it "
                             "with integer parameters: `{i + n_dense}`"])
        return False
    constants = integer_constants(analysis.instance)
    placeholders = set(target.bound) | set(extra)
    used = [n for e in exprs for n in e.names]
    for name in used:
        if name in placeholders or name in constants:
            continue
        if name in analysis.instance.values:
            analysis.error(f"`{name}` in `{{...}}` is not an integer", string.span,
                           f"`{name}` is {analysis.instance.values[name]}",
                           help=["an index expression uses placeholders and integer "
                                 "parameters: `{i + n_dense}`"])
        else:
            analysis.error(f"`{{{name}}}` is not a placeholder of the key", string.span,
                           "the key does not bind it",
                           help=analysis._placeholder_help(target))
        return False
    for name in list(target.bound) + sorted(extra):
        if name not in used:
            what = "every expert" if name in extra else "every layer"
            analysis.error(f"the checkpoint name does not use `{{{name}}}`", string.span,
                           f"{what} would load this same tensor",
                           help=[f"write `{{{name}}}` where the checkpoint name has the index"])
            return False
    if any(e.bare is None for e in exprs):
        return _check_indices(analysis, string, exprs, target, constants)
    return True


def _check_indices(analysis, string, exprs, target, constants) -> bool:
    """Over every layer (when the stack sizes are known and not too many): each index is
    >= 0, and no two layers read the same checkpoint tensor."""
    import itertools

    counts = {level: _known(count) for level, count in target.weight.stacks}
    levels = {name: counts.get(level) for name, level in target.bound.items()}
    if not levels or any(c is None for c in levels.values()):
        return True
    names = list(levels)
    ranges = [range(levels[n]) for n in names]
    total = 1
    for r in ranges:
        total *= len(r)
    if total > MAX_CHECKED:
        return True
    seen: dict[tuple, dict] = {}
    for combo in itertools.product(*ranges):
        values = {**constants, **dict(zip(names, combo))}
        try:
            indices = tuple(evaluate_index(e, values) if set(e.names) <= set(values)
                            else e.text for e in exprs)  # the expert index: filled later
        except ZeroDivisionError:
            analysis.error(f"an index of `{string.value}` divides by zero", string.span,
                           f"at {_at(values, names)}")
            return False
        if any(isinstance(i, int) and i < 0 for i in indices):
            analysis.error(f"an index of `{string.value}` is negative", string.span,
                           f"{_filled(string.value, indices)} at {_at(values, names)}")
            return False
        if indices in seen:
            analysis.error("two layers read the same checkpoint tensor", string.span,
                           f"{_filled(string.value, indices)} at {_at(seen[indices], names)} "
                           f"and at {_at(values, names)}",
                           help=["each layer needs checkpoint names of its own: check the "
                                 "arithmetic in `{...}`"])
            return False
        seen[indices] = values
    return True


def _at(values: dict, names: list) -> str:
    return ", ".join(f"{{{n}}} = {values[n]}" for n in names)


def _filled(text: str, indices: tuple) -> str:
    parts = iter(indices)
    return "`" + BRACES.sub(lambda m: _shown(next(parts)), text) + "`"


def _shown(index) -> str:
    return str(index) if isinstance(index, int) else "{" + index + "}"


def _known(count) -> int | None:
    if isinstance(count, int):
        return count
    return count.value if getattr(count, "is_const", False) else None
