"""Checking a module instance: its forward graph against its signature, then its backward
graph against the contracts of §5.12 (modulec.check.contracts)."""

from __future__ import annotations

import fnmatch

from modulec.check.contracts import check_backward
from modulec.check.graph import GraphChecker, declared_type
from modulec.check.instance import Instance
from modulec.check.order import defined_names
from modulec.check.scope import GraphScope, Tensor
from modulec.check.world import did_you_mean
from modulec.diagnostics.diagnostic import Label
from modulec.lower.value_marks import mark
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show
from modulec.types.tensor import narrower


def check_body(instance: Instance) -> None:
    """Check the instance's graphs once (instances are shared, so this is memoized)."""
    if instance.checked:
        return
    instance.checked = True
    forward = instance.definition.forward
    if forward is None:
        return
    scope = GraphScope()
    recorder = _recorder(instance)
    for index, sig in enumerate(forward.inputs):
        if sig.name in scope.names:  # `in: (ids, ids: [B, T, int32])`: one value, two types
            _declared_twice(instance, "input", sig, scope.names[sig.name])
            continue
        if sig.type is None and instance.definition.decl.kind == "model" and \
                index >= len(instance.call_inputs):  # the entry point: no caller types it
            _untyped_model_input(instance, sig)
        type_ = _input_type(instance, sig, index)
        value = sig.name
        if recorder is not None:
            recorder.declare(sig.name, type_, sig.name)
            value, type_ = mark(recorder, instance.env(), value, type_, sig.annotations,
                                sig.span)
        scope.names[sig.name] = Tensor(sig.name, type_, sig.span, "input", value=value)
    errors = _error_count(instance)
    if forward.graph is not None:
        checker = GraphChecker(instance, scope, recorder=recorder)
        checker.run(forward.graph.body)
        _check_outputs(instance, forward, scope)
        if _says_anything_about_memory(instance):
            from modulec.check.recompute import check_recompute  # imported only when needed

            check_recompute(instance, checker.producers, checker.uses)
    saved = saved_names(instance, forward, scope)
    if _error_count(instance) == errors:  # else the backward's errors would echo the forward's
        check_backward(instance, scope, saved)


def _untyped_model_input(instance: Instance, sig) -> None:
    """A module's untyped input takes its caller's type; nothing calls a model, so an
    untyped model input would take any tensor a user passes, unchecked."""
    instance.world.error("E003", f"model input `{sig.name}` has no type", sig.span,
                         "no type: nothing calls a model to give it one",
                         help=[f"write its shape and dtype, e.g. `{sig.name}: [B, T, int32]` "
                               "or `" + sig.name + ": [B, d]`"])


def _declared_twice(instance: Instance, what: str, sig, first) -> None:
    instance.world.error("E017", f"{what} `{sig.name}` is declared twice", sig.span,
                         "declared again here", secondary=[Label(first.span, "first here")],
                         help=[f"give each {what} its own name"])


def _error_count(instance: Instance) -> int:
    return sum(1 for d in instance.world.diagnostics if d.is_error)


def _align_star(expected, actual):
    """`[*, d]` declares any leading dims: compare only what follows the `*`."""
    if expected and str(expected[0]) == "*" and len(actual) >= len(expected) - 1:
        rest = len(expected) - 1
        return tuple(expected[1:]), tuple(actual[len(actual) - rest:]) if rest else ()
    return tuple(expected), tuple(actual)


def _input_type(instance: Instance, sig, index: int):
    """The declared type, or while lowering the type its call site passes."""
    passed = instance.call_inputs[index] if index < len(instance.call_inputs) else None
    return passed if passed is not None else declared_type(instance, sig, sig.span)


def _says_anything_about_memory(instance: Instance) -> bool:
    """Recompute legality (E021) and the derived backward's needs (W003) concern modules
    with a save/recompute list or memory annotations; the others have nothing to check."""
    forward = instance.definition.forward
    if forward.save is not None or forward.recompute is not None:
        return True
    graph = forward.graph
    return graph is not None and any(
        note.name in ("memory", "checkpoint")
        for item in graph.body if isinstance(item, A.Flow)
        for step in item.steps for note in step.annotations)


def _recorder(instance: Instance):
    """While lowering, each instance's forward graph is recorded as Graph IR."""
    if not instance.world.recording:
        return None
    from modulec.lower.lowering import function_name
    from modulec.lower.recorder import Recorder

    instance.recorder = Recorder(function_name(instance.world, instance), instance.name)
    return instance.recorder


def _check_outputs(instance: Instance, forward, scope: GraphScope) -> None:
    world, seen = instance.world, {}
    for sig in forward.outputs:
        if sig.name in seen:  # `out: (y, y)`: two outputs, one name (and one `d_y`)
            _declared_twice(instance, "output", sig, seen[sig.name])
            continue
        seen[sig.name] = sig
        tensor = scope.lookup(sig.name)
        if tensor is None:
            world.error("E002", f"the forward graph never computes its output `{sig.name}`",
                        sig.span, "declared here",
                        help=did_you_mean(sig.name, list(scope.names)) or
                        [f"end a flow with `-> {sig.name}`"])
            continue
        _compare_output(instance, sig, tensor)


def _compare_output(instance: Instance, sig, tensor: Tensor) -> None:
    expected = declared_type(instance, sig, sig.span)
    actual = tensor.type
    if not expected.variadic and not actual.variadic and expected.dtype != "float" and \
            expected.is_int != actual.is_int:
        instance.world.error("E015", f"output `{sig.name}` is declared {expected.dtype} but the "
                             f"graph computes a {actual.dtype} tensor", tensor.span,
                             f"{actual.dtype} here", secondary=[_label(sig.span, "declared here")])
        return
    warn_if_narrowing(instance, actual, expected, tensor.span, f"output `{sig.name}`")
    if expected.variadic or actual.variadic:
        return
    expected_dims, actual_dims = _align_star(expected.dims, actual.dims)
    same = instance.assumptions.same
    if len(expected_dims) != len(actual_dims) or any(
            same(a, b) is False for a, b in zip(expected_dims, actual_dims)):
        instance.world.error("E004", f"output `{sig.name}` is declared {expected} but the "
                             f"graph computes {actual}", tensor.span, f"shape {actual}",
                             secondary=[_label(sig.span, f"declared {expected}")],
                             notes=[f"checked as {instance.describe()}"])


def warn_if_narrowing(instance: Instance, actual, expected, span, what: str) -> None:
    """W005: a wider computed dtype stored as a narrower declared one, without a cast."""
    if narrower(expected.dtype, actual.dtype):
        instance.world.warn("W005", f"implicit narrowing: {what} is computed as {actual.dtype} "
                            f"but declared {expected.dtype}", span,
                            f"{actual.dtype} -> {expected.dtype}",
                            help=[f"make the cast explicit with `@dtype({expected.dtype})` on "
                                  "the destination, or declare the wider dtype"])


def saved_names(instance: Instance, forward, scope: GraphScope) -> set[str] | None:
    """Names in the forward's `save:` list (wildcards expanded), or None when there is none."""
    entry = forward.save
    if entry is None or not isinstance(entry.value, A.ListExpr):
        return None
    available = list(scope.names)
    written = defined_names(forward.graph) if forward.graph is not None else set()
    names: set[str] = set()
    for item in entry.value.items:
        pattern = _pattern(item)
        matched = fnmatch.filter(available, pattern)
        # a name of a branch not taken for these parameters is fine; one defined nowhere is not
        if not matched and pattern == show(item) and pattern not in written:
            instance.world.error("E002", f"`save:` names `{pattern}`, which the forward graph "
                                 "does not define", item.span,
                                 help=did_you_mean(pattern, available))
        names |= set(matched)
    return names


def _pattern(item) -> str:
    """`ln*_out` parses as a product and `*_rstd` as a starred name: both are wildcards."""
    if isinstance(item, A.Star):
        return "*" + (item.suffix or "")
    if isinstance(item, A.Binary) and item.op == "*" and all(
            isinstance(s, A.Name) for s in (item.left, item.right)):
        return f"{item.left.id}*{item.right.id}"
    return show(item)


def _label(span, text):
    from modulec.diagnostics import Label

    return Label(span, text)
