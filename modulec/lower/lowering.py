"""Checked model instance -> Graph IR.

Lowering re-runs the checker on the model with a `Recorder` attached to every instance's
graph (the checker's walk knows each operation's typed inputs and outputs), then turns
each distinct instance into one `Function`; calls to submodules and stacks of blocks
stay calls (`repeat=n`), so the IR grows with the number of distinct modules, not layers.
"""

from __future__ import annotations

from modulec.check.instance import Instance, Stack, Submodule, TensorParamValue
from modulec.check.module import check_body
from modulec.check.world import World
from modulec.ir.graph import Function, Graph
from modulec.lower.recorder import Recorder, attr_value, value_info
from modulec.lower.training_settings import trainable_settings
from modulec.lower.value_marks import SKIP, gradient_spec
from modulec.ops.registry import OpRule
from modulec.types.dims import Dim


def lower_model(world: World, model: Instance) -> Graph:
    """Forward Graph IR of `model` (an instance created in `world`, with `world.recording`
    set); the passes of modulec.lower.passes take it from there."""
    functions: list[Function] = []
    _lower_tree(world, model, "", functions, set())
    return Graph(model.name, function_name(world, model), "", tuple(functions))


def recording_world(names, scopes) -> World:
    world = World(names, scopes)
    world.recording = True
    world.function_names = {}
    world.param_settings = {}  # function -> parameter -> its @trainable settings
    return world


def _lower_tree(world, instance: Instance, scope: str, out: list, seen: set) -> None:
    if id(instance) in seen:
        return
    seen.add(id(instance))
    check_body(instance)
    for name, value in instance.params.items():
        if isinstance(value, Submodule):
            _lower_tree(world, value.instance, _join(scope, name), out, seen)
        elif isinstance(value, Stack):
            _require_count(world, name, value)
            _lower_tree(world, value.instance, _join(scope, f"{name}[*]"), out, seen)
    for callee in instance.inline_calls:  # `x -> Double() -> y` (recorded by the check)
        _lower_tree(world, callee, _join(scope, callee.name), out, seen)
    recorder = getattr(instance, "recorder", None)
    if recorder is not None:
        forward = _function(world, instance, recorder, scope)
        out.append(forward)
        written = getattr(instance, "backward_recorder", None)
        if written is not None:
            out.append(_written_backward(instance, forward, written))


def _require_count(world: World, name: str, stack: Stack) -> None:
    """A Graph IR call repeats a known number of times: a stack whose size reads a model
    parameter the build gives no value (`model M(n: int)`, no `--set n=...`) cannot be
    lowered (it was a `repeat` of `n` the verifier refused: exit 101)."""
    count = stack.count
    if isinstance(count, Dim) and count.is_const:
        return
    free = sorted(count.symbols()) if isinstance(count, Dim) else []
    wanted = ", ".join(f"`{s}`" for s in free) or "the parameters it reads"
    shown = f" ({count})" if isinstance(count, Dim) else ""  # not `<float>`
    world.error("E012", f"the size of `{name}`{shown} is not known in this build",
                stack.span, "a stack of blocks needs its size",
                help=[f"give {wanted} a default in the model's declaration, or pass "
                      f"{' '.join(f'--set {s}=N' for s in free) or '--set NAME=N'}"])


def _written_backward(instance: Instance, forward: Function, recorder: Recorder) -> Function:
    """A backward graph written in the source, as a backward function."""
    inputs = tuple(recorder.values[f"d:{o}"] for o in forward.outputs
                   if f"d:{o}" in recorder.values)
    outputs = tuple(recorder.names.get(f"d_{i.name or i.id}", "") for i in forward.inputs)
    param_grads = tuple((p.id[len("param:"):], recorder.names[f"d_{p.id[len('param:'):]}"])
                        for p in forward.params if f"d_{p.id[len('param:'):]}" in recorder.names)
    forward_ids = {v.id for v in forward.values + forward.inputs}
    saved = tuple(sorted({i for n in recorder.nodes for i in n.inputs if i in forward_ids}))
    values = tuple(v for k, v in sorted(recorder.values.items(), key=_value_order)
                   if not k.startswith("d:"))
    return Function(f"{forward.name}.backward", forward.module, forward.scope, forward.args,
                    forward.params, inputs, outputs, values, tuple(recorder.nodes), saved,
                    forward.name, param_grads, forward.no_gradient)


def _join(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


def _function(world, instance: Instance, recorder: Recorder, scope: str) -> Function:
    forward = instance.definition.forward
    params = tuple(value_info(f"param:{n}", v.type, n)
                   for n, v in _tensor_params(instance, recorder))
    inputs = tuple(recorder.values[s.name] for s in forward.inputs if s.name in recorder.values)
    outputs = tuple(recorder.names.get(s.name, s.name) for s in forward.outputs)
    args = tuple((p.name, str(attr_value(instance.values.get(p.name))))
                 for p in instance.definition.decl.params or ())
    values = tuple(v for k, v in sorted(recorder.values.items(), key=_value_order)
                   if not any(k == i.id for i in inputs))
    frozen = tuple(sorted(f"param:{n}" for n, v in _tensor_params(instance, recorder)
                          if v.frozen))
    skipped = tuple(s.name for s in forward.inputs  # also cut by their stop_gradient op
                    if (gradient_spec(s.annotations) or ("",))[0] == SKIP)
    env = instance.env()
    world.param_settings[function_name(world, instance)] = {
        n: trainable_settings(v.notes, env) for n, v in _tensor_params(instance, recorder)}
    return Function(function_name(world, instance), instance.name, scope or instance.name, args,
                    params, inputs, outputs, values, tuple(recorder.nodes),
                    no_gradient=frozen + skipped)


def _tensor_params(instance: Instance, recorder: Recorder):
    """Tensor parameters: the instance's own, then submodules' read as `sub.name`
    (`ln1.weight`) by this graph, whose gradients this function therefore computes."""
    for name, value in instance.params.items():
        if isinstance(value, TensorParamValue):
            yield name, value
    used = sorted({i[len("param:"):] for n in recorder.nodes for i in n.inputs
                   if i.startswith("param:") and "." in i})
    for path in used:
        owner, name = path.split(".", 1)
        sub = instance.params.get(owner)
        value = sub.instance.params.get(name) if isinstance(sub, Submodule) else None
        if isinstance(value, TensorParamValue):
            yield path, value


def _value_order(item) -> tuple:
    key = item[0].lstrip("%b")
    return (0, int(key)) if item[0].startswith("%") and key.isdigit() else (1, item[0])


def function_name(world, instance: Instance) -> str:
    names = world.function_names
    if id(instance) not in names:
        count = sum(1 for n in names.values() if n.split("#")[0] == instance.name)
        names[id(instance)] = f"{instance.name}#{count + 1}"
    return names[id(instance)]


def record_call(recorder: Recorder, instance: Instance, step, result, outputs):
    """Give the outputs of one operation value ids and write its node."""
    ids = [recorder.fresh(t.type) for t in outputs]
    inputs = [t.value if t is not None else "" for t in result.inputs]
    callee = result.callee
    if isinstance(callee, OpRule):
        target = f"{callee.name}_backward" if result.backward else callee.name
        attrs = tuple(sorted((k, attr_value(v)) for k, v in (result.params or {}).items()))
        recorder.node("op", target, inputs, ids, step, attrs)
    elif isinstance(callee, Instance):
        world = instance.world
        repeat = attr_value(result.repeat)
        recorder.node("call", function_name(world, callee), inputs, ids, step,
                      attrs=call_path(instance, step.expr), repeat=repeat)
    return [type(t)(t.name, t.type, t.span, t.kind, t.accumulated, v)
            for t, v in zip(outputs, ids)]


def call_path(instance: Instance, expr) -> tuple:
    """Where the callee's parameters live, relative to the caller: `instance` names the
    submodule (`ln_2`) or the array of blocks (`blocks`), and for an array `first` the
    index of the first block applied (`blocks[2:4]` starts at 2). Identical submodules
    share one function, so the call, not the function, says whose parameters it uses."""
    from modulec.semantic.consteval import NotConst, Undefined, evaluate
    from modulec.syntax import ast as A

    if isinstance(expr, A.Call) and getattr(expr.func, "id", "") == "StackedBlocks":
        name = getattr(expr.args[0].value, "id", "") if expr.args else ""
        return (("first", 0), ("instance", name)) if name else ()
    if isinstance(expr, A.Call) and isinstance(expr.func, A.Index) and not expr.args:
        expr = expr.func  # `blocks[0:8]()`: the slice, applied
    if isinstance(expr, A.Index) and isinstance(expr.value, A.Name):
        sub = expr.subscripts[0] if len(expr.subscripts) == 1 else None
        start = sub.lower if isinstance(sub, A.Slice) else sub
        try:
            first = evaluate(start, instance.env()) if start is not None else 0
        except (NotConst, Undefined):
            return ()
        first = first.value if getattr(first, "is_const", False) else first  # a Dim
        return (("first", int(first)), ("instance", expr.value.id))
    if isinstance(expr, A.Name) and isinstance(instance.params.get(expr.id), Submodule):
        return (("instance", expr.id),)
    return ()
