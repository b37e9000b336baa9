"""The sizes of a `verify_backward:` section (spec §9.8.1), checked by `modulec check`.

`--verify-backward` builds the declaration with its `shapes:` lines: a parameter's line is
a `--set` (the same rule: modulec.check.given), any other line sizes a dim of the inputs
(a positive integer). What `check` accepts must build and run, so `check` reads them the
same way and checks the declaration at those sizes (its constraints, its graph and its
submodules' graphs, as `build` does), and bounds what --verify-backward would compute
there by its rule (`largest_value`): a `d_model: 30` that breaks `d_model % num_heads
== 0`, a `T: 0`, a `shapes:` line sizing nothing or a `T` too large to verify is an
error here, not when --verify-backward runs. Parameters the section leaves unsized stay
symbolic here
(--verify-backward tries sizes for them and says when none builds).
"""

from __future__ import annotations

import math
from dataclasses import replace

from modulec.check.given import (FREE_DIM_SIZES, MAX_SIZE, OTHER_DIM_SIZE, SEQUENCE_BOUND,
                                  SEQUENCE_DIM, VERIFY_MAX_ELEMENTS, shown, value_problem)
from modulec.check.instance import Stack, Submodule, TensorParamValue, instantiate
from modulec.check.world import TOPOLOGY, World, did_you_mean
from modulec.semantic.consteval import ConstEnv, NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.types.dims import Dim
from modulec.types.tensor import DTYPES


def check_verify_sizes(world: World, decl: A.Decl) -> None:
    shapes = _shapes(decl)
    if shapes is None:
        return
    params = {p.name: p for p in decl.params or ()}
    dims = _input_dims(world, decl, params)
    args, sizes, spans, errors = {}, {}, {}, len(world.diagnostics)
    for entry in shapes.body:
        if not (isinstance(entry, A.Entry) and isinstance(entry.key, A.Name)
                and entry.default is None and entry.value is not None):
            continue  # not `NAME: SIZE`: the section check's E001
        name = entry.key.id
        if name in params:
            args[name] = _parameter(world, entry, params[name])
        elif dims is None or name in dims:
            sizes[name] = _dim(world, entry)
            spans[name] = entry.value.span
        else:
            _sizes_nothing(world, decl, entry, params, dims)
    if len(world.diagnostics) == errors and (args or sizes):
        _check_at(world, decl, args, sizes, spans, shapes.key.span)
    if len(world.diagnostics) == errors and (args or sizes):
        free = {d: FREE_DIM_SIZES.get(d, OTHER_DIM_SIZE) for d in dims or () if d not in sizes}
        _values_within_bound(world, decl, args, {**free, **sizes}, shapes.key.span)


def _shapes(decl: A.Decl) -> A.Section | None:
    for item in decl.body:
        if isinstance(item, A.Section) and _name(item.key) == "verify_backward":
            found = [c for c in item.body if isinstance(c, A.Section) and _name(c.key) == "shapes"]
            return found[-1] if found else None
    return None


def _name(key) -> str | None:
    return key.id if isinstance(key, A.Name) else None


def _input_dims(world: World, decl: A.Decl, params: dict) -> set[str] | None:
    """The dims named in the forward's input types (`[B, T, d_model]`: B, T); None when an
    input has no type (a module's untyped input takes its caller's)."""
    definition = world.definition(decl)
    if definition.forward is None:
        return set()
    known = set(params) | {b.target.id for b in definition.lets if isinstance(b.target, A.Name)}
    dims = set()
    for sig in definition.forward.inputs:
        node = sig.type.value if isinstance(sig.type, A.OptionalType) else sig.type
        if not isinstance(node, A.ListExpr):
            return None
        items = node.items[:-1] if node.items and isinstance(node.items[-1], A.Name) and \
            node.items[-1].id in DTYPES else node.items  # `[B, T, int32]`: no dim `int32`
        dims |= {i.id for i in items if isinstance(i, A.Name) and i.id not in known}
    return dims


def _parameter(world: World, entry: A.Entry, param: A.DeclParam):
    """A parameter's line, read as `--set NAME=VALUE` reads its value."""
    try:
        value = evaluate(entry.value, ConstEnv({}, "ident"))
    except (NotConst, Undefined) as exc:
        world.error("E003", f"the size of `{param.name}` in `shapes:` must be a compile-time "
                    "value", entry.value.span, getattr(exc, "reason", "not a value"))
        return None
    problem = value_problem(param, value)
    if problem is not None:
        world.error(problem.code, f"`shapes:` in `verify_backward:`: {problem.message}",
                    entry.value.span, "not a value of this parameter", help=[problem.help])
    return value


def _dim(world: World, entry: A.Entry) -> int | None:
    value = entry.value
    number = value.value if isinstance(value, A.Number) else None
    if not isinstance(number, int) or isinstance(number, bool):
        world.error("E003", f"the size of dim `{entry.key.id}` in `shapes:` must be an integer",
                    value.span, "not an integer", help=[f"for example `{entry.key.id}: 4`"])
        return None
    if not 1 <= number <= MAX_SIZE:
        world.error("E027", f"dim `{entry.key.id}` sized {number:,} in `shapes:`: a size is "
                    f"from 1 to {MAX_SIZE:,}", value.span, "not a usable size")
        return None
    return number


def _sizes_nothing(world, decl, entry, params, dims) -> None:
    """Found by the fuzz run (seed 5: `T: 6` renamed `graph: 6`): read as a free dim that
    no input has, it sized nothing and the declaration verified at T = 4."""
    name = entry.key.id
    shown = ", ".join(sorted(dims)) or "none"
    world.error("E002", f"`shapes:` sizes `{name}`, which is neither a parameter of "
                f"`{decl.name}` nor a dim of its inputs", entry.key.span, "sizes nothing",
                help=did_you_mean(name, [*params, *dims]) or
                [f"its parameters: {', '.join(params) or 'none'}; its inputs' dims: {shown}"])


def _check_at(world: World, decl: A.Decl, args: dict, sizes: dict, spans: dict,
              shapes_span) -> None:
    """The declaration instantiated and checked at the section's sizes, in a world of its
    own; its errors reported here with a note naming those sizes (one already reported at
    the declaration's own sizes is not repeated)."""
    from modulec.check.driver import check_tree  # the driver imports this module

    sized = World(world.names, world.scopes)
    sized.dims = {**TOPOLOGY, **{k: Dim.const(v) for k, v in sizes.items()}}
    instance = instantiate(sized, sized.definition(decl), args)
    check_tree(instance)
    if decl.kind == "model":  # the weight mapping too: `fuse(..., dim=3)` of a stack that
        from modulec.check.weights import check_weights  # is empty at the defaults

        check_weights(instance)
    _report_errors(world, sized, {**args, **sizes})
    _sequence_within_bound(world, instance, sizes, spans)
    _parameters_within_bound(world, instance, shapes_span)


def _report_errors(world: World, sized: World, values: dict) -> None:
    note = "at the sizes of `verify_backward:` (" + ", ".join(
        f"{k} = {shown(v)[:40]}" for k, v in values.items()) + ")"
    for diagnostic in sized.diagnostics:
        if diagnostic.is_error:
            world.report(replace(diagnostic, notes=(*diagnostic.notes, note)))


def _sequence_within_bound(world: World, instance, sizes: dict, spans: dict) -> None:
    """`T` past the declaration's `max_seq`, as `--shape` refuses it (found by a fuzz run:
    DenseTransformerBlock's `T: 6` made `T: 100000` with `max_seq: 16`, and
    --verify-backward's attention asked for 596 GiB)."""
    bound = instance.values.get(SEQUENCE_BOUND)
    size = sizes.get(SEQUENCE_DIM)
    if size is None or not (isinstance(bound, Dim) and bound.is_const) or size <= bound.value:
        return
    world.error("E027", f"`{SEQUENCE_DIM}: {size:,}` in `shapes:` is longer than "
                f"`{SEQUENCE_BOUND}` ({bound.value:,})", spans[SEQUENCE_DIM],
                f"past {SEQUENCE_BOUND}", help=[f"use {SEQUENCE_DIM}: {bound.value} or less, "
                                                f"or size `{SEQUENCE_BOUND}` in `shapes:`"])


def _parameters_within_bound(world: World, instance, span) -> None:
    """More parameters than --verify-backward checks by finite differences (found by a fuzz
    run: NeoXSelfAttention's `d_model: 32` made `100000`, 40 billion parameters)."""
    count = _parameter_count(instance)
    if count > VERIFY_MAX_ELEMENTS:
        world.error("E027", f"at the sizes of `verify_backward:` `{instance.name}` has "
                    f"{count:,} parameters, more than --verify-backward checks "
                    f"({VERIFY_MAX_ELEMENTS:,})", span,
                    "sizes too large to verify", help=["give it small sizes: finite "
                                                       "differences run the model per element"])


def _parameter_count(instance) -> int:
    """The tensor parameters' elements in the instance tree; an unsized one counts 0 (the
    runtime counts them again)."""
    total = 0
    for value in instance.params.values():
        if isinstance(value, TensorParamValue) and value.tied_to is None:
            dims = value.type.dims
            total += math.prod(d.value for d in dims) if all(d.is_const for d in dims) else 0
        elif isinstance(value, Submodule):
            total += _parameter_count(value.instance)
        elif isinstance(value, Stack) and isinstance(value.count, Dim) and value.count.is_const:
            total += value.count.value * _parameter_count(value.instance)
        if total > VERIFY_MAX_ELEMENTS:
            break
    return total


def _values_within_bound(world: World, decl: A.Decl, args: dict, sizes: dict, span) -> None:
    """The largest value --verify-backward computes, bounded as it bounds it: the
    declaration lowered as it builds it (the input dims the section leaves unsized at
    FREE_DIM_SIZES), by the same rule (`largest_value`), so that what `check` accepts
    --verify-backward runs (a `T` no `max_seq` bounds may be sized past it). A
    declaration that does not lower here is left to --verify-backward (its unsized
    parameters get sizes there)."""
    from modulec.lower.lowering import lower_model, recording_world

    lowering = recording_world(world.names, world.scopes)
    lowering.dims = {**TOPOLOGY, **{k: Dim.const(v) for k, v in sizes.items()}}
    graph = lower_model(lowering, instantiate(lowering, lowering.definition(decl), args))
    largest = None if any(d.is_error for d in lowering.diagnostics) else largest_value(graph)
    if largest is None or math.prod(largest[1]) <= VERIFY_MAX_ELEMENTS:
        return
    value, shape = largest
    world.error("E027", f"at the sizes of `verify_backward:` `{decl.name}` computes `{value}` "
                f"{shape} ({math.prod(shape):,} elements), more than --verify-backward "
                f"checks ({VERIFY_MAX_ELEMENTS:,})", span, "sizes too large to verify",
                notes=["at " + ", ".join(f"{k} = {shown(v)[:40]}" for k, v in
                                         {**args, **sizes}.items())],
                help=["give it small sizes: finite differences run the model per element"])


def largest_value(graph) -> tuple[str, list[int]] | None:
    """(what it is, its shape) of the forward value of `graph` (Graph IR) with the most
    elements among those of known shape, or of a `flash_attention`'s [B, H, T, T] scores
    (the reference kernel's workspace, no graph value: left to the allocator, one too large
    was an error only where the machine refuses it at once, an out-of-memory kill where
    it overcommits); None when none is known. The one rule of `check` at the
    `verify_backward:` sizes and of --verify-backward before it allocates
    (runtime/verify.py)."""
    found = []
    for function in (f for f in graph.functions if not f.gradient_of):
        for value in function.inputs + function.values:
            shape = _known(value.shape)
            if shape is not None:
                found.append((f"{value.name or value.id}` of `{function.name}", shape))
        for node in function.nodes:
            q = _known(function.value(node.inputs[0]).shape) \
                if node.target == "flash_attention" and node.inputs else None
            if q is not None and len(q) == 4:
                found.append((f"{node.target}'s scores` of `{function.name}",
                              [q[0], q[1], q[2], q[2]]))
    return max(found, key=lambda item: math.prod(item[1]), default=None)


def _known(shape) -> list[int] | None:
    try:
        return [int(d) for d in shape]
    except (TypeError, ValueError):  # a dim without a size (a name)
        return None
