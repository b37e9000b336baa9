"""A module instance: a declaration with its parameter values bound.

Checking a declaration on its own binds each parameter to its default, or to a symbol
(`d_model`) when it has none; instantiating a model binds concrete sizes. Either way the
instance evaluates its `let:` constants, checks its constraints (§3.5.1; a constraint
that cannot be decided yet becomes an assumption for the shape checker) and reads its
`params:` into tensor types and submodule instances.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from modulec.check.world import World, did_you_mean
from modulec.resolve.std_index import import_help
from modulec.semantic.consteval import (
    ConstEnv, Ident, NotConst, Undefined, Unknown, evaluate, truth,
)
from modulec.semantic.decls import ModuleDef, TensorParam
from modulec.source import Span
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show
from modulec.types.dims import MESSAGE_DIGITS, Dim, int_text
from modulec.types.sampling import Assumptions, typed
from modulec.types.tensor import DTYPES, FLOAT, MAX_RANK, TensorType


# resource limits, checked where sizes are bound (docs/decisions.md, "Sizes")
MAX_DIM = 2 ** 40  # one dim: no real model comes near this
MAX_ELEMENTS = 2 ** 40  # one tensor's elements (8 TiB in fp64)
MAX_BLOCKS = 10_000  # the blocks of one array (real models have at most a few hundred)
MAX_FLOAT = sys.float_info.max  # a float parameter's value, when written as an integer

@dataclass(frozen=True)
class Submodule:
    """A parameter that is a module instance (`attention: CausalSelfAttention(...)`)."""

    instance: "Instance"
    span: Span


@dataclass(frozen=True)
class Stack:
    """`blocks: [n] x Block(...)`: n instances of one block."""

    count: object
    instance: "Instance"
    span: Span


@dataclass(frozen=True)
class Broken:
    """A parameter whose type could not be read (already reported): uses stay silent."""

    span: Span


@dataclass(frozen=True)
class TensorParamValue:
    type: TensorType
    span: Span
    optional: bool = False
    frozen: bool = False  # @frozen or @gradient(skip): no gradient, no optimizer state
    tied_to: str | None = None
    notes: tuple = ()  # its annotations (`@gradient`, `@trainable`): lowering reads them


@dataclass(eq=False)  # one object per instance: `==` compared every field, the world's
class Instance:       # cache of instances included (a RecursionError deep in a tree)
    world: World
    definition: ModuleDef
    values: dict = field(default_factory=dict)
    assumptions: Assumptions = field(default_factory=Assumptions)
    params: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # (instance, constraint) that failed
    cycles: list = field(default_factory=list)  # containment chains found below this instance
    checked: bool = False
    inferred: list = field(default_factory=list)  # (phase, name, type, span), for --emit resolved
    call_dims: dict = field(default_factory=dict)  # lowering: free dims bound by the call site
    call_inputs: list = field(default_factory=list)  # lowering: the input types of that call
    inline_calls: list = field(default_factory=list)  # instances its graphs call inline

    @property
    def name(self) -> str:
        return self.definition.name

    def env(self, free: str = "error", runtime=lambda name: False) -> ConstEnv:
        if self.world.dims or self.call_dims:
            return ConstEnv({**self.world.dims, **self.call_dims, **self.values}, free, runtime)
        return ConstEnv(self.values, free, runtime)

    def describe(self) -> str:
        given = ", ".join(f"{p.name}={_short(self.values.get(p.name))}"
                          for p in self.definition.decl.params or ())
        return f"{self.name}({given})"


def instantiate(world: World, definition: ModuleDef, args: dict | None = None) -> Instance:
    """Bind parameters (given, default, or symbolic), then lets, constraints and params."""
    key = (id(definition.decl), _freeze(args))
    if key in world.instances:
        return world.instances[key]
    instance = Instance(world, definition)
    world.instances[key] = instance
    world.instantiating.append(instance)
    try:
        _bind_decl_params(instance, args or {})
        _evaluate_lets(instance)
        _check_constraints(instance)
        _read_params(instance)
    finally:
        world.instantiating.pop()
    return instance


# ====================================================================== declaration params
# spec §3.1's scalar types, and the tensor type, for a declaration's parameters
PARAM_TYPES = ("int", "float", "bool", "string", "Tensor")


def _bind_decl_params(instance: Instance, args: dict) -> None:
    for param in instance.definition.decl.params or ():
        _check_param_type(instance, param)
        if param.name in args:
            instance.values[param.name] = args[param.name]
        elif param.default is not None:
            instance.values[param.name] = _default(instance, param)
        else:
            instance.values[param.name] = _symbolic(param)
        _fits_the_ir(instance, param, given=param.name in args)


def _fits_the_ir(instance: Instance, param: A.DeclParam, given: bool) -> None:
    """The IR's integers are int64 (spec §10), its floats 64-bit: a parameter's integer
    past that reached the build's function arguments, which could not even print it
    (exit 101). A float parameter written as an integer (`rope_theta = 10**26`) holds
    any float; a float (or a float in a list) must be finite."""
    value = instance.values[param.name]
    declared = param.type.value if isinstance(param.type, A.OptionalType) else param.type
    bad = [v for v in (value if isinstance(value, tuple) else (value,))
           if isinstance(v, float) and not math.isfinite(v)]
    where = param.default if param.default is not None and not given else param
    if bad and fits_type(declared, value):  # `x: float = 1e999`, `[float]`, untyped (int: E003)
        _not_finite(instance, param, bad[0], isinstance(value, tuple), where.span)
        return
    if not (isinstance(value, Dim) and value.is_const):
        return
    if isinstance(declared, A.Name) and declared.id == "float":  # `rope_theta = 10**26`
        if abs(value.value) <= MAX_FLOAT:
            return
        problem, why = "a number past the largest float", "floats are 64-bit (below 1.8e308)"
    elif _model_size_unusable(instance, param, value.value):
        bound = "at least 1" if value.value < 1 else f"at most {MAX_DIM:,}"
        problem, why = f"a model's `int` parameter is a size, {bound}", "`--set` refuses " \
            "it the same way; a parameter that may be below 1 is declared `int?`"
    elif -2**63 <= value.value < 2**63:
        return
    else:
        problem, why = "an integer must fit 64 bits", "integers of the IR and the runtime " \
            "are int64 (below 2^63)"
    shown = int_text(value.value, MESSAGE_DIGITS, grouped=True)
    instance.world.error_unmuted("E027", f"`{param.name}` is {shown}: {problem}", where.span,
                                 help=[why])


def _model_size_unusable(instance: Instance, param: A.DeclParam, value: int) -> bool:
    """A model's plain `int` is a size, as `--set` reads it (given.usable: 1 .. MAX_SIZE;
    found by a fuzz run: Qwen3-MoE's `max_seq = 0` checked and built, and no sequence could
    run; `--set max_seq=0` was refused, and `n: int = 2**50` checked clean while
    `--set n=2**50` was refused)."""
    from modulec.check.given import usable  # given reads this module's MAX_DIM

    return instance.definition.decl.kind == "model" and isinstance(param.type, A.Name) and \
        param.type.id == "int" and not usable(value, param)


def _not_finite(instance: Instance, param: A.DeclParam, value: float, listed: bool,
                span) -> None:
    """`x: float = 1e999` (or `1e308 * 10`, `1e999 - 1e999`) is inf or nan: no scale, rate
    or size, and the IR's floats are finite; unused, it was accepted silently."""
    instance.world.error_unmuted(
        "E027", f"`{param.name}` {'holds' if listed else 'is'} {value}: a float "
        "parameter must be a finite number", span, "not a finite number",
        help=["floats are 64-bit: a literal past 1.8e308 (`1e999`) or arithmetic past it "
              "(`1e308 * 10`) is inf"])


def _check_param_type(instance: Instance, param: A.DeclParam) -> None:
    """`d_ff: B` is no type: the parameter would stay unsized (E002, not a later crash)."""
    declared = param.type.value if isinstance(param.type, A.OptionalType) else param.type
    if isinstance(declared, (A.Number, A.String, A.Bool, A.NoneLit)):  # `d_in: false`
        instance.world.error("E002", f"parameter `{param.name}` is typed by a value, not a "
                             "type", declared.span, "not a type",
                             help=[f"types of parameters: {', '.join(PARAM_TYPES)}"])
        return
    if isinstance(declared, A.ListExpr):  # `[float]`: a list of one scalar type
        element = declared.items[0] if len(declared.items) == 1 else None
        if not (isinstance(element, A.Name) and element.id in PARAM_TYPES[:4]):
            instance.world.error("E002", f"parameter `{param.name}`: a list type names one "
                                 "scalar type", declared.span, "not a type",
                                 help=["`[float]`, `[int]`, `[bool]` or `[string]`"])
        return
    name = A.qualified_name(declared)
    if declared is not None and name is None:  # `n: int == 36`
        _not_a_type(instance, param, declared)
        return
    if declared is None or name in PARAM_TYPES:
        return
    world = instance.world
    if world.already_reported(name, declared.span):
        return
    decl = world.lookup_decl(name, declared.span)  # `F.Proj` too
    if decl is not None:  # `d: M`: a declaration is no value a parameter can hold
        world.error("E002", f"parameter `{param.name}`: `{name}` is a {decl.kind}, not a "
                    "type of parameters", declared.span, "not a type",
                    help=[f"types of parameters: {', '.join(PARAM_TYPES)}; a {decl.kind} is "
                          "instantiated in `params:` (`x: " + name + "(...)`), not passed"])
        return
    world.error("E002", f"unknown type `{name}` of parameter `{param.name}`",
                declared.span, "not a type", help=did_you_mean(name, PARAM_TYPES)
                or [f"types of parameters: {', '.join(PARAM_TYPES)}"])


def _not_a_type(instance: Instance, param: A.DeclParam, declared) -> None:
    """Any expression parses where a type goes; one that is not a type left the parameter
    without a default and untyped (`n: int == 36` was a symbolic size the build could not
    lower)."""
    typo = isinstance(declared, A.Compare) and len(declared.rest) == 1 and \
        declared.rest[0][0] == "==" and isinstance(declared.first, A.Name)
    instance.world.error("E002", f"parameter `{param.name}`: `{show(declared)}` is not a type",
                         declared.span, "not a type",
                         help=[f"a default is written with one `=`: `{param.name}: "
                               f"{declared.first.id} = {show(declared.rest[0][1])}`"] if typo
                         else [f"types of parameters: {', '.join(PARAM_TYPES)}"])


def _default(instance: Instance, param: A.DeclParam):
    value = _const(instance, param.default, "a default value")
    if not fits_type(param.type, value):
        instance.world.error("E003", f"the default of `{param.name}` is {_short(value)}, but "
                             f"`{param.name}` is declared {show(param.type)}",
                             param.default.span, "default of the wrong kind")
    return value


def _symbolic(param: A.DeclParam):
    kind = param.type.id if isinstance(param.type, A.Name) else None
    if kind == "bool":
        return Unknown("bool")
    if kind == "float":
        return Unknown("float")
    return Dim.sym(param.name)


def _const(instance: Instance, node, what: str, free: str = "error"):
    world = instance.world
    try:
        return evaluate(node, instance.env(free))
    except Undefined as exc:
        world.error("E002", f"undefined name `{exc.node.id}`", exc.node.span,
                    "not a parameter or constant of this module",
                    help=did_you_mean(exc.node.id, instance.values))
    except NotConst as exc:  # unmuted: `d // (d - 4)` is one only at some sizes
        instance.world.error_unmuted("E003", f"{what} must be a compile-time value",
                                     exc.node.span, exc.reason)
    return Unknown("float")


# ====================================================================== let and constraints
def _evaluate_lets(instance: Instance) -> None:
    for binding in instance.definition.lets:
        if not isinstance(binding.target, A.Name):
            instance.world.error("E003", "a `let` binding needs a name on the left",
                                 binding.target.span)
            continue
        instance.values[binding.target.id] = _const(instance, binding.value, "a `let` binding")


def _check_constraints(instance: Instance) -> None:
    for constraint in instance.definition.constraints:
        _check_constraint(instance, constraint)


def _check_constraint(instance: Instance, constraint: A.Constraint) -> None:
    world = instance.world
    try:
        verdict = truth(evaluate(constraint.condition, instance.env()))
    except Undefined as exc:
        world.error("E002", f"undefined name `{exc.node.id}`", exc.node.span,
                    help=did_you_mean(exc.node.id, instance.values))
        return
    except NotConst as exc:  # unmuted: `8 % (d - 4)` has no value only at d = 4
        instance.world.error_unmuted("E026", "a constraint must be a compile-time expression",
                                     exc.node.span, exc.reason,
                                     help=["constraints may use parameters, `let` constants and "
                                           "sqrt/ceil_div/min/max/abs/int/floor"])
        return
    if verdict is False:
        instance.failures.append((instance, constraint))
        world.error("E027", f"constraint violated: {constraint.message.value}",
                    constraint.condition.span, f"`{show(constraint.condition)}` is false",
                    notes=[_values_note(instance, constraint.condition)])
    elif isinstance(verdict, Unknown):
        _assume(instance, constraint.condition)


def _assume(instance: Instance, condition: A.Expr) -> None:
    """An undecided constraint holds for the shape checker's sample sizes."""
    symbols: set[str] = set()
    for value in instance.values.values():
        if isinstance(value, Dim):
            symbols |= value.symbols()
    values = dict(instance.values)
    dims = [(k, v) for k, v in values.items() if isinstance(v, Dim)]

    def fact(sample) -> bool:
        concrete = dict(values)  # every size evaluated (one that cannot be: no sample)
        for k, v in dims:
            concrete[k] = Dim.const(v.evaluate(sample))
        try:
            return truth(evaluate(condition, ConstEnv(concrete))) is True
        except NotConst:  # undefined at these sizes (`d % (h - 4)` at h = 4): not a sample
            return False

    fact.key = (condition, tuple((k, typed(v)) for k, v in values.items()))  # all it reads
    instance.assumptions.add_fact(symbols, fact)


def _values_note(instance: Instance, condition: A.Expr) -> str:
    names = sorted({n.id for n in _names_in(condition) if n.id in instance.values})
    shown = ", ".join(f"{n} = {_short(instance.values[n])}" for n in names)
    return f"with {shown}" if shown else "the condition is false for every size"


def _names_in(node) -> list[A.Name]:
    found = []
    if isinstance(node, A.Name):
        return [node]
    for value in getattr(node, "__dataclass_fields__", {}):
        child = getattr(node, value)
        children = child if isinstance(child, tuple) else (child,)
        for c in children:
            if isinstance(c, tuple):
                for inner in c:
                    found += _names_in(inner)
            elif hasattr(c, "__dataclass_fields__") and not isinstance(c, Span):
                found += _names_in(c)
    return found


# ====================================================================== params
def _read_params(instance: Instance) -> None:
    for param in instance.definition.params:
        if _present(instance, param):
            value = _param_value(instance, param)
            instance.params[param.name] = value if value is not None else Broken(param.span)


def guard(instance: Instance, test: A.Expr, hint: str, runtime=lambda name: False):
    """An `if` guard's value: True/False, or Unknown (reported: E016 when it reads a
    runtime value, E002 for an undefined name)."""
    try:
        return truth(evaluate(test, instance.env(runtime=runtime)))
    except NotConst as exc:
        instance.world.error("E016", "`if` guard must be a compile-time expression (ConstExpr)",
                             exc.node.span, exc.reason, help=[hint])
    except Undefined as exc:
        instance.world.error("E002", f"undefined name `{exc.node.id}`", exc.node.span,
                             help=did_you_mean(exc.node.id, instance.values))
    return Unknown("bool")


def _present(instance: Instance, param: TensorParam) -> bool:
    if param.condition is None:
        return True
    try:
        verdict = truth(evaluate(param.condition, instance.env()))
    except (NotConst, Undefined) as exc:
        node = getattr(exc, "node", param.condition)
        problem = ("E016", "a parameter's `if` guard must be a compile-time expression",
                   node.span, getattr(exc, "reason", "not a constant"))
        if isinstance(exc, NotConst):  # unmuted: `8 % (d - 4)` has no value only at d = 4
            instance.world.error_unmuted(*problem)
        else:
            instance.world.error(*problem)
        return True
    return verdict is not False


def _param_value(instance: Instance, param: TensorParam):
    type_, optional = param.type, False
    if isinstance(type_, A.OptionalType):
        type_, optional = type_.value, True
    from modulec.lower.value_marks import SKIP, cast_of, gradient_spec

    notes = tuple(param.annotations)
    skipped = (gradient_spec(notes) or ("",))[0] == SKIP
    frozen = skipped or any(a.name == "frozen" for a in notes)
    if isinstance(type_, A.ListExpr):
        tensor = tensor_type(instance, type_)
        dtype = cast_of(notes)  # @dtype(T): the parameter is stored in T
        if tensor is not None and dtype is not None:
            tensor = tensor.with_dtype(dtype)
        return TensorParamValue(tensor, param.span, optional, frozen, notes=notes) \
            if tensor else None
    if isinstance(type_, A.ArrayType):
        return _stack(instance, type_, param)
    if _is_tied(type_):
        return _tied(instance, type_, param)
    return _submodule(instance, type_, param.span)


def tensor_type(instance: Instance, node: A.ListExpr, free: str = "error") -> TensorType | None:
    """`[B, T, d_model, bf16]` evaluated in the instance's constants (`free` for `B`, `T`)."""
    items = list(node.items)
    dtype = FLOAT
    if items and isinstance(items[-1], A.Name) and items[-1].id in DTYPES:
        dtype = items.pop().id
    if len(items) > MAX_RANK:
        instance.world.error_unmuted("E027", f"a tensor type of {len(items):,} dims: the most "
                                     f"a tensor may have is {MAX_RANK}", node.span)
        return None
    dims = []
    for item in items:
        value = _const(instance, item, "a dimension", free)
        if isinstance(value, Unknown):
            _float_at_every_size(instance, item, free, "a dimension")
            return None
        if not isinstance(value, Dim):  # unmuted: `[d / 2]` is a float once d is sized
            instance.world.error_unmuted("E003", "a dimension must be an integer", item.span,
                                         f"this is {_short(value)}",
                                         help=_integer_help(value, item))
            return None
        if not _at_least_one(instance, value, item, "a dimension"):
            return None
        dims.append(value)
    if not _elements_in_range(instance, dims, node):
        return None
    return TensorType(tuple(dims), dtype)


def _float_at_every_size(instance: Instance, item, free: str, what: str) -> bool:
    """A dim or an array's size with no value yet (`[0.5 * d_ff]`, `[d / 2]` while `d` is
    unsized) that is a float at every sample size is no size at any: E003 where written.
    It checked clean on its own and failed wherever sized (found by a fuzz run of
    --verify-backward: std MoEExperts' `2 * local_ff` made `0.5 * local_ff`). The samples
    are the shape checker's (`Assumptions.samples`: they satisfy the constraints)."""
    symbolic = {k: v for k, v in instance.values.items() if isinstance(v, Dim) and not v.is_const}
    symbols = set().union(*(v.symbols() for v in symbolic.values()))
    samples = instance.assumptions.samples(symbols) if symbols else []
    first = None
    for env in samples:
        try:
            sample = {k: Dim.const(v.evaluate(env)) for k, v in symbolic.items()}
            value = evaluate(item, ConstEnv({**instance.values, **sample}, free))
        except (NotConst, Undefined, KeyError, ValueError, ArithmeticError):
            return False
        if not isinstance(value, float):
            return False
        first = first or (value, sample)
    if first is None:
        return False
    value, sample = first
    read = {n.id for n in _names_in(item)}
    at = ", ".join(f"{k} = {v}" for k, v in sorted(sample.items()) if k in read)
    instance.world.error("E003", f"{what} must be an integer", item.span,
                         f"a float whatever the sizes ({value}{' when ' + at if at else ''})",
                         help=_integer_help(value, item))
    return True


def _integer_help(value, item) -> list[str]:
    """A float where a size belongs: say how to make it an integer."""
    if isinstance(value, bool) or not isinstance(value, float):
        return []
    text = show(item)
    return [f"make it an integer: `int({text})` truncates toward zero, `floor({text})` "
            "rounds down"]


def _at_least_one(instance: Instance, size, node, what: str, most: int = MAX_DIM) -> bool:
    """A size known here to be below 1, or beyond what any model holds, is an error at
    its expression (a tensor of a negative or zero dim, an empty array of blocks, 10^12
    columns: the runtime could only fail on it, or run out of memory first)."""
    if isinstance(size, Dim) and size.is_const and not 1 <= size.value <= most:
        bound = "at least 1" if size.value < 1 else f"at most {most:,}"
        instance.world.error_unmuted(
            "E027", f"{what} must be {bound}: this is "
            f"{int_text(size.value, MESSAGE_DIGITS, grouped=True)}", node.span,
            help=["check the expression and the parameter values it reads"])
        return False
    return True


def _elements_in_range(instance: Instance, dims: list, node) -> bool:
    """A tensor whose known dims multiply past MAX_ELEMENTS cannot be held anywhere."""
    total, known = 1, [d.value for d in dims if d.is_const]
    for count, value in enumerate(known, 1):
        total *= value
        if abs(total) > MAX_ELEMENTS:  # stop: 20,000 dims make a number Python cannot print
            break
    if total > MAX_ELEMENTS:
        size = f"{total:,}" if count == len(known) else f"at least {total:,}"
        instance.world.error_unmuted(
            "E027", f"a tensor of {size} elements: the most a tensor may hold is "
                    f"{MAX_ELEMENTS:,}", node.span,
            help=["check the sizes its dims read (--set, --shape, defaults)"])
        return False
    return True


def _is_tied(node) -> bool:
    return isinstance(node, A.Call) and isinstance(node.func, A.Name) and node.func.id == "tied_to"


def _tied(instance: Instance, node: A.Call, param: TensorParam):
    target = node.args[0].value if node.args else None
    if not isinstance(target, A.Name) or target.id not in instance.params:
        instance.world.error("E002", "`tied_to` must name a parameter declared above",
                             (target or node).span, help=did_you_mean(
                                 getattr(target, "id", ""), instance.params))
        return None
    source = instance.params[target.id]
    if not isinstance(source, TensorParamValue):
        return None
    return TensorParamValue(source.type, param.span, tied_to=target.id)


def _stack(instance: Instance, node: A.ArrayType, param: TensorParam):
    count = _const(instance, node.count, "an array size")
    if not isinstance(count, (Dim, Unknown)):  # a list, a float, None: no count of blocks
        # unmuted: `[n / 2]` is a float only once a caller sizes n (muted, the array was
        # dropped and the lowering tripped over its call: exit 101)
        instance.world.error_unmuted("E003", "an array of blocks' size must be an integer",
                                     node.count.span, f"this is {_short(count)}",
                                     help=_integer_help(count, node.count))
        return None
    if isinstance(count, Unknown) and \
            _float_at_every_size(instance, node.count, "error", "an array of blocks' size"):
        return None
    if isinstance(count, Dim) and not _at_least_one(instance, count, node.count,
                                                    "an array of blocks' size", MAX_BLOCKS):
        return None
    element = _submodule(instance, node.element, param.span)
    return Stack(count, element.instance, param.span) if element else None


def _submodule(instance: Instance, node, span: Span):
    func, args = (node.func, node.args) if isinstance(node, A.Call) else (node, ())
    name = A.qualified_name(func)
    if name is None:
        instance.world.error("E003", "a parameter's type must be a shape `[...]` or a module",
                             node.span)
        return None
    decl = instance.world.lookup_decl(name, func.span)
    if decl is None and instance.world.already_reported(name, func.span):
        return None
    if decl is None or decl.kind == "primitive":
        instance.world.error("E002", f"undefined module `{name}`", func.span,
                             "not a module, block or model in scope",
                             help=did_you_mean(name, instance.world.candidates(func.span))
                             + import_help(name))
        return None
    child = instantiate_call(instance, decl, args, node.span)
    return Submodule(child, span) if child else None


def instantiate_call(instance: Instance, decl: A.Decl, args, span: Span) -> Instance | None:
    """Instantiate `decl` with ConstExpr arguments evaluated in `instance`; E012/E003."""
    world = instance.world
    if decl.abstract:
        _abstract(world, decl, span)
        return None
    decls = [i.definition.decl for i in world.instantiating]
    if decl in decls:
        names = [d.name for d in decls[decls.index(decl):]]
        instance.cycles.append(" -> ".join(names + [decl.name]))
        _contains_itself(world, instance.cycles[-1], span)
        return None
    definition = world.definition(decl)
    bound = bind_arguments(instance, decl, args, span)
    if bound is None:
        return None
    world.quiet += 1
    try:
        child = instantiate(world, definition, bound)
    finally:
        world.quiet -= 1
    # Failures deep inside (a block's attention) rise to the outermost call written in a
    # file being checked: that is where the sizes that break them come from.
    instance.failures += [f for f in child.failures if f not in instance.failures]
    # A cycle found while instantiating quietly (A -> B -> A) is reported here, at a call
    # that may be written in the file being checked.
    instance.cycles += [c for c in child.cycles if c not in instance.cycles]
    for chain in child.cycles:
        _contains_itself(world, chain, span)
    for owner, failed in child.failures:
        world.error("E027", f"constraint of `{owner.name}` violated: {failed.message.value}",
                    span, f"`{show(failed.condition)}` is false for these arguments",
                    notes=[f"in {owner.describe()}", _values_note(owner, failed.condition)])
    return child


def _abstract(world: World, decl: A.Decl, span: Span) -> None:
    """§4.2: an abstract module is an interface without a graph; only a module that
    extends it and writes the graph can be instantiated."""
    concrete = sorted(name for name in world.candidates(span)
                      if _extends(world, world.lookup_decl(name, span), decl.name))
    world.error("E011", f"`{decl.name}` is an abstract module: it has no graph to run",
                span, "cannot instantiate an abstract module",
                help=[f"instantiate a module that extends it: {', '.join(f'`{c}`' for c in concrete)}"
                      if concrete else
                      f"declare `module My{decl.name}(...) extends {decl.name}:` with a "
                      "`forward:` graph, and instantiate that"])


def _extends(world: World, candidate, base: str) -> bool:
    """`candidate` extends `base` and has the graph the base lacks."""
    extends = getattr(candidate, "extends", None)
    if not isinstance(extends, A.Name) or extends.id != base or candidate.abstract:
        return False
    forward = world.definition(candidate).forward
    return forward is not None and forward.graph is not None


def _contains_itself(world, chain: str, span: Span) -> None:
    world.error("E007", f"`{chain.split(' -> ')[0]}` contains itself: {chain}", span,
                "a module cannot be one of its own parameters",
                help=["a module's parameters form a tree; if a name was meant to refer "
                      "to an imported module, rename the local declaration"])


def bind_arguments(instance: Instance, decl: A.Decl, args, span: Span) -> dict | None:
    params = list(decl.params or ())
    world, bound = instance.world, {}
    positional = [a for a in args if a.key is None]
    if _positional_after_keyword(world, decl, args):
        return None
    if len(positional) > len(params):
        world.error("E003", f"`{decl.name}` takes {len(params)} argument(s), "
                    f"{len(positional)} given", positional[len(params)].value.span)
        return None
    for param, arg in zip(params, positional):
        bound[param.name] = _const(instance, arg.value, "a module argument")
    for arg in (a for a in args if a.key is not None):
        key = getattr(arg.key, "id", None)
        if key not in {p.name for p in params}:
            world.error("E003", f"`{decl.name}` has no parameter `{key}`", arg.key.span,
                        help=did_you_mean(key or "", [p.name for p in params]))
            return None
        if key in bound:  # `Inner(d, 5, b=7)`: the 5 was silently replaced
            world.error("E003", f"`{decl.name}` parameter `{key}` given twice", arg.key.span,
                        "given again here", help=["pass each parameter once, by position or "
                                                  "by name"])
            return None
        bound[key] = _const(instance, arg.value, "a module argument")
    for param in params:
        if param.name in bound and not fits_type(param.type, bound[param.name]):
            # Unmuted: the argument's kind can depend on the caller's values (`2.5 * d`
            # is unknown while `d` is, a float once a model sizes it); muted, the child
            # was built from it and the lowering tripped over an int that was not (exit 101).
            instance.world.error_unmuted(
                "E003", f"`{decl.name}` parameter `{param.name}` is declared "
                f"{show(param.type)}, given {_short(bound[param.name])}", span,
                "argument of the wrong kind")
            return None
    missing = [p.name for p in params if p.name not in bound and p.default is None]
    if missing:
        world.error("E012", f"missing argument{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(f'`{m}`' for m in missing)} for `{decl.name}`", span,
                    f"`{decl.name}` needs {', '.join(missing)}",
                    notes=[f"`{decl.name}` is declared at {decl.span.file}:{decl.span.line}"])
        return None
    return bound


def _positional_after_keyword(world: World, decl: A.Decl, args) -> bool:
    """`Inner(b=3, d)`: as in Python, positional arguments come first (the `d` bound the
    first parameter, whatever the keyword before it named)."""
    keyword = next((i for i, a in enumerate(args) if a.key is not None), len(args))
    late = next((a for a in args[keyword:] if a.key is None), None)
    if late is not None:
        world.error("E003", f"a positional argument follows a keyword argument in the call "
                    f"of `{decl.name}`", late.value.span, "positional argument",
                    help=["write positional arguments first, or name this one"])
    return late is not None


def fits_type(declared, value) -> bool:
    """Whether a module argument suits its parameter's declared type (untyped: anything)."""
    optional = isinstance(declared, A.OptionalType)
    kind = (declared.value if optional else declared)
    if isinstance(value, Unknown):
        return True
    if value is None:
        return not isinstance(kind, (A.Name, A.ListExpr)) or optional
    if isinstance(kind, A.ListExpr):  # `[float]`: a list of such values
        return len(kind.items) == 1 and isinstance(value, (tuple, list)) and \
            all(fits_type(kind.items[0], v) for v in value)
    kind = kind.id if isinstance(kind, A.Name) else None
    checks = {"int": lambda v: isinstance(v, Dim),
              "float": lambda v: isinstance(v, (float, Dim)) and not isinstance(v, bool),
              "bool": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str)}
    return checks.get(kind, lambda v: True)(value)


def _freeze(args) -> tuple:
    if not args:
        return ()
    return tuple(sorted((k, repr(v)) for k, v in args.items()))


def _short(value) -> str:
    if isinstance(value, Ident):
        return value.name
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
