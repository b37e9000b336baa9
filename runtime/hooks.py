"""Hooks, probes, trace lines and assertions of the reference runtime (spec §7.3.1 `@hook`,
§7.3.3 `@probe`, §7.7.1 `@assert`, §7.7.3 `@trace`; docs/runtime.md is the user's page).

    hooks = model.hooks
    hooks.observe("AfterMLPActivation", lambda t, ctx: print(ctx.layer, t.std()))
    hooks.modify("AfterMLPActivation", lambda t, ctx: t * 0, layers=[1])
    model.hooks.enable_probes(); model.forward(...); model.probes[("qkv_output", 0)].mean

A hook function is called `fn(tensor, ctx)` (`HookContext`: point, layer, scope, value ...).
Modes (what the function may do, and what the backward does with it):

- `observe`: reads the tensor and returns None; changing it in place is an error.
- `modify`: changes the tensor in place (returns None) or returns a tensor of the same shape,
  dtype and device, which downstream ops read. Gradients pass through a modified value as
  through an identity (straight-through): the backward reads the modified value wherever it
  reads the forward value (also where a written backward recomputes it) and the gradient
  of the value flows unchanged into the op that produced it.
- `replace`: returns a new tensor (same shape, dtype and device) that stands for the op's
  output; the op still runs. A replaced value is not differentiable: a backward after a
  forward in which a replace hook ran is an error.

The runtime calls `Hooks.apply` for every op output and call output (the interpreter's
`_after`); a node without annotations costs one test, and probes, trace lines and hooks
do no work unless enabled or registered.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from runtime.conditions import evaluate, parameter_values
from runtime.errors import RuntimeUserError
from runtime.interpreter import _where
from runtime.probes import ProbeRecord, ProbeSpec, capture, parse_notes, trace_line

MODES = ("observe", "modify", "replace")


@dataclass(frozen=True)
class HookContext:
    """Where a hook function is called."""

    point: str  # the hook point (`AfterMLPActivation`)
    mode: str  # the registration's mode
    layer: int | None  # index in the outermost layer stack (None outside stacks)
    indices: tuple[int, ...]  # indices of every enclosing stack
    scope: str  # parameter path of the instance (`blocks[1].mlp`)
    value: str  # the value id in the IR (`%4`)
    name: str  # its source name (`hidden`)
    op: str  # the op or function producing it (`swiglu`)
    node: str  # node id (`f2`)
    phase: str  # "forward" (hooks run in the forward only)
    span: tuple[str, int, int]  # the source line


@dataclass
class Registration:
    """A registered hook function; `remove()` unregisters it."""

    point: str
    mode: str
    fn: Callable
    layers: frozenset | None
    owner: "Hooks"

    def wants(self, layer: int | None) -> bool:
        return self.layers is None or layer in self.layers

    def remove(self) -> None:
        self.owner.remove(self)


@dataclass
class _Parsed:
    hooks: list  # (point, priority)
    probes: list  # (note, ProbeSpec)
    asserts: list
    traces: list


@dataclass
class _Site:
    """One output of one node in one frame."""

    node: object
    frame: object
    value: str

    @property
    def layer(self) -> int | None:
        return self.frame.indices[0] if self.frame.indices else None

    @property
    def name(self) -> str:
        info = self.frame.function.value(self.value)
        return (info.name if info is not None else "") or self.value

    @property
    def key(self) -> tuple:
        function = self.frame.function
        return (function.gradient_of or function.name, self.frame.path, self.frame.indices)

    def where(self) -> str:
        return f"`{self.name}` = {self.node.target}(...) ({_where(self.node, self.frame)})"

    def concerns(self, note, first_only: bool = False) -> bool:
        """Whether `note` is about this output. A note without `value=` (written on the
        op) or whose value a fusion made internal concerns the first output (probes) or
        the last (assertions: checked once, all outputs bound by name)."""
        if note.value is not None and note.value in self.node.outputs:
            return note.value == self.value
        if first_only:
            return self.value == self.node.outputs[0]
        return self.last_output()

    def last_output(self) -> bool:
        return self.value == [o for o in self.node.outputs if o][-1]


@dataclass
class Hooks:
    """The hook registry and the switches of probes, trace lines and assertions."""

    points: object = None  # the model's hook points: a list, or a callable giving it
    probes: dict = field(default_factory=dict)  # (probe name, layer) -> ProbeRecord
    probes_enabled: bool = False
    assertions_enabled: bool = True
    _registered: dict = field(default_factory=dict)  # point -> [Registration]
    _parsed: dict = field(default_factory=dict)  # id(node) -> (node, _Parsed)
    _trace: dict | None = None  # {"stream", "level", "all_ops"} while tracing
    _step: int = -1  # forward runs while probes were enabled, minus one
    _changed: dict = field(default_factory=dict)  # frame key -> {name: modified tensor}
    _grad_watch: dict = field(default_factory=dict)  # frame key -> {d_name: (spec, layer)}
    _replaced: list = field(default_factory=list)

    # ------------------------------------------------------------------ registration
    def observe(self, point, fn: Callable, layers=None) -> Registration:
        return self.register(point, fn, "observe", layers)

    def modify(self, point, fn: Callable, layers=None) -> Registration:
        return self.register(point, fn, "modify", layers)

    def replace(self, point, fn: Callable, layers=None) -> Registration:
        return self.register(point, fn, "replace", layers)

    def register(self, point, fn: Callable, mode: str = "observe",
                 layers=None) -> Registration:
        """`point`: a hook point name (or anything with `.name`, like an enum member);
        `layers`: None (all), an int, or an iterable of layer indices (a range, a list)."""
        point = str(getattr(point, "name", point))
        if mode not in MODES:
            raise RuntimeUserError(f"hook mode `{mode}` is not one of {', '.join(MODES)}")
        self._check_point(point, self.hook_points())
        chosen = None if layers is None else frozenset(
            [layers] if isinstance(layers, int) else layers)
        registration = Registration(point, mode, fn, chosen, self)
        self._registered.setdefault(point, []).append(registration)
        return registration

    def remove(self, registration: Registration) -> None:
        listed = self._registered.get(registration.point, [])
        if registration in listed:
            listed.remove(registration)

    def clear(self) -> None:
        self._registered.clear()

    def hook_points(self) -> list[str] | None:
        points = self.points() if callable(self.points) else self.points
        return None if points is None else sorted(points)

    def set_points(self, points) -> None:
        """The model's hook points (IR metadata `hook_points`); registered names must be."""
        self.points = sorted(points)
        for point in self._registered:
            self._check_point(point, self.points)

    def _check_point(self, point: str, points: list | None) -> None:
        if points is None or point in points:
            return
        close = difflib.get_close_matches(point, points, 1)
        help = [f"did you mean `{close[0]}`?"] if close else []
        raise RuntimeUserError(f"this model has no hook point `{point}`",
                               help=help + [f"hook points: {', '.join(points) or '(none)'}"])

    # ------------------------------------------------------------------ switches
    def active(self) -> bool:
        """Whether any Python runs per op: hooks, probes or trace lines. (Assertions
        are on by default but only where `@assert` is written.)"""
        return bool(self._registered) or self.probes_enabled or self._trace is not None

    def enable_probes(self) -> None:
        self.probes_enabled = True

    def disable_probes(self) -> None:
        self.probes_enabled = False

    def get_probe(self, name: str, layer: int | None = None) -> ProbeRecord:
        if (name, layer) not in self.probes:
            raise RuntimeUserError(f"probe `{name}` (layer {layer}) has captured nothing",
                                   help=["enable probes before the forward: "
                                         "model.hooks.enable_probes()",
                                         f"captured: {sorted(self.probes, key=str)}"])
        return self.probes[(name, layer)]

    def enable_trace(self, stream=None, level: str | None = None,
                     all_ops: bool = False) -> None:
        """Print `@trace` lines to `stream` (default: stderr); `level` (ops, tensors,
        values) overrides the annotations'; `all_ops` traces every forward op."""
        self._trace = {"stream": stream, "level": level, "all_ops": all_ops}

    def disable_trace(self) -> None:
        self._trace = None

    def enable_assertions(self) -> None:
        self.assertions_enabled = True

    def disable_assertions(self) -> None:
        self.assertions_enabled = False

    # ------------------------------------------------------------------ interpreter side
    def begin(self, phase: str) -> None:
        """Called by the interpreter when a forward or a backward starts."""
        if phase == "forward":
            self._changed, self._grad_watch, self._replaced = {}, {}, []
            self._step += 1 if self.probes_enabled else 0
        elif self._replaced:
            raise RuntimeUserError(
                f"a `replace` hook substituted {self._replaced[0]}; the reference runtime "
                "does not differentiate through replaced values",
                help=["register the hook with `modify` for a straight-through gradient"])

    def apply(self, node, frame, value: str, tensor):
        """The value of `value` downstream, after hooks; probes, assertions and trace."""
        if not isinstance(tensor, Tensor):
            return tensor
        if frame.function.gradient_of:
            return self._backward(_Site(node, frame, value), tensor) \
                if self._changed or self._grad_watch else tensor
        tracing = self._trace is not None and self._trace["all_ops"]
        if not node.annotations and not tracing:
            return tensor
        parsed, site = self._parse(node), _Site(node, frame, value)
        if parsed.hooks and self._registered:
            tensor = self._run_hooks(parsed, site, tensor)
        if parsed.probes and self.probes_enabled:
            self._probe(parsed, site, tensor)
        if parsed.asserts and self.assertions_enabled:
            self._check(parsed, site, tensor)
        if self._trace is not None and (parsed.traces or tracing) and site.last_output():
            self._print_trace(parsed, site, tensor)
        return tensor

    def _parse(self, node) -> _Parsed:
        cached = self._parsed.get(id(node))
        if cached is not None and cached[0] is node:
            return cached[1]
        notes = parse_notes(node.annotations)
        hooks = sorted(((n.positional[0], int(n.text("priority", 0))) for n in notes
                        if n.kind == "hook" and n.positional), key=lambda h: h[1])
        probes = [(n, ProbeSpec.from_note(n)) for n in notes if n.kind == "probe"]
        parsed = _Parsed(hooks, probes,
                         [n for n in notes if n.kind == "assert"],
                         [n for n in notes if n.kind == "trace"])
        self._parsed[id(node)] = (node, parsed)
        return parsed

    # ------------------------------------------------------------------ hooks
    def _run_hooks(self, parsed: _Parsed, site: _Site, tensor: Tensor) -> Tensor:
        changed = False
        for point, _ in parsed.hooks:
            for registration in list(self._registered.get(point, ())):
                if not registration.wants(site.layer):
                    continue
                tensor = self._call(registration, self._context(registration, site), tensor)
                changed = changed or registration.mode != "observe"
                if registration.mode == "replace":
                    self._replaced.append(f"{site.where()} at {point}")
        if changed:
            self._changed.setdefault(site.key, {})[site.name] = tensor
        return tensor

    def _context(self, registration: Registration, site: _Site) -> HookContext:
        node, frame = site.node, site.frame
        return HookContext(registration.point, registration.mode, site.layer, frame.indices,
                           frame.path, site.value, site.name, node.target, node.id,
                           "forward", node.span)

    def _call(self, registration: Registration, ctx: HookContext, tensor: Tensor) -> Tensor:
        version = tensor._version
        result = registration.fn(tensor, ctx)
        what = f"the {registration.mode} hook at {ctx.point} ({ctx.scope or 'model'}, " \
               f"`{ctx.name}`)"
        if registration.mode == "observe":
            if result is not None or tensor._version != version:
                raise RuntimeUserError(f"{what} returned or changed the tensor",
                                       help=["observe hooks only read; register with "
                                             "`modify` to change the value"])
            return tensor
        if result is None:
            if registration.mode == "replace":
                raise RuntimeUserError(f"{what} returned nothing",
                                       help=["a replace hook returns the new tensor"])
            return tensor
        return _checked(result, tensor, what)

    # ------------------------------------------------------------------ probes
    def _probe(self, parsed: _Parsed, site: _Site, tensor: Tensor) -> None:
        for note, spec in parsed.probes:
            if not site.concerns(note, first_only=True):
                continue
            if self._step % max(spec.frequency, 1):
                continue
            if spec.on_gradient:
                watch = self._grad_watch.setdefault(site.key, {})
                for name in {site.name, note.text("on") or site.name}:
                    watch[f"d_{name}"] = (spec, site.layer, name)
            elif spec.condition is None or self._holds(spec.condition, note, site, tensor):
                self._record(spec, site.layer, site.frame.path, site.name, "forward", tensor)

    def _record(self, spec: ProbeSpec, layer, scope: str, name: str, phase: str,
                tensor: Tensor) -> None:
        record = ProbeRecord(spec.name, layer, spec.capture, scope, name, phase, self._step)
        self.probes[(spec.name, layer)] = capture(spec, record, tensor)

    def _backward(self, site: _Site, tensor: Tensor) -> Tensor:
        """In a backward frame: recomputed values take their modified forward value;
        gradients of grad_stats / grad_full probes are captured."""
        changed, watch = self._changed.get(site.key), self._grad_watch.get(site.key)
        if not changed and not watch:
            return tensor
        name = site.name
        if changed and name in changed and changed[name].shape == tensor.shape:
            tensor = changed[name]
        if watch and name in watch:
            spec, layer, _ = watch[name]
            self._record(spec, layer, site.frame.path, name, "backward", tensor)
        return tensor

    # ------------------------------------------------------------------ assertions
    def _check(self, parsed: _Parsed, site: _Site, tensor: Tensor) -> None:
        for note in parsed.asserts:
            if not site.concerns(note) or note.text("enabled", True) is False:
                continue
            condition = note.positional[0] if note.positional else note.text("condition")
            if not self._holds(condition, note, site, tensor):
                message = note.text("message")
                said = f": {message}" if message else ""
                raise RuntimeUserError(f"assertion `{condition}` failed{said} — on "
                                       f"{site.where()}")

    def _holds(self, condition: str, note, site: _Site, tensor: Tensor) -> bool:
        names = parameter_values(site.frame.function.args)
        names.update(self._outputs(site, tensor))
        names[site.name] = tensor
        if note.text("on"):
            names[note.text("on")] = tensor
        names["finite"] = bool(torch.isfinite(tensor).all())
        try:
            return evaluate(condition, names)
        except RuntimeUserError as error:
            raise RuntimeUserError(f"{error.message} (`@{note.kind}` on {site.where()})",
                                   help=error.help) from None

    def _outputs(self, site: _Site, tensor: Tensor) -> dict:
        """The node's outputs computed so far, by source name."""
        env, function = site.frame.env, site.frame.function
        names = {}
        for value in site.node.outputs:
            info = function.value(value) if value else None
            if info is not None and info.name and value in env:
                names[info.name] = env[value]
        return names

    # ------------------------------------------------------------------ trace
    def _print_trace(self, parsed: _Parsed, site: _Site, tensor: Tensor) -> None:
        level = self._trace["level"] or next(
            (str(n.text("level")) for n in parsed.traces if n.text("level")),
            "ops" if parsed.traces else "tensors")
        node, frame = site.node, site.frame
        inputs = [(_source_name(frame, v), frame.env.get(v)) for v in node.inputs if v]
        outputs = [(_source_name(frame, v), tensor if v == site.value else frame.env.get(v))
                   for v in node.outputs if v]
        file, line, _ = node.span
        text = trace_line(level, node.target, frame.path, inputs, outputs,
                          f"{file}:{line}" if file else node.id)
        print(text, file=self._trace["stream"] or sys.stderr)


def _source_name(frame, value: str) -> str:
    if value.startswith("param:"):
        return value[len("param:"):]
    info = frame.function.value(value)
    return (info.name if info is not None else "") or value


def _checked(result, tensor: Tensor, what: str) -> Tensor:
    if not isinstance(result, Tensor):
        raise RuntimeUserError(f"{what} returned a {type(result).__name__}, not a tensor")
    if result.shape != tensor.shape or result.dtype != tensor.dtype \
            or result.device != tensor.device:
        raise RuntimeUserError(
            f"{what} returned a tensor of shape {list(result.shape)}, {result.dtype} on "
            f"{result.device}; the value is {list(tensor.shape)}, {tensor.dtype} on "
            f"{tensor.device}", help=["return a tensor like the one the hook receives"])
    return result
