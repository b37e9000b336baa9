"""`@shard(column)` / `@shard(row)` on a parameter, checked where no tensor-parallel size
is known (`modulec check`): a row shard needs an `[.., out, in]` weight, and the sharded
dim, and no other, must be written over one rank's part (it changes with `tp_size`, the
compile-time topology constant). Whether a given `--tp M` divides it is the build's
question (modulec.lower.tensor_parallel, E027)."""

from __future__ import annotations

from modulec.semantic.consteval import ConstEnv, NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show
from modulec.types.dims import Dim

STRATEGIES = ("column", "row", "vocab")  # what tensor parallel splits (vocab: a [V, D] table)


def shard_note(param) -> A.Annotation | None:
    return next((a for a in param.annotations if a.name == "shard"), None)


def shard_strategy(note: A.Annotation) -> str:
    from modulec.check.annotation_table import argument_values

    return getattr(argument_values(note).get("strategy"), "id", "")


def sharded_dim(strategy: str, rank: int) -> int:
    """column: the out dim of an [.., out, in] weight (a vector's only dim); row: the in dim;
    vocab: the rows of a [V, D] embedding table / LM head (its dim 0, as column's)."""
    return rank - 1 if strategy == "row" else max(rank - 2, 0)


def env_at(instance, tp_size: Dim) -> ConstEnv:
    """The instance's constants with `tp_size` set: its parameters as given, its `let`s
    evaluated again."""
    values = {**instance.world.dims, "tp_size": tp_size}
    values.update({p.name: instance.values.get(p.name)
                   for p in instance.definition.decl.params or ()})
    for binding in instance.definition.lets:
        try:
            values[binding.target.id] = evaluate(binding.value, ConstEnv(values))
        except (NotConst, Undefined, AttributeError):
            continue
    return ConstEnv(values)


def dims_at(type_node, env: ConstEnv) -> list[Dim] | None:
    """The dims of a parameter's `[...]` type in `env` (a trailing dtype dropped)."""
    if isinstance(type_node, A.OptionalType):
        type_node = type_node.value
    if not isinstance(type_node, A.ListExpr):
        return None
    items = list(type_node.items)
    if items and isinstance(items[-1], A.Name) and not isinstance(_value(items[-1], env), Dim):
        items.pop()  # a dtype
    dims = [_value(i, env) for i in items]
    return dims if all(isinstance(d, Dim) for d in dims) else None


def _value(node, env):
    try:
        return evaluate(node, env)
    except (NotConst, Undefined):
        return None


def check_shard_layouts(instance) -> None:
    """E008 at each `@shard(column|row)` of the instance's parameters that cannot work
    whatever the tensor-parallel size."""
    for param in instance.definition.params:
        note = shard_note(param)
        strategy = shard_strategy(note) if note is not None else ""
        if strategy in STRATEGIES:
            problem = _layout_problem(instance, param, strategy)
            if problem:
                instance.world.error("E008", f"`@shard({strategy})` of `{param.name}`: "
                                     f"{problem}", note.span, "cannot split this parameter",
                                     help=["write the sharded dim over one rank's part, "
                                           "`d_ff // tp_size` (docs/distributed.md, Tensor "
                                           "parallel)"])


def _layout_problem(instance, param, strategy: str) -> str:
    if any(p.name == "tp_size" for p in instance.definition.decl.params or ()):
        return ""  # sized by its own `tp_size` parameter (spec §7.6.1's TPAttention)
    one = dims_at(param.type, env_at(instance, Dim.const(1)))
    many = dims_at(param.type, env_at(instance, Dim.sym("tp_size")))
    if one is None or many is None or len(one) != len(many):
        return ""
    if not one:
        return "a scalar has no dim to split"
    if strategy == "row" and len(one) < 2:
        return f"a row shard splits the in dim of an [out, in] weight; it has {len(one)} dim"
    dim = sharded_dim(strategy, len(one))
    if one[dim] == many[dim]:
        return (f"dim {dim} ({show(_items(param.type)[dim])}) does not depend on `tp_size`: "
                "it is the whole size on every rank")
    other = next((d for d in range(len(one)) if d != dim and one[d] != many[d]), None)
    if other is not None:
        return f"dim {other} changes with `tp_size` too; a {strategy} shard splits dim {dim}"
    return ""


def _items(type_node) -> list:
    if isinstance(type_node, A.OptionalType):
        type_node = type_node.value
    return list(type_node.items)
