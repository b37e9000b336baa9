"""The Graph IR verifier's second half: every type re-derived from the op table.

A hand-edited document may keep its structure and lie about its types (a matmul's mode
flipped, a shape changed, an int tensor where floats go). For each node the types of its
inputs, as the IR declares them, go through the same rules the checker used (the
primitive's shape rule or signature, modulec.ops.derive; for a call, the callee's own
declared inputs and outputs), and what comes out must be what the IR declares: rank, each
dimension (symbolic dims compared as the checker compares them, modulec.types.sampling)
and dtype. A backward function's gradients must have the types of what they differentiate.
Each node is checked once against tables built once per function: linear in the IR.
"""

from __future__ import annotations

import math

from modulec.check.instance import MAX_DIM, MAX_ELEMENTS
from modulec.check.unify import ShapeError
from modulec.ir.graph import Function, Node, ValueInfo
from modulec.ops.derive import output_types
from modulec.ops.registry import BindError, OpCall, bind_params, op_table
from modulec.semantic.consteval import Ident, Unknown
from modulec.syntax import ast as A
from modulec.types.dim_text import parse_dim
from modulec.types.dims import Dim
from modulec.types.sampling import Assumptions
from modulec.types.tensor import DTYPES, FLOAT, TensorType

# attrs the passes add beside the primitive's parameters (modulec.lower.fusion, backward)
STRUCTURAL_ATTRS = ("fusion", "fused_from", "fused_spans", "fused_intermediates",
                    "fusion_group", "forward_node", "stream")


class Types:
    """The declared type of every value a function can read, parsed once; a backward
    function reads its forward's values through the forward's own table."""

    def __init__(self, function: Function, outer: "Types | None" = None):
        self.infos: dict[str, ValueInfo] = {}
        for value in function.params + function.inputs + function.values:
            self.infos[value.id] = value
        self.outer = outer
        self._parsed: dict[str, TensorType | str] = {}

    def declares(self, value: str) -> bool:
        return value in self.infos or (self.outer is not None and self.outer.declares(value))

    def of(self, value: str) -> TensorType | str | None:
        """The value's type; the first time it has none, a sentence saying why (after
        that None: one report per value, not one per use)."""
        if value not in self.infos and self.outer is not None and self.outer.declares(value):
            return self.outer.of(value)
        if value not in self._parsed:
            info = self.infos.get(value)
            self._parsed[value] = _tensor_type(info) if info is not None else \
                f"`{value}` has no declared type"
            return self._parsed[value]
        found = self._parsed[value]
        return None if isinstance(found, str) else found

    def correct(self, value: str, derived: TensorType) -> None:
        """After reporting a declared type, later nodes read the derived one: the report
        names the first wrong node, not every node after it."""
        self._parsed[value] = derived


def _tensor_type(info: ValueInfo) -> TensorType | str:
    """A leading `*` stays a `*` (leading dims bound when the function runs: a module
    built alone for `--verify-backward`, a submodule nothing calls)."""
    if info.dtype != FLOAT and info.dtype not in DTYPES:
        return f"`{info.id}` has dtype `{info.dtype}`, not one of float, {', '.join(DTYPES)}"
    shape, variadic = info.shape, bool(info.shape) and info.shape[0] == "*"
    try:
        dims = tuple(_dim(d) for d in shape[variadic:])
    except ValueError as exc:
        return f"the shape of `{info.id}`: {exc}"
    if any(d.is_const and d.value < 0 for d in dims):
        return f"`{info.id}` has a negative dimension: [{', '.join(shape)}]"
    if any(d.is_const and d.value == 0 for d in dims):
        return f"`{info.id}` has a dimension 0 (sizes are at least 1): [{', '.join(shape)}]"
    if any(d.is_const and d.value > MAX_DIM for d in dims):
        return f"`{info.id}` has a dimension above the limit {MAX_DIM}: [{', '.join(shape)}]"
    if math.prod(d.value for d in dims if d.is_const) > MAX_ELEMENTS:
        return f"`{info.id}` has more than {MAX_ELEMENTS} elements: [{', '.join(shape)}]"
    return TensorType(dims, info.dtype, variadic)


def _dim(text) -> Dim:
    if not isinstance(text, str):
        raise ValueError(f"`{text!r}` is not a dimension")
    return parse_dim(text)


# ====================================================================== one function
class IRAssumptions(Assumptions):
    """What the verifier may assume of symbolic dims. A module parameter left symbolic
    (`num_heads` of a module built alone) had constraints in the source that the IR does
    not carry (`num_heads % num_kv_heads == 0`): a comparison that involves one is decided
    only when the algebra decides it (equal normal forms, a constant difference). Free
    dims (`B`, `T`) have no constraints: sampled, as `check` does."""

    def __init__(self, constrained: frozenset):
        super().__init__()
        self.constrained = constrained

    def same(self, a: Dim, b: Dim) -> bool | None:
        if a == b:
            return True
        difference = a - b
        if not difference.is_const and difference.symbols() & self.constrained:
            return None
        return self.same_difference(difference)


def graph_assumptions(graph) -> IRAssumptions:
    """The symbols of the graph's module parameters (each function's `args`)."""
    constrained = set()
    for function in graph.functions:
        for _, text in function.args:
            try:
                constrained |= parse_dim(text).symbols()
            except (ValueError, TypeError):
                continue  # a number, a boolean, None: no symbol
    return IRAssumptions(frozenset(constrained))


def type_problems(function: Function, functions: dict, tables: dict,
                  assumptions: Assumptions) -> list[tuple[int | None, str]]:
    """(node index or None for the function itself, message) for each type that is not
    what the op table derives. `tables` keeps each function's Types across calls (a
    callee's, a forward's: parsed once, corrected once); `assumptions`: the graph's
    (graph_assumptions)."""
    def table(f: Function, outer=None) -> Types:
        if f.name not in tables:
            tables[f.name] = Types(f, outer)
        return tables[f.name]

    forward = functions.get(function.gradient_of) if function.gradient_of else None
    types = table(function, table(forward) if forward else None)
    forward_nodes = {n.id: n for n in forward.nodes} if forward is not None else {}
    problems = []
    for index, node in enumerate(function.nodes):
        origin = forward_nodes.get(node.attr("forward_node"))
        if node.kind == "op" and origin is not None and origin.kind == "op":
            found = _derived_backward_types(node, origin, types, assumptions)
        elif node.kind == "op":
            found = _op_types(node, types, assumptions)
        elif node.kind == "call" and node.target in functions:
            found = _call_types(node, types, table(functions[node.target]),
                                functions[node.target], assumptions)
        else:
            found = []
        problems += [(index, message) for message in found]
    if forward is not None:
        problems += [(None, m) for m in _gradient_types(function, forward, types, assumptions)]
    return problems


def _op_types(node: Node, types: Types, assumptions: Assumptions) -> list[str]:
    backward = node.target.endswith("_backward")
    rule = op_table().get(node.target[:-9] if backward else node.target)
    if rule is None:
        return []  # reported by the structural checks
    phase = rule.definition.backward if backward else rule.definition.forward
    if phase is None:
        return []
    try:
        params = bind_params(rule, [], [(k, _param_value(rule, k, v), None)
                                        for k, v in node.attrs if k not in STRUCTURAL_ATTRS])
    except BindError as exc:
        return [exc.message + "".join(f" ({h})" for h in exc.help)]
    inputs, problems = _input_types(node, phase, types, backward)
    if problems:
        return [p for p in problems if p]
    call = OpCall(rule, inputs, params, assumptions, [s.name for s in phase.inputs])
    try:
        derived = output_types(call, backward)
    except ShapeError as exc:
        prefix = "" if exc.message.startswith(f"`{node.target}") else f"`{_op_text(node)}`: "
        return [prefix + exc.message + "".join(f" ({h})" for h in exc.help)]
    except (TypeError, AttributeError, ValueError) as exc:  # a hand-edited attr of odd kind
        return [f"`{node.target}`: its types cannot be derived from its attributes "
                f"({type(exc).__name__}: {exc})"]
    if derived is None:
        return []
    return _compare(node, node.outputs, derived, types, assumptions, _op_text(node))


def _derived_backward_types(node: Node, origin: Node, types: Types, assumptions) -> list[str]:
    """A backward op derived from forward node `origin` (modulec.lower.backward): each
    gradient it reads or writes has the type of the forward value it is the gradient of,
    each forward value it reads the type of that value."""
    rule = op_table().get(origin.target)
    if rule is None or rule.definition.backward is None or \
            node.target != f"{origin.target}_backward":
        return [f"`{node.target}` is not the backward of forward node {origin.id} "
                f"(`{origin.target}`)"]
    forward, backward = rule.definition.forward, rule.definition.backward
    named, lists = _forward_values(forward, origin)
    reads = _counterparts(backward.inputs, named, lists)
    writes = _counterparts(backward.outputs, named, lists)
    problems = []
    if len(reads) != len(node.inputs):
        problems.append(f"`{node.target}` of {origin.id} takes {_count(reads, 'input')}, the "
                        f"node has {len(node.inputs)}")
    if len(writes) != len(node.outputs):
        problems.append(f"`{node.target}` of {origin.id} returns {_count(writes, 'value')}, "
                        f"the node binds {len(node.outputs)}")
    if problems:
        return problems
    what = f"{node.target} of {origin.id}"
    for value, (source, gradient) in list(zip(node.inputs, reads)) + \
            list(zip(node.outputs, writes)):
        if value and source:
            expected = _gradient_of(types.of(source)) if gradient else types.of(source)
            problems += _mismatch(value, types.of(value), expected, assumptions,
                                  f"{what}, for `{source}`,", "expects")
    return problems


def _forward_values(signature, node: Node) -> tuple[dict, dict]:
    """The forward node's values by signature name, and its list parameters' values."""
    named = {sig.name: v for sig, v in zip(signature.inputs, node.inputs) if v}
    named.update({sig.name: v for sig, v in zip(signature.outputs, node.outputs) if v})
    lists = {}
    for sigs, values in ((signature.inputs, node.inputs), (signature.outputs, node.outputs)):
        if len(sigs) == 1 and isinstance(sigs[0].type, A.ArrayType):
            lists[sigs[0].name] = list(values)
    return named, lists


def _counterparts(sigs, named: dict, lists: dict) -> list[tuple[str | None, bool]]:
    """Per backward input (or output) position, the forward value whose type it has and
    whether it is that value's gradient: `d_x` (x, True), `x` itself (x, False); None where
    the signature names no forward value."""
    found = []
    for sig in sigs:
        gradient = sig.name.startswith("d_")
        name = sig.name[2:] if gradient else sig.name
        if isinstance(sig.type, A.ArrayType) and name in lists:
            found += [(value, gradient) for value in lists[name]]
        else:
            found.append((named.get(name), gradient))
    return found


def _input_types(node: Node, phase, types: Types, backward: bool):
    """The declared input types in signature order (None: absent), or the problems."""
    sigs = phase.inputs
    listed = len(sigs) == 1 and isinstance(sigs[0].type, A.ArrayType)
    problems = []
    for position, sig in enumerate(() if listed else sigs):
        # a backward may lack a gradient (`d_y` of an output nothing reads): zero
        absent = position >= len(node.inputs) or (
            not node.inputs[position] and not (backward and sig.name.startswith("d_")))
        if absent and not sig.optional:
            problems.append(f"`{node.target}` needs its input `{sig.name}` "
                            f"(input {position + 1}), which is missing")
    inputs = []
    for value in node.inputs:
        found = types.of(value) if value else None
        if found is None and value:
            problems.append("")  # reported before: skip the node silently
        elif isinstance(found, str):
            problems.append(found)
        inputs.append(found if not isinstance(found, str) else None)
    if not listed:
        inputs += [None] * (len(sigs) - len(inputs))
    return inputs, problems


def _call_types(node: Node, types: Types, own: Types, callee: Function,
                assumptions) -> list[str]:
    problems = []
    if len(node.inputs) != len(callee.inputs):
        problems.append(f"`{callee.name}` takes {_count(callee.inputs, 'input')}, the call "
                        f"passes {len(node.inputs)}")
    if len(node.outputs) != len(callee.outputs):
        problems.append(f"`{callee.name}` returns {_count(callee.outputs, 'value')}, the call "
                        f"binds {len(node.outputs)}")
    if problems:
        return problems
    what = f"call {callee.name}"
    for value, declared in zip(node.inputs, callee.inputs):
        if value:
            problems += _mismatch(value, types.of(value), own.of(declared.id), assumptions,
                                  f"{what} (its input `{declared.id}`)", "passed")
    expected = [own.of(o) if o else None for o in callee.outputs]
    for value, derived in zip(node.outputs, expected):
        if value and derived is not None and not isinstance(derived, str):
            found = _mismatch(value, types.of(value), derived, assumptions, what)
            if found:
                types.correct(value, derived)
            problems += found
    return problems


def _gradient_types(function: Function, forward: Function, types: Types,
                    assumptions) -> list[str]:
    """A backward's outputs are the gradients of its forward's inputs, its `grads` those of
    the parameters, its inputs those of the forward's outputs: each of the same type."""
    problems = []
    pairs = list(zip(function.outputs, (i.id for i in forward.inputs)))
    pairs += [(gradient, f"param:{param}") for param, gradient in function.param_grads]
    pairs += [(i.id, i.id[2:]) for i in function.inputs if i.id.startswith("d:")]
    for gradient, value in pairs:
        if gradient and types.declares(value):
            expected = _gradient_of(types.of(value))
            if expected is not None and not isinstance(expected, str):
                problems += _mismatch(gradient, types.of(gradient), expected, assumptions,
                                      f"the gradient of `{value}`", "is")
    return problems


def _gradient_of(type_):
    """A gradient has its value's type. An int value (indices) has no gradient: the
    placeholder passed for one (float when derived, as declared when written) is not
    compared (None)."""
    if isinstance(type_, TensorType) and type_.is_int:
        return None
    return type_


# ====================================================================== comparing
def _compare(node: Node, outputs, derived, types: Types, assumptions, what: str) -> list[str]:
    if len(outputs) != len(derived):
        return [f"`{node.target}` returns {_count(derived, 'value')}, the node binds "
                f"{len(outputs)}"]
    problems = []
    for value, expected in zip(outputs, derived):
        if value:
            found = _mismatch(value, types.of(value), expected, assumptions, what)
            if found and not isinstance(expected, str) and not expected.variadic:
                types.correct(value, expected)
            problems += found
    return problems


def _mismatch(value: str, declared, expected, assumptions, what: str,
              verb: str = "gives") -> list[str]:
    """[] when `declared` (the IR's type of `value`) is what `expected` says."""
    if isinstance(declared, str) or isinstance(expected, str):
        return [declared if isinstance(declared, str) else expected]
    if declared is None or expected is None or expected.variadic:
        return []  # reported before, or the op table cannot say: nothing to compare
    if not _differs(declared, expected, assumptions):
        return []
    if verb == "passed":
        return [f"`{value}` is passed to {what}, of type {expected}; `{value}` is declared "
                f"{declared}"]
    return [f"`{value}` is declared {declared}, but {what} {verb} {expected}"]


def _differs(declared: TensorType, expected: TensorType, assumptions) -> bool:
    if declared.is_int != expected.is_int:
        return True
    if FLOAT not in (declared.dtype, expected.dtype) and declared.dtype != expected.dtype:
        return True
    dims, wanted = declared.dims, expected.dims
    if declared.variadic:  # `[*, d]`: the dims after the `*`
        if len(dims) > len(wanted):
            return True
        wanted = wanted[len(wanted) - len(dims):]
    if len(dims) != len(wanted):
        return True
    return any(not _fresh(e) and assumptions.same(d, e) is False for d, e in zip(dims, wanted))


def _fresh(dim: Dim) -> bool:
    """A dim the signature left unbound (`matmul.N`): the op table does not know it."""
    return any("." in symbol for symbol in dim.symbols())


# ====================================================================== attrs
def _param_value(rule, name: str, value):
    """An attr as the IR stores it (modulec.lower.recorder.attr_value) read back as the
    value bind_params takes: dims as Dim, enum members and dtypes as Ident."""
    spec = next((p for p in rule.params if p.name == name), None)
    kind = spec.kind if spec is not None else "any"
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return Unknown(value[1:-1])
    if kind in ("enum", "dtype"):
        return Ident(value) if isinstance(value, str) else value
    if kind == "ints" and isinstance(value, list):
        return tuple(_as_dim(v) for v in value)
    if kind == "int":
        return _as_dim(value)
    if kind == "float" and isinstance(value, int):
        return float(value)
    if kind == "float" and isinstance(value, str):
        return _as_dim(value)
    return value


def _as_dim(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return Dim.const(value)
    if isinstance(value, str):
        try:
            return _dim(value)
        except ValueError:
            return value  # bind_params says what kind it wanted
    return value


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _op_text(node: Node) -> str:
    mode = node.attr("transpose")
    return f"{node.target}(transpose={mode})" if mode else node.target
