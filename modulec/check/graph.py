"""Checking one graph: names, order, operations, types, destinations.

Statements run in dependency order, not in the order written (§5.11.5): the checker
orders them topologically first (a cycle is E007, or E019 in a backward graph), then
checks each flow: its source, each operation in turn, and the destination, whose arity
must match (§5.4, `_` discards). `if` guards are ConstExpr (E016); a guard known at
compile time selects its branch, an undecided one checks both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.check.calls import UNKNOWN, StepContext, apply_step
from modulec.check.indexing import index_tensor
from modulec.check.instance import (Broken, Instance, Submodule, TensorParamValue, guard,
                                    tensor_type)
from modulec.check.order import order_statements
from modulec.check.scope import GraphScope, Tensor
from modulec.check.world import did_you_mean
from modulec.diagnostics import Label
from modulec.lower.value_marks import cast_of, mark
from modulec.ops.registry import backward_gradients
from modulec.syntax import ast as A
from modulec.types.dims import Dim
from modulec.types.tensor import TensorType


@dataclass
class GraphChecker:
    instance: Instance
    scope: GraphScope
    backward: bool = False
    saved: set[str] | None = None  # names `saved.x` may use (None: any forward tensor)
    forward_types: dict[str, Tensor] = field(default_factory=dict)
    dims: dict = field(default_factory=dict)  # free dims of the signature (`B`, `T`)
    producers: dict = field(default_factory=dict)  # name -> the flow that defines it
    uses: list = field(default_factory=list)  # (primitive rule, inputs, output names, span)
    in_recompute: bool = False
    _last_use: tuple | None = None
    recorder: object = None  # a modulec.lower.recorder.Recorder while lowering

    def __post_init__(self) -> None:
        for tensor in self.scope.names.values():
            for dim in tensor.type.dims:
                for symbol in dim.symbols() - set(self.instance.values):
                    self.dims[symbol] = Dim.sym(symbol)

    @property
    def world(self):
        return self.instance.world

    def run(self, items, cycle_code: str | None = None) -> None:
        statements = [i for i in items if isinstance(i, (A.Flow, A.Step, A.IfBlock, A.Section))]
        cycle_code = cycle_code or ("E019" if self.backward else "E007")
        ordered, cyclic = order_statements(statements, self.world, cycle_code)
        for name in cyclic:  # reported once as a cycle: no "undefined" errors on top
            self.scope.names.setdefault(name, Tensor(name, UNKNOWN, A.NO_SPAN, "pending"))
        for statement in ordered:
            self.statement(statement)

    # ------------------------------------------------------------ statements
    def statement(self, item) -> None:
        if isinstance(item, A.Flow):
            self.flow(item)
        elif isinstance(item, A.IfBlock):
            self.if_block(item)
        elif isinstance(item, A.Section) and item.name == "recompute":
            outer, self.in_recompute = self.in_recompute, True
            self.run(item.body, "E022")
            self.in_recompute = outer
        elif isinstance(item, A.Step):
            self.world.error("E003", "a statement must flow somewhere: `source -> op() -> dest`",
                             item.span)

    def flow(self, flow: A.Flow) -> None:
        start = len(self.recorder.nodes) if self.recorder is not None else 0
        values = self.source(flow.source.expr)
        self._last_use = None
        for step in flow.operations:
            values = self.operation(step, values)
        self.destination(flow, flow.destination, values)
        if self.recorder is not None:
            self.recorder.flow_annotations(start, flow.destination)
        names = [n for n, _, _ in self.targets(flow.destination.expr) or []]
        for name in names:
            self.producers.setdefault(name, flow)
        if self._last_use is not None:
            rule, inputs, span = self._last_use
            self.uses.append((rule, inputs, names, span))

    def if_block(self, block: A.IfBlock) -> None:
        verdict = self.guard(block.test)
        if verdict is True or verdict is False:
            branch = block.body if verdict else (block.orelse or ())
            self.run(branch)
            return
        self._both_branches(block)

    def _both_branches(self, block: A.IfBlock) -> None:
        outer, branches = self.scope, []
        for body in (block.body, block.orelse or ()):
            self.scope = GraphScope(outer)
            self.run(body)
            branches.append(self.scope.names)
        self.scope = outer
        for name in branches[0].keys() & branches[1].keys():
            outer.names[name] = branches[0][name]
        for name in branches[0].keys() ^ branches[1].keys():
            tensor = branches[0].get(name) or branches[1].get(name)
            outer.names[name] = Tensor(name, UNKNOWN, tensor.span, "conditional")

    def guard(self, test: A.Expr):
        return guard(self.instance, test, "guards select graphs at compile time; branch on "
                     "module parameters or `let` constants",
                     runtime=lambda name: self.scope.lookup(name) is not None)

    # ------------------------------------------------------------ flows
    def source(self, expr) -> list[Tensor] | None:
        if isinstance(expr, A.TupleExpr):
            values = [self.tensor(element.value) for element in expr.items]
            return None if any(v is None for v in values) else values
        if isinstance(expr, A.Call):
            return self.operation(A.Step(expr, (), expr.span), [])
        tensor = self.tensor(expr)
        return [tensor] if tensor is not None else None

    def operation(self, step: A.Step, values):
        if values is None:
            return None
        if isinstance(step.expr, A.ListExpr):
            return self.type_annotation(step.expr, values)
        context = StepContext(self.instance, self.scope, self.quiet_tensor, self.dims)
        result = apply_step(context, step, values)
        if result is None:
            return None
        self._accumulate = result.accumulate
        self._optional_tail = optional_tail(result)
        if result.rule is not None:
            if self._last_use is not None:
                rule, inputs, span = self._last_use
                self.uses.append((rule, inputs, [], span))
            self._last_use = (result.rule, result.inputs, step.span)
        outputs = [Tensor("", t, step.span) for t in result.types]
        if self.recorder is not None:
            outputs = self._record(step, result, outputs)
        return outputs

    def _record(self, step: A.Step, result, outputs: list[Tensor]) -> list[Tensor]:
        from modulec.lower.lowering import record_call

        return record_call(self.recorder, self.instance, step, result, outputs)

    def type_annotation(self, annotation: A.ListExpr, values):
        expected = tensor_type(self.instance, annotation, free="symbol")
        if expected is None or len(values) != 1 or values[0].type.variadic:
            return values
        actual = values[0].type
        from modulec.check.module import warn_if_narrowing

        warn_if_narrowing(self.instance, actual, expected, annotation.span, "this value")
        same = self.instance.assumptions.same
        if len(actual.dims) != len(expected.dims) or any(
                same(a, b) is False for a, b in zip(actual.dims, expected.dims)):
            self.world.error("E004", f"shape mismatch: the value here is {actual}, "
                             f"annotated {expected}", annotation.span, f"actual shape {actual}")
        dtype = expected.dtype if expected.dtype != "float" else actual.dtype
        return [Tensor("", expected.with_dtype(dtype), annotation.span, value=values[0].value)]

    def destination(self, flow: A.Flow, step: A.Step, values) -> None:
        # outputs the flow's last step lets go unnamed (read here, for this flow only)
        optional, self._optional_tail = getattr(self, "_optional_tail", 0), 0
        targets = self.targets(step.expr, step.annotations)
        if targets is None:
            self.world.error("E003", "a flow must end in the name of its result", step.span,
                             "not a name", help=["write `... -> result` (or `-> (a, b)`)"])
            return
        accumulate = getattr(self, "_accumulate", False) if len(flow.steps) > 2 else False
        self._accumulate = False
        if values is None:
            for name, span, _ in targets:
                self._define(name, UNKNOWN, span, False)
            return
        if len(values) == 1 and len(targets) == 1 and len(flow.steps) == 2:
            self._alias(targets[0], values[0])
            return
        if not len(values) - optional <= len(targets) <= len(values):
            self._arity(step, values, targets)
            return
        for (name, span, notes), value in zip(targets, values):
            self._define(name, value.type, span, accumulate, value.value, notes)

    def _alias(self, target, value: Tensor) -> None:
        name, span, notes = target
        self._define(name, value.type, span, False, value.value, notes)

    def _arity(self, step, values, targets) -> None:
        self.world.error("E003", f"this operation returns {len(values)} tensor(s), "
                         f"the destination names {len(targets)}", step.span,
                         f"expected {len(values)} name(s)",
                         help=["name every output; discard one with `_`: `-> (y, _)`"])
        for name, span, _ in targets:
            self._define(name, UNKNOWN, span, False)

    def targets(self, expr, annotations=()) -> list[tuple[str, object, tuple]] | None:
        """(name, span, its annotations: `@dtype`, `@gradient`) for each destination name."""
        if isinstance(expr, A.Name):
            return [(expr.id, expr.span, tuple(annotations))]
        if isinstance(expr, A.TupleExpr) and all(isinstance(e.value, A.Name) for e in expr.items):
            return [(e.value.id, e.value.span, tuple(e.annotations)) for e in expr.items]
        return None

    def _define(self, name: str, type_: TensorType, span, accumulate: bool,
                value: str = "", notes=()) -> None:
        if name == "_":
            return
        if value and self.recorder is not None and not self.backward:  # a cast, then
            value, type_ = mark(self.recorder, self.instance.env(), value, type_, notes, span)
        else:  # checking only: the type the cast makes
            type_ = _with_cast(type_, cast_of(notes))
        kind = "gradient" if self.backward and name.startswith("d_") else "local"
        self.scope.define(Tensor(name, type_, span, kind, accumulate, value), self.world)
        if self.recorder is not None and value:
            self.recorder.bind(name, value, accumulate)
        phase = "backward" if self.backward else "forward"
        self.instance.inferred.append((phase, name, type_, span))

    # ------------------------------------------------------------ names
    def tensor(self, expr) -> Tensor | None:
        """The tensor an expression names, reporting E002/E006 when it names none."""
        found = self.quiet_tensor(expr)
        if found is not None:
            return found
        self._report_missing(expr)
        return None

    def quiet_tensor(self, expr) -> Tensor | None:
        """The tensor `expr` names, carrying the span of this use (errors point here)."""
        if isinstance(expr, A.Name):
            found = self.scope.lookup(expr.id)
            if found is not None:
                return replace(found, span=expr.span)
            return self._param(expr.id, expr)
        if isinstance(expr, A.Attribute) and isinstance(expr.value, A.Name):
            return self._attribute(expr)
        if isinstance(expr, A.Index):
            base = self.quiet_tensor(expr.value)
            return index_tensor(self, expr, base) if base is not None else None
        return None

    def _param(self, name: str, node) -> Tensor | None:
        value = self.instance.params.get(name)
        if isinstance(value, TensorParamValue):
            return Tensor(name, value.type, node.span, "param",
                          value=self._param_value(name, value))
        return None

    def _param_value(self, path: str, param: TensorParamValue) -> str:
        """`param:<path>`, or while recording the value its `@gradient` makes of it (one
        scale_gradient per function, made at the first use)."""
        value = f"param:{path}"
        if self.recorder is None or self.backward or param.frozen or \
                not any(a.name == "gradient" for a in param.notes):
            return value
        marked = self.recorder.marked
        if value not in marked:
            marked[value] = mark(self.recorder, self.instance.env(), value, param.type,
                                 param.notes, param.span, cast=False)[0]
        return marked[value]

    def _attribute(self, expr: A.Attribute) -> Tensor | None:
        base = expr.value.id
        if base == "saved" and self.backward:
            return self._saved(expr)
        sub = self.instance.params.get(base)
        if isinstance(sub, Submodule):
            value = sub.instance.params.get(expr.attr)
            if isinstance(value, TensorParamValue):
                path = f"{base}.{expr.attr}"
                return Tensor(path, value.type, expr.span, "param",
                              value=self._param_value(path, value))
        return None

    def _saved(self, expr: A.Attribute) -> Tensor | None:
        original = self.forward_types.get(expr.attr)
        if original is None or (self.saved is not None and expr.attr not in self.saved):
            return None
        return Tensor(f"saved.{expr.attr}", original.type, expr.span, "saved",
                      value=original.value)

    def _report_missing(self, expr) -> None:
        if isinstance(expr, A.Attribute) and getattr(expr.value, "id", None) == "saved":
            self._report_unsaved(expr)
            return
        name = expr.id if isinstance(expr, A.Name) else None
        if name is None:
            self.world.error("E003", "expected a tensor here", expr.span)
            return
        if isinstance(self.instance.params.get(name), Broken):
            return  # its declaration has an error already: nothing more to say here
        helps = did_you_mean(name, self.scope.visible() + list(self.instance.params))
        if self.in_recompute and name in self.forward_types:
            self.world.error("E021", f"`{name}` is not derivable here: a `recompute:` block "
                             "starts from saved tensors and parameters", expr.span,
                             "not saved",
                             help=[f"save `{name}` (add it to `save:`) and read `saved.{name}`"])
            return
        if self.backward and name in self.forward_types:
            helps = [f"forward tensors are reached through `saved.{name}` in a backward graph"]
        self.world.error("E002", f"undefined name `{name}`", expr.span,
                         "not defined in this graph", help=helps)

    def _report_unsaved(self, expr: A.Attribute) -> None:
        name = expr.attr
        if name in self.forward_types:
            self.world.error("E006", f"`saved.{name}` is not in the forward's save list",
                             expr.span, "not saved",
                             help=[f"add `{name}` to `save:` in the forward section"])
        else:
            self.world.error("E006", f"`saved.{name}`: the forward graph has no tensor `{name}`",
                             expr.span, "no such forward tensor",
                             help=did_you_mean(name, self.forward_types))


def _with_cast(type_: TensorType, cast: str | None) -> TensorType:
    return type_.with_dtype(cast) if cast else type_


def declared_type(instance: Instance, sig, span) -> TensorType:
    """An input or output signature's type, `B`/`T` free (symbols), `*` one symbol."""
    node = sig.type
    if isinstance(node, A.OptionalType):
        node = node.value
    if not isinstance(node, A.ListExpr):
        return UNKNOWN
    items = tuple(A.Name("*") if isinstance(i, A.Star) and i.suffix is None else i
                  for i in node.items)
    resolved = tensor_type(instance, A.ListExpr(items, node.span), free="symbol")
    return resolved or UNKNOWN


def secondary(span, text: str) -> list[Label]:
    return [Label(span, text)]


def optional_tail(result) -> int:
    """How many trailing outputs of a step a flow may leave unnamed: a primitive backward's
    by-products after its gradients (`swiglu_backward`'s `y`), so a written backward that
    names only the gradients, `-> (d_gate, d_up)` as spec §6.3.1 writes it, still checks."""
    if not result.backward or result.callee is None:
        return 0
    flags = backward_gradients(result.callee)
    tail = 0
    while tail < len(flags) and not flags[-1 - tail]:
        tail += 1
    return tail
