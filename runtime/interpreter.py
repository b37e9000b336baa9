"""The reference interpreter: runs a Graph IR (forward and backward) with the torch
reference kernels of `runtime.kernels`.

The IR is hierarchical (modulec.ir.graph): a `call` node runs another function, `repeat`
times in a row for a stack of layers (layer i's outputs are layer i+1's inputs). Every run
of a function leaves a `Frame` (its values by id, and the frames of the calls it made), so
the backward of a call finds the forward values its function saved: the backward of layer
i reads frame `(forward node, i)`. Parameters live in one dict keyed by their full path
(`blocks[3].attention.qkv_weight`), the path of a function being its scope with each `[*]`
replaced by the layer index of the enclosing stack.

Absent gradients (`""` in a backward node's inputs) are zeros shaped like the forward value
they differentiate; a backward op reads its forward op (attr `forward_node`) for those
shapes and for the forward input shapes some kernels need (`input_shapes`).
"""

from __future__ import annotations

import functools
import zlib

from dataclasses import dataclass, field
import torch
from torch import Tensor

from modulec.ir.graph import STREAM, WAIT, Function, Graph, Node
from modulec.lower.fusion_patterns import FUSION_ATTRS
from runtime.errors import NonFiniteError, RuntimeUserError
from runtime.fp8 import operands as fp8_operands
from runtime.kernel_choice import select as select_kernel
from runtime.kernels import KERNELS
from runtime.probes import describe
from runtime.prune import prunable, pruned

# attrs the compiler adds for itself, not params of the primitive
IR_ATTRS = frozenset(("forward_node", STREAM) + FUSION_ATTRS)
EXACT_DTYPES = {torch.float64: "fp64", torch.float32: "fp32"}
FLOAT_NAMES = {"fp64", "fp32", "bf16", "fp16", "float"}


@dataclass
class Frame:
    """One run of one function: its values and the frames of the calls it made."""

    function: Function
    path: str  # the parameter prefix of this instance ("" for the model)
    indices: tuple[int, ...]  # layer indices of the enclosing stacks
    env: dict[str, Tensor] = field(default_factory=dict)
    children: dict[tuple[str, int], "Frame"] = field(default_factory=dict)
    transient_base: int = 0  # where this run's transient values start (runtime.arena)
    dropped: set = field(default_factory=set)  # released to be recomputed (runtime.decisions)
    host: dict = field(default_factory=dict)  # swapped out (runtime.decisions)
    forgotten: dict = field(default_factory=dict)  # argument -> (caller run, its value)
    instance: int = 0  # which run of its function this is, in the forward (runtime.arena)
    destinations: dict = field(default_factory=dict)  # result -> caller's bytes (runtime.arena)
    widened: dict = field(default_factory=dict)  # concat -> its rows elsewhere (Arena.widen)
    # call node id -> indices of its outputs nobody reads (runtime.prune; `prune_dead`)
    dead_calls: dict = field(default_factory=dict)


@dataclass
class Interpreter:
    """Runs `graph` on `params` (path -> tensor). In float64/float32 mode (`dtype`), every
    floating tensor the program creates is made in that dtype too, so a run is exact."""

    graph: Graph
    params: dict[str, Tensor]
    dtype: torch.dtype | None = None
    hooks: object = None  # runtime.hooks.Hooks: observe / modify / replace, probes
    check_finite: bool = True
    kernels: dict = field(default_factory=lambda: KERNELS)
    arena: object = None  # runtime.arena.Arena: run on the memory plan
    decisions: object = None  # runtime.decisions.Decisions: recompute / swap as planned
    param_regions: object = None  # runtime.arena.ParameterRegions: weights, gradients
    profiler: object = None  # runtime.profiling.Profiler: `@profile` regions (None: off)
    # runtime.dist.zero.ZeroRun: told when a layer's or the entry's function run starts
    # (ZeRO-3 gathers weights just before use)
    frame_events: object = None
    _runs: dict = field(default_factory=dict)  # forward function -> runs so far
    _sinks: dict = field(default_factory=dict)  # (id(run), value) -> [(callee run, input)]
    _replaying: bool = False
    _backward_started: bool = False
    grads: dict[str, Tensor] = field(default_factory=dict)
    # drop what no backward reads as each forward function returns (a shape-only stand-in
    # stays), and each layer's forward frame once its backward ran: one backward per forward
    keep_only_saved: bool = False
    # random ops (dropout): None for none (inference); else each op of each layer run
    # draws from its own seed, derived from this one (a trainer sets one per step)
    rng_seed: int | None = None
    fp8: object = None  # runtime.fp8.Fp8State: the program's FP8 recipe, emulated
    # leave out backward work nobody reads (runtime/prune.py): the first layer's input
    # gradient under a frozen embedding. Not under hooks or `@profile` (they may read any
    # value), nor where the graph has collectives (runtime.prune.prunable)
    prune_dead: bool = False
    _prunable: bool | None = None  # runtime.prune.prunable(graph), once
    _pruned_memo: dict = field(default_factory=dict)  # (function name, dead) -> pruned(...)

    # ------------------------------------------------------------------ entry points
    def forward(self, inputs: list[Tensor]) -> tuple[list[Tensor], Frame]:
        entry = self.graph.function(self.graph.entry)
        frame = Frame(entry, "", ())
        self._runs, self._sinks, self._backward_started = {}, {}, False
        self._enter(frame, None, None)
        if self.hooks is not None:
            self.hooks.begin("forward")
        outputs = self._run(frame, inputs, None)
        if self.arena is not None:  # the backward reuses the transient bytes
            outputs = [o.clone() if isinstance(o, Tensor) else o for o in outputs]
        if self.decisions is not None:
            self.decisions.release(frame, self._sinks, self.arena)
        return outputs, frame

    def backward(self, frame: Frame, d_outputs: list[Tensor | None]):
        """Gradients of the entry's inputs (None where there is none) and of every trainable
        parameter by path, for output seeds `d_outputs` (None: zero)."""
        if not self.graph.backward:
            raise RuntimeUserError("this program has no backward (it was built without one)")
        self.grads = {}
        self._backward_started = True
        if self.param_regions is not None:
            self.param_regions.start_backward()
        backward, dead_calls = self.graph.function(self.graph.backward), {}
        if self._prunes():  # every output is handed back: only what nobody reads goes
            backward, dead_calls = self._pruned(backward, frozenset())
        seeds = [d if d is not None else torch.zeros_like(frame.env[o])
                 for d, o in zip(d_outputs, frame.function.outputs)]
        own = Frame(backward, frame.path, frame.indices, dead_calls=dead_calls)
        if self.arena is not None:
            self.arena.enter(own)
        if self.hooks is not None:
            self.hooks.begin("backward")
        d_inputs = self._run(own, seeds, frame)
        return d_inputs, self.grads

    # ------------------------------------------------------------------ functions
    def _run(self, frame: Frame, args: list, forward: Frame | None) -> list:
        function = frame.function
        self._frame_begin(frame)
        frame.env.update({i.id: a for i, a in zip(function.inputs, args)})
        for node in function.nodes:
            spec = self.profiler.spec_of(node, frame, self.graph) \
                if self.profiler is not None else None
            if spec is None:
                self._dispatch(node, frame, forward)
            else:
                self._profiled(spec, node, frame, forward)
        if function.gradient_of:
            self._collect_param_grads(frame)
        outputs = [frame.env.get(o) if o else None for o in function.outputs]
        if self.keep_only_saved and not function.gradient_of:
            _keep_only_saved(frame, _saved_by_backward(self.graph, function.name))
        return outputs

    def _dispatch(self, node: Node, frame: Frame, forward: Frame | None) -> None:
        if node.kind == "call":
            self._call(node, frame, forward)
        elif node.kind == "op":
            self._op(node, frame, forward)
        elif node.kind == WAIT:
            self._wait(node, frame)
        else:  # an alias names an existing value
            frame.env[node.outputs[0]] = self._read(node.inputs[0], frame, forward)

    def _wait(self, node: Node, frame: Frame) -> None:
        """Where the compute stream joins an op issued on the communication stream
        (`stream=comm`, modulec.lower.tp_overlap): here every op ran in program order,
        the async one included, so there is nothing to wait for (the GPU step's
        interpreter waits for its event)."""

    def _profiled(self, spec: dict, node: Node, frame: Frame, forward) -> None:
        """A `@profile` region (runtime.profiling) around one node."""
        phase = "backward" if frame.function.gradient_of else "forward"
        cuda = any(isinstance(t, Tensor) and t.is_cuda for t in self.params.values())
        with self.profiler.region(spec, frame, phase, cuda) as region:
            self._dispatch(node, frame, forward)
        if spec.get("memory") and not cuda:  # on the CPU: the bytes of its results
            made = sum(frame.env[o].nbytes for o in node.outputs
                       if isinstance(frame.env.get(o), Tensor))
            region.bytes = max(region.bytes, made)

    def _call(self, node: Node, frame: Frame, forward: Frame | None) -> None:
        callee = self.graph.function(node.target)
        values = [self._read(v, frame, forward) if v else None for v in node.inputs]
        count = int(node.repeat)
        if callee.gradient_of:
            origin = node.attr("forward_node")
            dead = frame.dead_calls.get(node.id)
            for layer in reversed(range(count)):
                child = forward.children[(origin, layer)]
                if self.keep_only_saved:  # its backward is the last reader
                    del forward.children[(origin, layer)]
                # the last repetition's results are the call's: where some are unread,
                # what only they need is left out (earlier ones feed the next layer)
                function, dead_calls = self._pruned(callee, dead) if dead and layer == 0 \
                    else (callee, {})
                own = Frame(function, child.path, child.indices, dead_calls=dead_calls)
                self._enter(own, frame, node, layer)
                values = self._zeros_for_absent(values, child)
                values = self._hand_over(frame, node, own, self._run(own, values, child), layer)
        else:
            source = (frame, node.inputs)
            for layer in range(count):
                child = self._child_frame(callee, frame, node, layer)
                remaining = count - 1 - layer
                self._enter(child, frame, node, remaining)
                frame.children[(node.id, layer)] = child
                self._sink(source, child)
                source = (child, child.function.outputs)
                values = self._hand_over(frame, node, child, self._run(child, values, None),
                                         remaining)
        placed = self._placed
        if self.hooks is not None and any(node.outputs):
            placed = [self.hooks.apply(node, frame, o, v) if o else v
                      for o, v in zip(node.outputs, placed)]
        frame.env.update({o: v for o, v in zip(node.outputs, placed) if o})

    def _prunes(self) -> bool:
        """Whether this run leaves out backward work nobody reads (`prune_dead`)."""
        if not self.prune_dead or self.hooks is not None or self.profiler is not None:
            return False
        if self._prunable is None:
            self._prunable = prunable(self.graph)
        return self._prunable

    def _pruned(self, function: Function, dead: frozenset) -> tuple[Function, dict]:
        """runtime.prune.pruned, made once per function and `dead` in this interpreter."""
        key = (function.name, dead)
        if key not in self._pruned_memo:
            self._pruned_memo[key] = pruned(function, dead)
        return self._pruned_memo[key]

    def _hand_over(self, frame: Frame, node: Node, child: Frame, values: list,
                   remaining: int) -> list:
        """A call's results after one repetition (`remaining` after it), in the caller's
        bytes on the arena (runtime.arena); the next repetition reads them, the call's
        outputs are the last one's (kept in `_placed`)."""
        if self.arena is not None:
            values = self.arena.hand_over(frame, node, child, values, remaining)
        self._placed = values
        return values

    def _enter(self, frame: Frame, parent: Frame | None, node: Node | None,
               remaining: int = 0) -> None:
        """Number a forward run (its instance) and place it in the arena."""
        if not frame.function.gradient_of:
            name = frame.function.name
            frame.instance = self._runs.get(name, 0)
            self._runs[name] = frame.instance + 1
        if self.arena is not None:
            self.arena.enter(frame, parent, node, remaining)

    def _sink(self, source: tuple, child: Frame) -> None:
        """Remember where each argument of `child` came from (runtime.decisions). Only
        recompute / swap decisions read it: without them nothing is kept (each record
        holds its run's frame, and a run that never calls `forward` would hold them all)."""
        if self.decisions is None:
            return
        owner, values = source
        for argument, value in zip(child.function.inputs, values):
            if value:
                self._sinks.setdefault((id(owner), value), []).append((child, argument.id))

    def read_forward(self, frame: Frame, value: str):
        return self._read(value, frame, None)

    def place(self, frame: Frame, node, value: str, tensor):
        """Into the value's planned bytes; a transient value of a forward run made again
        (replayed, recomputed from saved statistics, taken from a callee) stays out of the
        arena once the backward runs: the backward owns the transient bytes by then. A
        transient value of bytes of its own (`Arena.may_keep`) whose kernel allocated it
        (`allocates_outputs`) stays where it is: copying it in would only move it."""
        late = self._replaying or self._backward_started
        if self.arena is None or late and not frame.function.gradient_of and \
                self.arena.is_transient(frame, value):
            return tensor
        if self._allocated(node) and self.arena.may_keep(frame, value):
            return tensor
        return self.arena.place(frame, node, value, tensor)

    def _allocated(self, node) -> bool:
        if node is None or node.kind != "op":
            return False
        kernel = self.kernels.get(node.target.removesuffix("_backward"))
        return getattr(kernel, "allocates_outputs", False)

    def replay(self, node: Node, frame: Frame) -> None:
        """Run forward op `node` of finished run `frame` again (a planned recompute)."""
        replaying, self._replaying = self._replaying, True
        try:
            self._op(node, frame, None)
        finally:
            self._replaying = replaying

    def _frame_begin(self, frame: Frame) -> None:
        """Tell `frame_events` that a layer's or the entry's (path "") function run starts."""
        function = frame.function
        if self.frame_events is not None and (frame.indices or function.name in (
                self.graph.entry, self.graph.backward)):
            self.frame_events.frame_begin(frame.path, bool(function.gradient_of))

    def _zeros_for_absent(self, grads: list, child: Frame) -> list:
        """Zeros for the gradients no one gave, shaped as the forward outputs (an output
        the planner swapped out or dropped is restored first)."""
        outputs = child.function.outputs
        return [g if g is not None else torch.zeros_like(self._forward_output(child, o))
                for g, o in zip(grads, outputs)]

    def _forward_output(self, child: Frame, value: str):
        if value not in child.env:
            self._restore(child, value)
        return child.env[value]

    def _child_frame(self, callee: Function, frame: Frame, node: Node, layer: int) -> Frame:
        path, indices = child_path(callee, frame.path, frame.indices, node, layer)
        return Frame(callee, path, indices)

    def _collect_param_grads(self, frame: Frame) -> None:
        for name, value in frame.function.param_grads:
            gradient = frame.env.get(value)
            if gradient is None:
                continue
            path = _join(frame.path, name)
            if self.param_regions is not None:  # summed in place in the gradients region
                self.grads[path] = self.param_regions.gradient(path, gradient)
                continue
            self.grads[path] = self.grads[path] + gradient if path in self.grads else gradient

    # ------------------------------------------------------------------ ops
    def _op(self, node: Node, frame: Frame, forward: Frame | None) -> None:
        if node.outputs and not any(node.outputs):
            return  # a backward op none of whose gradients is wanted
        inputs = self._inputs(node, frame, forward)
        if self.fp8 is not None and node.target in ("matmul", "matmul_backward"):
            inputs = fp8_operands(self.fp8, node, frame, forward, inputs)
        attrs = self._attrs(node)
        if getattr(self.kernels.get(node.target), "random", False):
            attrs["seed"] = self._seed(node, frame)
        if node.target.endswith("_backward"):
            kernel = self._kernel(node.target[: -len("_backward")], node, frame)
            inputs, attrs = self._backward_context(kernel, node, inputs, attrs, forward,
                                                   frame.function)
            self._out_bytes(kernel, node, frame, attrs)
            outputs = kernel.backward(inputs, attrs)
        else:
            kernel = self._kernel(node.target, node, frame)
            self._out_bytes(kernel, node, frame, attrs)
            outputs = kernel.forward(_group_lists(kernel.forward_inputs, inputs), attrs)
            outputs = _flatten(outputs)
        for value, tensor in zip(node.outputs, _flatten(outputs)):
            if value:
                frame.env[value] = self._after(node, frame, value, tensor)

    def _inputs(self, node: Node, frame: Frame, forward: Frame | None) -> list:
        """The op's input values (None for an absent optional one)."""
        return [self._read(v, frame, forward) if v else None for v in node.inputs]

    def _seed(self, node: Node, frame: Frame) -> int | None:
        """The seed of random op `node` in this run of its function: the same when the op
        runs again (a recompute), another in each layer and in each step."""
        if self.rng_seed is None:
            return None
        return zlib.crc32(f"{self.rng_seed}/{frame.path}/{frame.indices}/{node.id}".encode())

    def _out_bytes(self, kernel, node: Node, frame: Frame, attrs: dict) -> None:
        """On the arena, a kernel that writes into given bytes (`takes_out`) gets each
        output's planned bytes in attrs["out"] (place() then finds them there); replayed
        in the backward, a saved value its record does not keep gets spare saved bytes
        (runtime.arena `replay_bytes`)."""
        if self.arena is None or not getattr(kernel, "takes_out", False):
            return
        bytes_of = self.arena.replay_bytes if self._replaying else \
            (lambda f, o: self.arena.out_bytes(f, node, o))
        attrs["out"] = [bytes_of(frame, o) if o else None for o in node.outputs]

    def _kernel(self, name: str, node: Node, frame: Frame):
        kernel = self.kernels.get(name)
        if kernel is None:
            raise RuntimeUserError(f"no kernel for `{name}` ({_where(node, frame)})")
        return select_kernel(self.kernels, name, node, kernel)  # `@kernel(...)`'s choice

    def _attrs(self, node: Node) -> dict:
        attrs = {k: v for k, v in node.attrs if k not in IR_ATTRS}
        exact = EXACT_DTYPES.get(self.dtype)
        if exact and attrs.get("dtype") in FLOAT_NAMES:
            attrs["dtype"] = exact
        return attrs

    def float_dtype(self, declared: str) -> torch.dtype:
        """The dtype this run makes a float the IR declares `declared`: in an exact mode
        (float64 / float32) that dtype for every float (`_attrs`), else as declared."""
        from runtime.kernels.utility import TORCH_DTYPES

        if self.dtype in EXACT_DTYPES:
            return self.dtype
        return TORCH_DTYPES.get(declared, self.dtype)

    def _backward_context(self, kernel, node: Node, inputs: list, attrs: dict, forward,
                          frame_function: Function):
        """Zeros for absent output gradients and the forward input shapes, from the
        forward op this backward op differentiates."""
        origin = node.attr("forward_node")
        if forward is None or origin is None:  # written in the source: shapes from the IR
            attrs["input_shapes"] = _shapes_from_gradients(kernel, node, frame_function)
            return _group_lists(kernel.backward_inputs, inputs), attrs
        op = next(n for n in forward.function.nodes if n.id == origin)
        by_name = _forward_names(kernel, op)
        filled = []
        for name, value in zip(_expand(kernel.backward_inputs, inputs), inputs):
            source = by_name.get(name[2:]) if name.startswith("d_") else None
            if value is None and isinstance(source, str) and source in forward.env:
                value = torch.zeros_like(forward.env[source])
            filled.append(value)
        attrs["input_shapes"] = _input_shapes(kernel, op, forward, self)
        if getattr(kernel, "converts", False):  # a cast's gradient goes back to its input's dtype
            attrs["input_dtypes"] = {name: self._read(value, forward, None).dtype
                                     for name, value in zip(kernel.forward_inputs, op.inputs)}
        return _group_lists(kernel.backward_inputs, filled), attrs

    def _after(self, node: Node, frame: Frame, value: str, tensor: Tensor) -> Tensor:
        tensor = self.place(frame, node, value, tensor)
        self._finite(node, frame, value, tensor, "")
        if self.hooks is not None and not self._replaying:
            version = getattr(tensor, "_version", None)
            hooked = self.hooks.apply(node, frame, value, tensor)
            if hooked is not tensor or getattr(tensor, "_version", None) != version:
                self._finite(node, frame, value, hooked, " after its hooks")
            tensor = hooked
        return tensor

    def _finite(self, node: Node, frame: Frame, value: str, tensor, when: str) -> None:
        if self.check_finite and isinstance(tensor, Tensor) and tensor.is_floating_point() \
                and not bool(torch.isfinite(tensor).all()):
            info = frame.function.value(value)
            named = info is not None and info.name
            name = f"`{info.name}` ({value})" if named else f"`{value}`"
            notes = describe(node.annotations)
            raise NonFiniteError(f"{name} = {node.target}(...) is not finite{when} "
                                 f"({_where(node, frame)}{'; ' + notes if notes else ''})")

    # ------------------------------------------------------------------ values
    def _read(self, value: str, frame: Frame, forward: Frame | None):
        for owner in (frame, forward):
            if owner is not None and (value in owner.env or self._restore(owner, value)):
                return owner.env[value]
        if value.startswith("param:"):
            return self._param(value[len("param:"):], frame)
        raise RuntimeUserError(f"value `{value}` is read before it is computed "
                               f"(in `{frame.function.name}`)")

    def _restore(self, frame: Frame, value: str) -> bool:
        return self.decisions is not None and self.decisions.restore(self, frame, value)

    def _param(self, name: str, frame: Frame) -> Tensor:
        path = _join(frame.path, name)
        if path not in self.params:
            raise RuntimeUserError(f"parameter `{path}` has no value",
                                   help=["load weights (e.g. --hf-weights DIR) or pass "
                                         "every parameter by its path"])
        return self.params[path]


# ====================================================================== helpers
def _saved_by_backward(graph: Graph, name: str) -> frozenset:
    return frozenset(v for f in graph.functions if f.gradient_of == name for v in f.saved)


def _keep_only_saved(frame: Frame, saved: frozenset) -> None:
    """Replace each tensor no backward reads by a one-element stand-in of its shape, dtype
    and device (an expanded scalar: zeros_like and .shape still work, no memory kept)."""
    scalars: dict = {}
    for value, tensor in frame.env.items():
        if value in saved or not isinstance(tensor, Tensor) or tensor.numel() <= 1:
            continue
        key = (tensor.dtype, tensor.device)
        if key not in scalars:
            scalars[key] = torch.empty((), dtype=tensor.dtype, device=tensor.device)
        frame.env[value] = scalars[key].expand(tensor.shape)


def child_path(callee: Function, path: str, indices: tuple, node: Node, layer: int):
    """The callee's parameter path and stack indices for repetition `layer` of call `node`
    made at `path`: from the call's `instance` (and `first` for an array of blocks);
    IR without them falls back to the callee's scope."""
    name, first = node.attr("instance"), node.attr("first")
    if name is None:
        if callee.scope.count("[*]") > len(indices):
            indices = indices + (layer,)
        return _fill_scope(callee.scope, indices), indices
    if first is None:
        return _join(path, name), indices
    index = int(first) + layer
    return f"{_join(path, name)}[{index}]", indices + (index,)


def _fill_scope(scope: str, indices: tuple[int, ...]) -> str:
    for index in indices:
        scope = scope.replace("[*]", f"[{index}]", 1)
    return scope


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _where(node: Node, frame: Frame) -> str:
    file, line, column = node.span
    place = f"{file}:{line}:{column}" if file else "no source"
    scope = frame.path or frame.function.module
    return f"node {node.id} of `{frame.function.name}` at {scope}, {place}"


@functools.cache
def list_inputs() -> frozenset[str]:
    """The tensor-list inputs (`xs: [n] x [*]`) of the primitives' signatures, as declared
    in std/primitives (concat's `xs`, split_backward's `d_parts`)."""
    from modulec.ops.registry import op_table
    from modulec.syntax import ast as A

    return frozenset(sig.name for rule in op_table().values()
                     for phase in (rule.definition.forward, rule.definition.backward)
                     if phase is not None for sig in phase.inputs
                     if isinstance(sig.type, A.ArrayType))


def _group_lists(names: tuple, values: list) -> list:
    """A signature whose single input is a list takes all the node's values as one list."""
    if len(names) == 1 and names[0] in list_inputs():
        return [list(values)]
    return values


def _expand(names: tuple, values: list) -> list[str]:
    if len(names) == 1 and names[0] in list_inputs():
        return [names[0]] * len(values)
    return list(names)


def _flatten(outputs: list) -> list:
    flat = []
    for out in outputs:
        flat += list(out) if isinstance(out, (list, tuple)) else [out]
    return flat


def _forward_names(kernel, op: Node) -> dict:
    names = dict(zip(kernel.forward_inputs, op.inputs))
    names.update(zip(kernel.forward_outputs, op.outputs))
    if len(kernel.forward_outputs) == 1 and len(op.outputs) != 1:
        names[kernel.forward_outputs[0]] = list(op.outputs)
    return names


def _input_shapes(kernel, op: Node, forward: Frame, interpreter: Interpreter) -> dict:
    shapes: dict = {}
    if len(kernel.forward_inputs) == 1 and kernel.forward_inputs[0] in list_inputs():
        shapes[kernel.forward_inputs[0]] = [_shape(v, forward, interpreter) for v in op.inputs]
        return shapes
    for name, value in zip(kernel.forward_inputs, op.inputs):
        shapes[name] = _shape(value, forward, interpreter) if value else None
    return shapes


def _shapes_from_gradients(kernel, node: Node, function: Function) -> dict:
    """A forward input's shape is its gradient's (`d_bias: [C]` for `bias`), as the IR
    sizes it; a backward op written in the source has no forward op to read it from."""
    shapes = {}
    for name, value in zip(kernel.backward_outputs, node.outputs):
        shape = static_shape(function, value) if value else None
        if name.startswith("d_") and shape is not None:
            shapes[name[2:]] = shape
    return shapes


def static_shape(function: Function, value: str) -> tuple[int, ...] | None:
    """`value`'s shape as the IR sizes it, where every dim is a number, else None."""
    info = function.value(value)
    if info is None or not all(str(d).isdigit() for d in info.shape):
        return None
    return tuple(int(d) for d in info.shape)


def _shape(value: str, forward: Frame, interpreter: Interpreter):
    if value in forward.env:
        return tuple(forward.env[value].shape)
    if value.startswith("param:"):
        return tuple(interpreter._param(value[len("param:"):], forward).shape)
    shape = static_shape(forward.function, value)  # released (runtime.decisions): the IR's
    if shape is not None:
        return shape
    return tuple(interpreter.read_forward(forward, value).shape)

