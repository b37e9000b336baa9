"""The op table: one `OpRule` per primitive.

A primitive's signature, parameters, backward and kernels are declared once, in the DSL
(`std/primitives/<name>.module`); its shape rule is a Python function registered here by
name (`modulec.ops.shapes_*`), or, for the many ops whose signature says it all, the
generic signature matcher. Later layers add the gradient rule, the reference kernel and
the CUDA kernel to the same entry. A primitive's `collective: [forward, backward]` says
which of its phases' kernels is a collective alone (`collective_ops`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modulec.paths import data_dir
from modulec.semantic.consteval import ConstEnv, Ident, NotConst, Undefined, Unknown, evaluate
from modulec.semantic.decls import ModuleDef, module_def
from modulec.syntax import ast as A
from modulec.types.dims import MESSAGE_DIGITS, Dim, int_text
from modulec.types.sampling import Assumptions
from modulec.types.tensor import DTYPES, TensorType

ShapeRule = Callable[["OpCall"], list[TensorType]]
SHAPE_RULES: dict[str, ShapeRule] = {}


def shape_rule(*names: str):
    """Register a Python shape rule for the named primitives."""
    def register(function: ShapeRule) -> ShapeRule:
        for name in names:
            SHAPE_RULES[name] = function
        return function
    return register


@dataclass(frozen=True)
class ParamSpec:
    name: str
    kind: str  # "int" | "float" | "bool" | "enum" | "dtype" | "ints" | "floats" | "any"
    default: object
    has_default: bool
    choices: tuple[str, ...] = ()
    optional: bool = False


@dataclass(frozen=True)
class OpRule:
    name: str
    definition: ModuleDef
    params: tuple[ParamSpec, ...]
    file: Path
    collective: frozenset[str] = frozenset()  # "forward" / "backward": a collective kernel

    @property
    def shape(self) -> ShapeRule | None:
        return SHAPE_RULES.get(self.name)


@dataclass
class OpCall:
    """What a shape rule sees: input types (None for an absent optional input) and bound
    parameter values."""

    rule: OpRule
    inputs: list[TensorType | None]
    params: dict[str, object]
    assumptions: Assumptions
    names: list[str] = field(default_factory=list)

    def param(self, name: str):
        return self.params.get(name)


# ====================================================================== loading
_TABLE: dict[str, OpRule] | None = None


def op_table() -> dict[str, OpRule]:
    global _TABLE
    if _TABLE is None:
        _import_shape_rules()
        _TABLE = _load(data_dir("std") / "primitives")
    return _TABLE


def _import_shape_rules() -> None:
    from modulec.ops import (shapes_comm, shapes_linalg, shapes_special,  # noqa: F401
                             shapes_tensor)  # (register)


def _load(folder: Path):
    """The table, each primitive read on first use (`std/primitives/<name>.module`)."""
    from modulec.lazymap import LazyMapping

    paths = {p.name.split(".")[0]: p for p in sorted(folder.glob("*.module"))}
    return LazyMapping(paths, lambda name: _load_file(paths[name]))


def _load_file(path: Path) -> dict[str, OpRule]:
    from modulec.resolve.resolver import _display_name
    from modulec.source import SourceFile
    from modulec.syntax.parser import parse_source

    # named as the import resolver names it, so both share one cached tree
    result = parse_source(SourceFile(_display_name(path.resolve()), path.read_text()), True)
    table = {}
    for decl in result.program.decls if result.program else []:
        if decl.kind == "primitive":
            definition = module_def(decl)
            table[decl.name] = OpRule(decl.name, definition, _param_specs(definition), path,
                                      _collective(definition))
    return table


def _collective(definition: ModuleDef) -> frozenset[str]:
    """The phases of `collective: [...]` (checked as E001 by modulec.syntax.sections; the
    op table is ours, so a malformed one is an internal error)."""
    entry = definition.sections.get("collective")
    if entry is None:
        return frozenset()
    phases = [getattr(i, "id", None) for i in getattr(entry.value, "items", ())]
    if not phases or not set(phases) <= {"forward", "backward"}:
        raise ValueError(f"primitive `{definition.name}`: `collective:` must list forward "
                         f"and/or backward, not {phases}")
    return frozenset(phases)


def is_collective(target: str) -> bool:
    """Whether IR op `target` (`name`, or `name_backward` for its backward, as
    modulec.lower.schedule kernel_of reads it) has a collective kernel; reads one file."""
    backward = target.endswith("_backward")
    rule = op_table().get(target[:-len("_backward")] if backward else target)
    return rule is not None and ("backward" if backward else "forward") in rule.collective


def backward_gradients(rule: OpRule) -> tuple[bool, ...]:
    """Per output of `rule`'s backward, whether it is a gradient (`d_<input>`); the others
    are by-products a flow may leave unnamed at its end and no gradient flows through
    (swiglu's `y`: decisions.md, "Gated activations: the backward returns y")."""
    phase = rule.definition.backward
    return tuple(sig.name.startswith("d_") for sig in phase.outputs) if phase else ()


def collective_ops() -> frozenset[str]:
    """The IR op names whose kernel is a collective alone, from the table's `collective:`
    sections: `name` for a forward, `name_backward` for a backward (what may run on the
    communication stream: modulec.ir.verify_async)."""
    return frozenset(f"{rule.name}_backward" if phase == "backward" else rule.name
                     for rule in op_table().values() for phase in rule.collective)


def _param_specs(definition: ModuleDef) -> tuple[ParamSpec, ...]:
    section = definition.sections.get("params")
    if not isinstance(section, A.Section):
        return ()
    return tuple(_param_spec(e) for e in section.body if isinstance(e, A.Entry))


def _param_spec(entry: A.Entry) -> ParamSpec:
    kind_expr, optional = entry.value, False
    if isinstance(kind_expr, A.OptionalType):
        kind_expr, optional = kind_expr.value, True
    kind, choices = _kind(kind_expr)
    has_default = entry.default is not None
    default = _default(entry.default) if has_default else None
    return ParamSpec(entry.key.id, kind, default, has_default, choices, optional)


def _kind(expr) -> tuple[str, tuple[str, ...]]:
    if isinstance(expr, A.Name) and expr.id in ("int", "float", "bool", "dtype", "string"):
        return expr.id, ()
    if isinstance(expr, A.Call) and isinstance(expr.func, A.Name) and expr.func.id == "enum":
        return "enum", tuple(a.value.id for a in expr.args if isinstance(a.value, A.Name))
    if isinstance(expr, A.ListExpr):
        floats = any(isinstance(i, A.Name) and i.id == "float" for i in expr.items)
        return ("floats" if floats else "ints"), ()
    return "any", ()


def _default(expr):
    try:
        return evaluate(expr, ConstEnv({}, "ident"))
    except (NotConst, Undefined):
        return None


# ====================================================================== binding
class BindError(Exception):
    """A call's arguments do not fit the primitive's parameters (E003)."""

    def __init__(self, message: str, span=None, help: tuple[str, ...] = (),
                 by_value: bool = False):
        super().__init__(message)
        self.message, self.span, self.help = message, span, help
        self.by_value = by_value  # a value of the right kind that no call may give


def bind_params(rule: OpRule, positional: list[tuple[object, object]],
                keywords: list[tuple[str, object, object]]) -> dict[str, object]:
    """Parameter values of a call: positional ConstExpr arguments in declaration order,
    then keywords, then defaults. Each argument is (value, span)."""
    values: dict[str, object] = {}
    specs = {spec.name: spec for spec in rule.params}
    if len(positional) > len(rule.params):
        extra_span = positional[len(rule.params)][1]
        raise BindError(f"`{rule.name}` takes {len(rule.params)} parameter(s), "
                        f"{len(positional)} given", extra_span)
    for spec, (value, span) in zip(rule.params, positional):
        values[spec.name] = _checked(rule, spec, value, span)
    for name, value, span in keywords:
        if name not in specs:
            raise BindError(f"`{rule.name}` has no parameter `{name}`", span,
                            _did_you_mean(name, list(specs)))
        if name in values:
            raise BindError(f"parameter `{name}` of `{rule.name}` given twice", span)
        values[name] = _checked(rule, specs[name], value, span)
    for spec in rule.params:
        if spec.name not in values:
            if not spec.has_default:
                raise BindError(f"`{rule.name}` needs its parameter `{spec.name}`", None)
            values[spec.name] = spec.default
    return values


def _checked(rule: OpRule, spec: ParamSpec, value, span):
    if value is None and (spec.optional or spec.default is None):
        return value
    if isinstance(value, Unknown):
        return value
    ok = {
        "int": lambda v: isinstance(v, Dim),
        "float": lambda v: isinstance(v, (float, Dim)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "enum": lambda v: isinstance(v, Ident) and v.name in spec.choices,
        "dtype": lambda v: isinstance(v, Ident) and v.name in DTYPES,
        "ints": lambda v: isinstance(v, tuple) and all(isinstance(x, Dim) for x in v),
        "floats": lambda v: isinstance(v, (tuple, list)) and all(
            isinstance(x, (float, int, Dim)) and not isinstance(x, bool) for x in v),
        "string": lambda v: isinstance(v, str),
    }.get(spec.kind, lambda v: True)
    if not ok(value):
        wanted = f"one of {', '.join(spec.choices)}" if spec.kind == "enum" else KIND_NAMES.get(spec.kind, spec.kind)
        helps = _did_you_mean(value.name, spec.choices) if isinstance(value, Ident) else ()
        if spec.kind == "dtype":
            helps = _did_you_mean(getattr(value, "name", ""), DTYPES) + \
                (f"dtypes: {', '.join(DTYPES)}",)
        raise BindError(f"parameter `{spec.name}` of `{rule.name}` must be {wanted}", span, helps)
    if spec.kind in ("float", "floats") and not all(map(_finite, _numbers(value))):
        raise BindError(f"parameter `{spec.name}` of `{rule.name}` is {_shown(value)}: it "
                        "must be a finite number (a 64-bit float)", span, by_value=True)
    if spec.name in NOT_NEGATIVE and spec.kind == "float" and _below_zero(value):
        raise BindError(f"parameter `{spec.name}` of `{rule.name}` is {_shown(value)}: "
                        f"{NOT_NEGATIVE[spec.name]}", span, by_value=True)
    return value


# float parameters that no value below 0 can mean, by name, for every primitive with one
# (found by a gentle fuzz run: Mistral's rms_norm_eps -1 checked and built, and the norm's
# sqrt(mean(x^2) - 1) was nan on random inputs)
NOT_NEGATIVE = {"eps": "a norm adds it to a mean of squares under a square root, so it is "
                       "at least 0 (`1e-6`)"}


def _below_zero(value) -> bool:
    if isinstance(value, Dim):
        return value.is_const and value.value < 0
    return isinstance(value, (int, float)) and value < 0


def _numbers(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _finite(value) -> bool:
    """A number the IR can hold as a float: `1e999` is inf, and an integer past 1.8e308
    has no float at all (both passed check and failed in build or in a shape rule)."""
    if isinstance(value, Dim):
        if not value.is_const:
            return True
        value = value.value
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _shown(value) -> str:
    """A float parameter's value for a message (`inf`, `[1.0, nan]`); an integer as
    `dims.int_text` writes it in one (a list of 56 characters was "an integer of 56
    digits")."""
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(_shown, value)) + "]"
    if isinstance(value, Dim) and value.is_const:
        return int_text(value.value, MESSAGE_DIGITS)
    return str(value)


KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "a boolean (true/false)",
              "dtype": "a dtype", "ints": "a list of integers", "floats": "a list of numbers",
              "string": "a string"}


def _did_you_mean(name: str, candidates) -> tuple[str, ...]:
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return (f"did you mean `{close[0]}`?",) if close else ()
