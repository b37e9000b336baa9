"""Backward contracts (§5.12): every required gradient computed (E005) with the shape (E018)
and dtype class (E020) of what it differentiates, `saved.x` only for saved tensors (E006),
no cycles (E019, in the graph checker), saved tensors used (W004).

A module without a `backward:` section gets a derived backward (lowering, issue 4): the
contracts apply to backward graphs written by hand.
"""

from __future__ import annotations

from modulec.check.graph import GraphChecker, declared_type
from modulec.check.instance import Instance, Submodule, TensorParamValue
from modulec.check.scope import GraphScope, Tensor
from modulec.diagnostics import Label
from modulec.syntax import ast as A
from modulec.syntax.walk import tree_nodes


def check_backward(instance: Instance, forward_scope: GraphScope, saved: set[str] | None):
    definition = instance.definition
    backward = definition.backward
    if backward is None or backward.graph is None or definition.kind == "primitive":
        return
    recorder = _backward_recorder(instance)
    scope = _backward_scope(instance, forward_scope, recorder)
    checker = GraphChecker(instance, scope, backward=True, saved=saved,
                           forward_types=dict(forward_scope.names), recorder=recorder)
    checker.run(backward.graph.body)
    covered = _covered_submodules(backward.graph.body)
    _required_gradients(instance, forward_scope, scope, covered, backward)
    _declared_gradients(instance, scope, backward)
    _unused_saves(instance, backward, saved)


def _backward_recorder(instance: Instance):
    """While lowering, a written backward graph is recorded as the instance's backward
    function, kept as written (the derive pass leaves such functions alone)."""
    forward_recorder = getattr(instance, "recorder", None)
    if forward_recorder is None:
        return None
    from modulec.lower.recorder import Recorder

    instance.backward_recorder = Recorder(f"{forward_recorder.function}.backward",
                                          instance.name, phase="backward")
    return instance.backward_recorder


def _backward_scope(instance: Instance, forward_scope: GraphScope, recorder) -> GraphScope:
    """Gradients of the forward outputs (`d_out`) come in; parameters stay visible."""
    scope = GraphScope()
    forward = instance.definition.forward
    for sig in forward.outputs if forward else ():
        tensor = forward_scope.lookup(sig.name)
        type_ = tensor.type if tensor else declared_type(instance, sig, sig.span)
        name = f"d_{sig.name}"
        value = f"d:{tensor.value}" if tensor is not None and tensor.value else ""
        scope.names[name] = Tensor(name, type_, sig.span, "input", value=value)
        if recorder is not None and value:
            recorder.declare(value, type_, name)
    return scope


def _required(instance: Instance, forward_scope: GraphScope):
    """(gradient name, what it differentiates, its tensor) for inputs and trainable params."""
    forward = instance.definition.forward
    for sig in forward.inputs if forward else ():
        skip = any(a.name == "gradient" and _first_arg(a) == "skip" for a in sig.annotations)
        tensor = forward_scope.lookup(sig.name)
        if not skip and tensor is not None and not tensor.type.is_int:
            yield f"d_{sig.name}", f"input `{sig.name}`", tensor
    for name, value in instance.params.items():
        if isinstance(value, TensorParamValue) and not value.frozen and value.tied_to is None:
            yield f"d_{name}", f"parameter `{name}`", Tensor(name, value.type, value.span, "param")


def _required_gradients(instance, forward_scope, scope, covered, backward) -> None:
    for gradient, what, tensor in _required(instance, forward_scope):
        if scope.lookup(gradient) is None:
            instance.world.error(
                "E005", f"the backward graph does not compute `{gradient}`, the gradient of "
                f"{what}", backward.span, f"`{gradient}` missing from this backward",
                secondary=[Label(tensor.span, f"{what} declared here")],
                help=[f"compute it (`... -> {gradient}`), or mark the "
                      + ("input `@gradient(skip)`" if what.startswith("input") else
                         "parameter `@frozen`") + " if it needs no gradient"])
            continue
        _compare_gradient(instance, scope.lookup(gradient), tensor, what)
    for name, value in instance.params.items():
        if isinstance(value, Submodule) and name not in covered:
            _submodule_gradients(instance, scope, name, value, backward)


def _submodule_gradients(instance, scope, name, sub: Submodule, backward) -> None:
    for param, value in sub.instance.params.items():
        if isinstance(value, TensorParamValue) and not value.frozen:
            gradient = f"d_{name}_{param}"
            if scope.lookup(gradient) is None:
                instance.world.error(
                    "E005", f"the backward graph does not compute `{gradient}`, the gradient "
                    f"of `{name}.{param}`", backward.span, f"`{gradient}` missing",
                    help=[f"compute `{gradient}`, or call `{name}.backward()`"])


def _compare_gradient(instance, gradient: Tensor, original: Tensor, what: str) -> None:
    if gradient.type.variadic or original.type.variadic:
        return
    if gradient.type.is_int:
        instance.world.error("E020", f"`{gradient.name}` is {gradient.type.dtype}, but the "
                             f"gradient of {what} must be a floating tensor", gradient.span)
        return
    same = instance.assumptions.same
    if len(gradient.type.dims) != len(original.type.dims) or any(
            same(a, b) is False for a, b in zip(gradient.type.dims, original.type.dims)):
        instance.world.error("E018", f"`{gradient.name}` has shape {gradient.type}, but "
                             f"{what} has shape {original.type}", gradient.span,
                             f"shape {gradient.type}",
                             secondary=[Label(original.span, f"shape {original.type}")])


def _declared_gradients(instance, scope, backward) -> None:
    for sig in backward.inputs + backward.outputs:
        tensor = scope.lookup(sig.name)
        declared = declared_type(instance, sig, sig.span)
        if tensor is None or tensor.type.variadic or declared.variadic:
            continue
        same = instance.assumptions.same
        if len(declared.dims) != len(tensor.type.dims) or any(
                same(a, b) is False for a, b in zip(declared.dims, tensor.type.dims)):
            instance.world.error("E018", f"`{sig.name}` is declared {declared} but the backward "
                                 f"computes {tensor.type}", tensor.span,
                                 secondary=[Label(sig.span, f"declared {declared}")])


def _unused_saves(instance, backward, saved: set[str] | None) -> None:
    forward = instance.definition.forward
    if saved is None or forward is None or forward.save is None:
        return
    used = _saved_uses(backward.graph.body)
    for item in forward.save.value.items:
        if isinstance(item, A.Name) and item.id not in used:
            instance.world.warn("W004", f"`{item.id}` is saved but the backward never reads "
                                f"`saved.{item.id}`", item.span, "saved for nothing",
                                help=["remove it from `save:` to free its memory"])


def _saved_uses(items) -> set[str]:
    found: set[str] = set()
    for node in _walk(items):
        if isinstance(node, A.Attribute) and getattr(node.value, "id", None) == "saved":
            found.add(node.attr)
    return found


def _covered_submodules(items) -> set[str]:
    """Submodules whose `.backward()` the graph calls: that call yields all their gradients."""
    found: set[str] = set()
    for node in _walk(items):
        if isinstance(node, A.Attribute) and node.attr == "backward" and \
                isinstance(node.value, A.Name):
            found.add(node.value.id)
    return found


def _walk(node):
    return tree_nodes(node)


def _first_arg(annotation: A.Annotation) -> str | None:
    if not annotation.args:
        return None
    value = annotation.args[0].value
    return value.id if isinstance(value, A.Name) else None

