"""Derived backward (§5.12.6, §9.4.1): reverse mode over Graph IR, from primitive rules.

Each primitive declares its backward once (std/primitives): `backward: in:` names the
gradients of its outputs (`d_y`) and the forward tensors it reads (`x`, `rstd`), `out:`
the gradients of its inputs (`d_x`). A forward node becomes a `<primitive>_backward` node
wired by those names; a call becomes a call of the callee's backward function (its saved
tensors are the callee's own); contributions to one value (fan-out, tied weights) are
summed with `add`. An absent input gradient ("") means zero. Integer inputs get none.
An `add` of two values made in the function, of one shape and dtype with its result (no
broadcasting), has no backward node: each operand's gradient is the result's gradient,
the same value (`add_backward` would copy it twice; decisions.md "LoRA step copies").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.lower.fusion_patterns import FUSION_ATTRS
from modulec.ops.registry import op_table

# a forward op's annotations its derived backward op carries: the kernel `@kernel` chose
# (a backward reads the statistics its own forward kernel wrote, e.g. attention's lse)
CARRIED_TO_BACKWARD = ("kernel",)


def derive_backward(graph: Graph) -> Graph:
    """Add a backward function for every reachable forward function that has none (a
    backward written in the source is kept as written)."""
    if graph.backward:
        return graph
    reachable = _reachable(graph)
    written = {f.gradient_of: f for f in graph.functions if f.gradient_of}
    forward = [f for f in graph.functions if f.name in reachable and not f.gradient_of]
    done: dict[str, Function] = {}  # forward name -> its backward, callees first
    for function in _callees_first(graph, forward):
        done[function.name] = written.get(function.name) or _backward(function, done)
    backward = [done[f.name] for f in forward]
    entry_backward = f"{graph.entry}.backward"
    return Graph(graph.model, graph.entry, entry_backward, tuple(forward + backward))


def without_written_backward(graph: Graph) -> Graph:
    """The graph with the backward functions written in the source dropped, so that
    derive_backward derives them all (`--verify-backward` checks both against each other)."""
    return Graph(graph.model, graph.entry, graph.backward,
                 tuple(f for f in graph.functions if not f.gradient_of))


def _callees_first(graph: Graph, forward: list[Function]) -> list[Function]:
    """The forward functions, each after every function it calls: a call's backward
    needs to know which of its callee's input gradients exist (a stop-gradient inside)."""
    by_name = {f.name: f for f in forward}
    order: list[Function] = []
    seen: set[str] = set()

    def visit(function: Function) -> None:
        if function.name in seen:
            return
        seen.add(function.name)
        for node in function.nodes:
            if node.kind == "call" and node.target in by_name:
                visit(by_name[node.target])
        order.append(function)

    for function in forward:
        visit(function)
    return order


def _reachable(graph: Graph) -> set[str]:
    seen, todo = set(), [graph.entry]
    by_name = {f.name: f for f in graph.functions}
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        todo += [n.target for n in by_name[name].nodes if n.kind == "call"]
    return seen


@dataclass
class _Builder:
    forward: Function
    callees: dict[str, Function] = field(default_factory=dict)  # forward name -> backward
    nodes: list[Node] = field(default_factory=list)
    values: dict[str, ValueInfo] = field(default_factory=dict)
    grads: dict[str, str] = field(default_factory=dict)  # forward value -> gradient value
    saved: set[str] = field(default_factory=set)
    counter: int = 0

    def fresh(self, like: str) -> str:
        self.counter += 1
        gradient = f"%g{self.counter}"
        info = self.forward.value(like)
        if info is not None:
            self.values[gradient] = ValueInfo(gradient, info.shape, _grad_dtype(info.dtype),
                                              f"d_{info.name}" if info.name else "")
        return gradient

    def node(self, target: str, inputs, outputs, origin: Node, kind="op", attrs=(), repeat=1):
        index = len(self.nodes)
        own = target == f"{origin.target}_backward"  # not the sums of its gradients
        notes = tuple(a for a in origin.annotations if own and a[0] in CARRIED_TO_BACKWARD)
        self.nodes.append(Node(f"b{index}", kind, target, tuple(inputs), tuple(outputs),
                               tuple(attrs), notes, repeat, "backward", origin.span))

    def wants(self, value: str | None) -> bool:
        """Whether the gradient of forward `value` is needed (not frozen, not skipped)."""
        return bool(value) and value not in self.forward.no_gradient

    def contribute(self, value: str, gradient: str, origin: Node) -> None:
        """Add `gradient` into the gradient of forward `value` (summing fan-out)."""
        if value.startswith("saved:") or not gradient:
            return
        if value not in self.grads:
            self.grads[value] = gradient
            return
        total = self.fresh(value)
        self.node("add", [self.grads[value], gradient], [total], origin)
        self.grads[value] = total


def _backward(forward: Function, callees: dict[str, Function]) -> Function:
    builder = _Builder(forward, callees)
    inputs = []
    for output in forward.outputs:
        gradient = f"d:{output}"
        info = forward.value(output)
        if info is not None:
            inputs.append(ValueInfo(gradient, info.shape, _grad_dtype(info.dtype),
                                    f"d_{info.name or output}"))
        builder.grads[output] = gradient
    for node in reversed(forward.nodes):
        if any(o in builder.grads for o in node.outputs):
            (_op_backward if node.kind == "op" else _call_backward)(builder, node)
    outputs = tuple(builder.grads.get(i.id, "") if builder.wants(i.id) else ""
                    for i in forward.inputs)  # "" for none (ints, skipped)
    param_grads = tuple((p.id[len("param:"):], builder.grads[p.id]) for p in forward.params
                        if p.id in builder.grads)
    return Function(f"{forward.name}.backward", forward.module, forward.scope, forward.args,
                    forward.params, tuple(inputs), outputs,
                    tuple(builder.values[k] for k in sorted(builder.values, key=_order)),
                    tuple(builder.nodes), tuple(sorted(builder.saved)), forward.name,
                    param_grads, forward.no_gradient)


def _op_backward(builder: _Builder, node: Node) -> None:
    if _identity_add(builder.forward, node):
        gradient = builder.grads.get(node.outputs[0], "")
        for source in node.inputs:
            if builder.wants(source):
                builder.contribute(source, gradient, node)
        return
    rule = op_table().get(node.target)
    if rule is None or rule.definition.backward is None:
        return
    forward_sig = rule.definition.forward
    backward_sig = rule.definition.backward
    by_name = _forward_values(forward_sig, node)
    lists = _list_values(forward_sig, node)
    inputs = []
    for sig in backward_sig.inputs:
        if _is_list(sig) and sig.name[2:] in lists:  # split: the gradients of all its parts
            inputs += [builder.grads.get(v, "") for v in lists[sig.name[2:]]]
        else:
            inputs.append(_backward_input(builder, sig.name, by_name, node))
    if not backward_sig.outputs:
        return
    targets = []  # the forward value each backward output is the gradient of
    for sig in backward_sig.outputs:
        if _is_list(sig) and sig.name[2:] in lists:  # concat: one gradient per input
            targets += lists[sig.name[2:]]
        else:
            targets.append(by_name.get(sig.name[2:]) if sig.name.startswith("d_") else None)
    outputs = [builder.fresh(t) if builder.wants(t) else "" for t in targets]
    attrs = tuple(a for a in node.attrs if a[0] not in FUSION_ATTRS)  # params only
    # forward_node: the runtime reads the forward op's input shapes and outputs from it
    builder.node(f"{rule.name}_backward", inputs, outputs, node,
                 attrs=attrs + (("forward_node", node.id),))
    for source, gradient in zip(targets, outputs):
        if source:
            builder.contribute(source, gradient, node)


def _identity_add(forward: Function, node: Node) -> bool:
    """`y = add(a, b)` whose backward is the identity for both operands: a and b are values
    of the function's own nodes (not its inputs or parameters, whose gradient could become
    the backward's output or a parameter gradient as it is), shaped and typed as y."""
    if node.kind != "op" or node.target != "add" or len(node.inputs) != 2 \
            or len(node.outputs) != 1:
        return False
    made = {o for n in forward.nodes for o in n.outputs if o}
    infos = [forward.value(v) for v in (*node.inputs, node.outputs[0])]
    return all(v in made for v in node.inputs) and all(i is not None for i in infos) and \
        len({(i.shape, i.dtype) for i in infos}) == 1


def _is_list(sig) -> bool:
    from modulec.syntax import ast as A

    return isinstance(sig.type, A.ArrayType)


def _list_values(signature, node: Node) -> dict[str, list[str]]:
    """A list parameter (`parts: [n] x [*]`) takes all of the node's outputs (or inputs)."""
    lists = {}
    if len(signature.outputs) == 1 and _is_list(signature.outputs[0]):
        lists[signature.outputs[0].name] = list(node.outputs)
    if len(signature.inputs) == 1 and _is_list(signature.inputs[0]):
        lists[signature.inputs[0].name] = list(node.inputs)
    return lists


def _forward_values(signature, node: Node) -> dict[str, str]:
    values = {sig.name: v for sig, v in zip(signature.inputs, node.inputs) if v}
    values.update({sig.name: v for sig, v in zip(signature.outputs, node.outputs) if v})
    return values


def _backward_input(builder: _Builder, name: str, by_name: dict, node: Node) -> str:
    if name.startswith("d_") and name[2:] in by_name:
        return builder.grads.get(by_name[name[2:]], "")
    value = by_name.get(name, "")
    if value and not value.startswith("param:"):
        builder.saved.add(value)
    return value


def _call_backward(builder: _Builder, node: Node) -> None:
    gradients = [builder.grads.get(o, "") for o in node.outputs]
    gives = _callee_gives(builder, node)
    outputs = [builder.fresh(i) if gives[k] and _differentiable(builder, i) and builder.wants(i)
               else "" for k, i in enumerate(node.inputs)]
    builder.node(f"{node.target}.backward", gradients, outputs, node, kind="call",
                 attrs=(("forward_node", node.id),), repeat=node.repeat)
    for value, gradient in zip(node.inputs, outputs):
        builder.contribute(value, gradient, node)


def _callee_gives(builder: _Builder, node: Node) -> list[bool]:
    """Which inputs of the callee its backward gives a gradient for: none for a
    `@gradient(skip)` input or one that reaches no output through differentiable ops (a
    backward output written as absent, `""`); a repeated call feeds each layer's input
    gradients to the layer before it, so there an absent one stays absent too."""
    callee = builder.callees.get(node.target)
    if callee is None:
        return [True] * len(node.inputs)
    return [bool(o) for o in callee.outputs] + [True] * (len(node.inputs) - len(callee.outputs))


def _differentiable(builder: _Builder, value: str) -> bool:
    info = builder.forward.value(value) if value else None
    return bool(value) and not value.startswith("param:") and \
        not (info is not None and info.dtype.startswith("int"))


def _grad_dtype(dtype: str) -> str:
    return "float" if dtype.startswith("int") else dtype


def _order(key: str) -> tuple:
    digits = key[2:] if key.startswith("%g") else ""
    return (0, int(digits)) if digits.isdigit() else (1, key)

