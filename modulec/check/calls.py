"""One step of a flow: resolve what is called and compute what it returns.

A step calls a primitive (`rmsnorm(eps)`), a primitive's backward (`swiglu_backward()`),
a module or block (`SwiGLU_MLP(d, f)`), a submodule parameter (`attention`, with or
without parentheses), a slice of a block array (`blocks[0:8]()`), or `StackedBlocks(blocks,
n)`. Positional arguments that name tensors join the inputs after the flow's source;
ConstExpr arguments bind parameters in order; keywords bind by name (§5, issue 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.check.instance import (
    Broken, Instance, Stack, Submodule, TensorParamValue, instantiate_call,
)
from modulec.check.scope import GraphScope, Tensor
from modulec.check.unify import Matcher, ShapeError, pattern_of
from modulec.check.world import did_you_mean
from modulec.resolve.std_index import import_help
from modulec.diagnostics import Label
from modulec.ops.registry import BindError, OpCall, OpRule, bind_params
from modulec.semantic.consteval import ConstEnv, NotConst, Undefined, Unknown, evaluate
from modulec.semantic.decls import TensorSig
from modulec.syntax import ast as A
from modulec.types.tensor import FLOAT, TensorType

UNKNOWN = TensorType((), FLOAT, variadic=True)


@dataclass
class StepContext:
    instance: Instance
    scope: GraphScope
    resolve_tensor: callable  # (expr) -> Tensor | None, without reporting
    dims: dict  # free dimension names of the signature (`B`, `T`) and their symbols

    @property
    def world(self):
        return self.instance.world


@dataclass(frozen=True)
class Result:
    types: list[TensorType]
    accumulate: bool = False
    rule: OpRule | None = None  # the primitive applied (forward), for the derived backward
    inputs: tuple = ()  # the actual inputs, in signature order (None: absent optional)
    callee: object = None  # OpRule (a primitive, or its backward) or Instance (a module)
    params: dict | None = None
    repeat: object = 1
    backward: bool = False


def apply_step(ctx: StepContext, step: A.Step, inputs: list[Tensor]) -> Result | None:
    """Output types of `inputs -> step`, or None after reporting why not."""
    expr = step.expr
    func, args = (expr.func, expr.args) if isinstance(expr, A.Call) else (expr, ())
    tensors, consts = _split_args(ctx, args)
    if tensors is None:
        return None
    inputs = inputs + tensors
    if isinstance(func, A.Name):
        return _call_name(ctx, func, args, consts, inputs, expr)
    if isinstance(func, A.Index) and isinstance(func.value, A.Name):
        return _call_stack_slice(ctx, func, inputs)
    if isinstance(func, A.Attribute) and func.attr == "backward":
        return Result([UNKNOWN] * 8)  # checked by the backward contracts, not here
    if A.qualified_name(func) is not None:
        return _call_qualified(ctx, func, consts, inputs, expr)
    ctx.world.error("E014", "this is not an operation", func.span,
                    help=["a step calls a primitive, a module, or a submodule parameter"])
    return None


# ====================================================================== arguments
def _split_args(ctx: StepContext, args):
    """(tensor inputs, const args) — a tensor argument is any name that is a tensor."""
    tensors, consts = [], []
    for arg in args:
        tensor = ctx.resolve_tensor(arg.value) if arg.key is None else None
        if tensor is not None:
            tensors.append(tensor)
        else:
            consts.append(arg)
    return tensors, consts


def _const_values(ctx: StepContext, consts):
    positional, keywords = [], []
    for arg in consts:
        value = _evaluate_arg(ctx, arg.value)
        if value is _FAILED:
            return None
        if arg.key is None:
            positional.append((value, arg.value.span))
        else:
            keywords.append((getattr(arg.key, "id", str(arg.key)), value, arg.span))
    return positional, keywords


_FAILED = object()


def _evaluate_arg(ctx: StepContext, node):
    values = {**ctx.dims, **ctx.world.dims, **ctx.instance.call_dims, **ctx.instance.values}
    env = ConstEnv(values, "ident", lambda name: ctx.scope.lookup(name) is not None)
    try:
        return evaluate(node, env)
    except NotConst as exc:
        ctx.world.error("E003", "this argument must be a tensor or a compile-time value",
                        exc.node.span, exc.reason)
    except Undefined as exc:
        ctx.world.error("E002", f"undefined name `{exc.node.id}`", exc.node.span,
                        help=did_you_mean(exc.node.id, ()))
    return _FAILED


# ====================================================================== callees
def _call_name(ctx, func: A.Name, args, consts, inputs, expr) -> Result | None:
    name, world = func.id, ctx.world
    param = ctx.instance.params.get(name)
    if isinstance(param, Broken):
        return None
    if isinstance(param, Submodule):
        return call_module(ctx, param.instance, inputs, expr)
    if isinstance(param, Stack):
        return _call_stack(ctx, param, inputs, expr)
    if name == "StackedBlocks":
        return _stacked_blocks(ctx, args, inputs, expr)
    if name in world.ops:
        return _call_primitive(ctx, world.ops[name], consts, inputs, expr, backward=False)
    if name.endswith("_backward") and name[:-9] in world.ops:
        return _call_primitive(ctx, world.ops[name[:-9]], consts, inputs, expr, backward=True)
    decl = world.lookup_decl(name, func.span)
    if decl is not None and decl.kind != "primitive":
        return _call_declared(ctx, decl, consts, inputs, expr)
    if decl is not None:
        return _unimplemented(world, decl, func)
    if world.already_reported(name, func.span):
        return None
    candidates = list(world.ops) + world.candidates(func.span) + list(ctx.instance.params)
    world.error("E014", f"unknown operation `{name}`", func.span,
                "not a primitive, module or submodule",
                help=did_you_mean(name, candidates) + import_help(name))
    return None


def _call_qualified(ctx, func: A.Attribute, consts, inputs, expr) -> Result | None:
    """`x -> F.Proj(d, d)`: a module named through an imported module prefix."""
    name, world = A.qualified_name(func), ctx.world
    decl = world.lookup_decl(name, func.span)
    if decl is not None and decl.kind != "primitive":
        return _call_declared(ctx, decl, consts, inputs, expr)
    if decl is not None:
        return _unimplemented(world, decl, func)
    if not world.already_reported(name, func.span):
        prefix, last = name.rsplit(".", 1)
        world.error("E014", f"unknown operation `{name}`", func.span,
                    f"no module `{last}` under `{prefix}`",
                    help=[_qualified_help(ctx, prefix)])
    return None


def _unimplemented(world, decl: A.Decl, func) -> None:
    """E014 for a call of a user-declared `primitive`: a primitive is an operation the
    backends implement (std/primitives, with kernels in runtime/), and nothing implements
    this one; a declaration alone gives the compiler a signature, not a computation."""
    world.error("E014", f"primitive `{decl.name}` has no implementation, so it cannot be "
                        "called", func.span, "no backend has a kernel for it",
                secondary=[Label(decl.name_span, "declared as a `primitive` here")],
                notes=["the primitives modulec can run are those of std/primitives, each "
                       "with its kernels in runtime/; a `primitive` declared in a program "
                       "has a signature but nothing that computes it"],
                help=[f"write `{decl.name}` as a `module` whose `forward:` graph is made "
                      "of existing operations (its backward is then derived)"])
    return None


def _qualified_help(ctx, prefix: str) -> str:
    """A prefix that is one of this module's own parameters is no import: say so."""
    head = prefix.split(".", 1)[0]
    if head in ctx.instance.params:
        return (f"`{head}` is a parameter of `{ctx.instance.name}`, not an imported module: "
                f"call a submodule by its name (`x -> {head}`), or pass its tensors to an "
                f"op (`({head}.weight, x) -> ...`)")
    return ("a qualified name is an imported module (or its alias) and one of its "
            "declarations: `import std.modules.linear as L`, then `L.Linear(d, d)`")


def _call_declared(ctx, decl: A.Decl, consts, inputs, expr) -> Result | None:
    """A module, block or model called inline: instantiated with the step's arguments.
    Its weights would belong to no parameter of the caller (no name to load them by, no
    place in the checkpoint): a module that holds any is called through a parameter."""
    child = instantiate_call(ctx.instance, decl, consts, expr.span)
    if child is None:
        return None
    weights = _weights(child)
    if weights:
        call = A.qualified_name(expr.func if isinstance(expr, A.Call) else expr) or decl.name
        shown = ", ".join(f"`{w}`" for w in weights[:3]) + (", ..." if len(weights) > 3 else "")
        ctx.world.error("E014", f"`{decl.name}` holds weights ({shown}): it cannot be called "
                        "inline", expr.span, "no parameter of this module owns its weights",
                        help=[f"declare it under `params:` (`{decl.name.lower()}: {call}(...)`) "
                              f"and call it by that name (`x -> {decl.name.lower()} -> y`)"])
        return None
    if child not in ctx.instance.inline_calls:  # checked at these sizes by check_tree
        ctx.instance.inline_calls.append(child)
    return call_module(ctx, child, inputs, expr)


def _weights(instance: Instance, prefix: str = "") -> list[str]:
    """The tensor parameters of an instance and of its submodules, by path."""
    found = []
    for name, value in instance.params.items():
        if isinstance(value, TensorParamValue):
            found.append(prefix + name)
        elif isinstance(value, (Submodule, Stack)):
            found += _weights(value.instance, f"{prefix}{name}.")
    return found


def _call_primitive(ctx, rule: OpRule, consts, inputs, expr, backward: bool) -> Result | None:
    world = ctx.world
    values = _const_values(ctx, consts)
    if values is None:
        return None
    try:
        params = bind_params(rule, *values)
    except BindError as exc:
        if exc.by_value and world.quiet:  # a value from a caller (check_children)
            world.error_unmuted("E003", exc.message, exc.span or expr.span,
                                help=list(exc.help),
                                notes=[f"in {ctx.instance.describe()}"])
        else:
            world.error("E003", exc.message, exc.span or expr.span, help=list(exc.help))
        return None
    phase = rule.definition.backward if backward else rule.definition.forward
    label = f"{rule.name}_backward" if backward else rule.name
    if phase is None:
        world.error("E014", f"`{label}` is not an operation", expr.span)
        return None
    actual = _fit_arity(ctx, label, phase.inputs, inputs, expr)
    if actual is None:
        return None
    call = OpCall(rule, [t.type if t else None for t in actual], params,
                  ctx.instance.assumptions, [s.name for s in phase.inputs])
    types = _shapes(ctx, rule, call, phase, actual, expr, backward)
    accumulate = params.get("accumulate") is True
    if types is None:
        return None
    return Result(types, accumulate, None if backward else rule, tuple(actual), rule, params,
                  backward=backward)


def _shapes(ctx, rule, call, phase, actual, expr, backward):
    try:
        if backward:
            types = _backward_types(ctx, call, phase, actual, expr, rule.name)
        elif rule.shape is not None:
            types = rule.shape(call)
        else:
            types = _by_signature(ctx, ConstEnv(call.params, "error"), phase, actual, expr,
                                  rule.name)
    except ShapeError as exc:
        report_shape_error(ctx, exc, actual, expr, rule.name)
        return None
    return None if _empty_result(ctx, rule.name, types, expr) else types


def _empty_result(ctx, name: str, types, expr) -> bool:
    """A result with a dim below 1 (`split(sizes=[1536, 0, 0])` with Mamba's d_state = 0):
    the Graph IR holds none (sizes are at least 1, as where sizes are bound), and the
    build's verifier refused it (exit 101)."""
    for t in types or ():
        bad = next((d for d in t.dims if d.is_const and d.value < 1), None)
        if bad is not None and not t.variadic:
            ctx.world.error("E027", f"`{name}` makes a tensor of shape {t}: a dimension must "
                            f"be at least 1, this is {bad}", expr.span,
                            notes=[f"in {ctx.instance.describe()}"],
                            help=["check the sizes it reads (parameters, `--set`, defaults)"])
            return True
    return False


def _backward_types(ctx, call, phase, actual, expr, label) -> list[TensorType]:
    """`d_x` has the type of `x`, when the backward reads `x`; the rest by signature (a
    backward's signature is written for the default mode: `transpose=NT` changes which
    operand is which, so the operands' own types are the reliable answer)."""
    given = {sig.name: t.type for sig, t in zip(phase.inputs, actual) if t is not None}
    known = [given.get(sig.name[2:]) if sig.name.startswith("d_") else None
             for sig in phase.outputs]
    if all(t is not None for t in known) and _mode_changed(call):
        return known
    matched = _by_signature(ctx, ConstEnv(call.params, "error"), phase, actual, expr, label)
    return [k if k is not None else m for k, m in zip(known, matched)]


def _mode_changed(call) -> bool:
    """Whether a `transpose` parameter differs from the mode the signature is written in."""
    spec = next((p for p in call.rule.params if p.name == "transpose"), None)
    return spec is not None and call.params.get("transpose") != spec.default


def _fit_arity(ctx, label: str, sigs: tuple[TensorSig, ...], inputs, expr):
    """Inputs in signature order; trailing optional inputs may be left out; a list input
    (`xs: [n] x [*]`, concat's) takes any number of tensors."""
    if len(sigs) == 1 and isinstance(sigs[0].type, A.ArrayType) and inputs:
        return list(inputs)
    required = sum(1 for s in sigs if not s.optional)
    if not required <= len(inputs) <= len(sigs):
        expected = f"{required}" if required == len(sigs) else f"{required} to {len(sigs)}"
        names = ", ".join(s.name + ("?" if s.optional else "") for s in sigs)
        ctx.world.error("E003", f"`{label}` takes {expected} input tensor(s), "
                        f"{len(inputs)} given", expr.span, f"inputs: ({names})",
                        help=["inputs are the flow's source tensors, then tensor arguments"])
        return None
    return list(inputs) + [None] * (len(sigs) - len(inputs))


def _by_signature(ctx, env: ConstEnv, phase, actual, expr, label,
                  callee: Instance | None = None) -> list[TensorType]:
    matcher = Matcher(env, ctx.instance.assumptions)
    dtype = None
    for index, (sig, tensor) in enumerate(zip(phase.inputs, actual)):
        if tensor is not None:
            pattern = pattern_of(sig.type)
            matcher.match(pattern, tensor.type, f"`{sig.name}`", index)
            if dtype is None and tensor.type.is_float and pattern.dtype is None:
                # the first floating input's dtype, the compute dtype (`float`) included:
                # an fp32 parameter (`@dtype(fp32)`) does not move its op's output to fp32,
                # as in the runtimes (runtime/kernels/base.py); statistics do not set it
                dtype = tensor.type.dtype
    dtype = FLOAT if dtype is None else dtype
    matcher.finish()
    if callee is not None and ctx.world.recording and not callee.call_inputs:
        # lowering: the callee's body takes the sizes this call binds (N = B*T, ...) and its
        # inputs the types this call passes (`x: [*, d]` gets the real leading dims)
        callee.call_dims = {k: v for k, v in matcher.bound.items() if k not in callee.values}
        callee.call_inputs = [t.type if t is not None else None for t in actual]
    return [matcher.build(pattern_of(sig.type), dtype, label) for sig in phase.outputs]


def report_shape_error(ctx, exc: ShapeError, actual, expr, label: str) -> None:
    tensor = actual[exc.argument] if exc.argument is not None and exc.argument < len(actual) else None
    span = tensor.span if tensor is not None else expr.span
    secondary = [Label(expr.span, f"in this call to `{label}`")] if tensor is not None else []
    ctx.world.error(exc.code, exc.message, span, exc.label, help=list(exc.help),
                    notes=list(exc.notes), secondary=secondary)


# ====================================================================== modules
def call_module(ctx: StepContext, callee: Instance, inputs, expr, repeat=1) -> Result | None:
    forward = callee.definition.forward
    if forward is None or not forward.inputs:
        return Result([UNKNOWN] * max(1, len(forward.outputs) if forward else 1))
    actual = _fit_arity(ctx, callee.name, forward.inputs, inputs, expr)
    if actual is None:
        return None
    env = callee.env("symbol")
    try:
        types = _by_signature(ctx, env, forward, actual, expr, callee.name, callee)
    except ShapeError as exc:
        report_shape_error(ctx, exc, actual, expr, callee.name)
        return None
    if not forward.outputs:  # lowering would give the call no value to bind (exit 101)
        ctx.world.error("E003", f"`{callee.name}`'s forward declares no outputs, so this call "
                        "has nothing to return", expr.span, "no `out:` in its forward",
                        help=[f"declare them in `{callee.definition.name}`'s `forward:`, "
                              "e.g. `out: [B, T, d_model]`"])
        return None
    return Result(types, inputs=tuple(actual), callee=callee, repeat=repeat)


def _call_stack(ctx, stack: Stack, inputs, expr) -> Result | None:
    return call_module(ctx, stack.instance, inputs, expr, repeat=stack.count)


def _call_stack_slice(ctx, func: A.Index, inputs) -> Result | None:
    stack = ctx.instance.params.get(func.value.id)
    if not isinstance(stack, Stack):
        ctx.world.error("E014", f"`{func.value.id}` is not an array of blocks", func.value.span)
        return None
    return call_module(ctx, stack.instance, inputs, func, repeat=_slice_length(ctx, func, stack))


def _slice_length(ctx, func: A.Index, stack: Stack):
    """`blocks[0:8]` applies 8 blocks; `blocks[3]` one."""
    (sub,) = func.subscripts if len(func.subscripts) == 1 else (None,)
    if not isinstance(sub, A.Slice):
        return 1
    env = ctx.instance.env()
    try:
        lower = evaluate(sub.lower, env) if sub.lower is not None else 0
        upper = evaluate(sub.upper, env) if sub.upper is not None else stack.count
        return upper - lower
    except (NotConst, Undefined):
        return stack.count


def _stacked_blocks(ctx, args, inputs, expr) -> Result | None:
    target = args[0].value if args else None
    stack = ctx.instance.params.get(getattr(target, "id", None))
    if isinstance(stack, Broken):
        return None  # its declaration's error is reported
    if not isinstance(stack, Stack):
        ctx.world.error("E003", "`StackedBlocks` takes an array parameter "
                        "(`blocks: [n] x Block(...)`) and its length", (target or expr).span,
                        help=did_you_mean(getattr(target, "id", ""), [
                            n for n, p in ctx.instance.params.items() if isinstance(p, Stack)]))
        return None
    _check_stack_count(ctx, args, stack, target)
    result = call_module(ctx, stack.instance, inputs, expr, repeat=stack.count)
    if result is not None:
        _check_stackable(ctx, inputs, result, expr)
    return result


def _check_stack_count(ctx, args, stack: Stack, target) -> None:
    """`StackedBlocks(blocks, n)` applies every block of the array: an `n` that surely
    differs from the array's length would be ignored, so it is an error."""
    if len(args) < 2:
        return
    try:
        count = evaluate(args[1].value, ctx.instance.env())
    except (NotConst, Undefined):
        return
    from modulec.types.dims import Dim

    if isinstance(count, Unknown):  # `2 ** n` with n unsized: decided at the model's sizes
        return

    if isinstance(count, bool) or not isinstance(count, (int, Dim)):  # None, a float, ...
        ctx.world.error("E027", f"`StackedBlocks({target.id}, {count})`: the count is not an "
                        f"integer", args[1].value.span,
                        help=[f"pass the array's length: `StackedBlocks({target.id}, "
                              f"{stack.count})`"])
        return
    if isinstance(stack.count, bool) or not isinstance(stack.count, (int, Dim)):
        return  # an array size that is no integer: reported at its declaration
    if ctx.instance.assumptions.same(_as_dim(count), _as_dim(stack.count)) is False:
        ctx.world.error("E027", f"`StackedBlocks({target.id}, {count})`: `{target.id}` holds "
                        f"{stack.count} blocks, and StackedBlocks applies them all",
                        args[1].value.span,
                        help=[f"pass its length (`StackedBlocks({target.id}, "
                              f"{stack.count})`), or apply a slice: "
                              f"`{target.id}[0:{count}]()`"])


def _as_dim(value):
    from modulec.types.dims import Dim

    return value if isinstance(value, Dim) else Dim.const(int(value))


def _check_stackable(ctx, inputs, result: Result, expr) -> None:
    """A stacked block's outputs feed the next block's inputs: they must match."""
    assumptions = ctx.instance.assumptions
    for tensor, output in zip(inputs, result.types):
        if tensor is None or tensor.type.variadic or output.variadic:
            continue
        if len(tensor.type.dims) != len(output.dims) or any(
                assumptions.same(a, b) is False for a, b in zip(tensor.type.dims, output.dims)):
            ctx.world.error("E004", f"a stacked block must return what it takes: "
                            f"input {tensor.type}, output {output}", expr.span)
            return
