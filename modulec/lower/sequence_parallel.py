"""Sequence parallel (`--tp M --sp`): Megatron-LM's, on the tensor-parallel program.

After the `tensor_parallel` pass each sharded region is `tp_copy` -> column matmul ...
row matmul -> `tp_all_reduce`, and everything between the regions (norms, residual adds,
the embedding, the head) runs whole on every rank. This pass splits what lies between
the regions along the sequence (dim 1 of `[B, T, ...]`): each rank keeps a
`[B, T / M, ...]` block of the B x T tokens, rank r the r-th contiguous block of them
flattened (runtime/kernels/comm.py: so the collectives copy nothing; with B = 1 it is
the sequence's block r).

Every value of a function is *whole* (the same on every rank), *local* (this rank's
T / M rows) or *gathered* (all T rows inside a region entered from local rows):

- a call from the entry whose callee holds a region gets its whole arguments with a
  sequence dim as local rows: `sp_scatter` (a `zeros` made for it is made local instead);
- in a region, `tp_copy` of a local value becomes `sp_all_gather` (backward: reduce-
  scatter) and the `tp_all_reduce` that ends it `sp_reduce_scatter` (backward:
  all-gather): the region's result is local;
- a row-wise op (ROW_WISE: norms, residual adds, activations) on local rows stays local,
  its types re-derived (dim 1 divided by M); a whole value it reads beside them is a
  `tp_copy` (a parameter, a broadcast operand: its gradient is a sum over the ranks'
  rows) or, with the sequence dim, `sp_scatter`; one whose operands would not line up
  with a block of the tokens (one varying along B or T but not split alike: [1, T, d],
  [B, 1, d]) reads gathered rows instead, as any other op;
- any other op (the LM head's matmul, a router, a view) reads local rows through
  `sp_gather` (backward: this rank's rows of the whole gradient), so it sees all T rows;
  so does an output of the entry; a function reached with local rows returns local
  rows (a whole output with the sequence dim, as an MoE layer's, is scattered);
- dropout on local rows is refused (E008): each rank would draw the mask of its rows
  from the same generator state.

Functions are rewritten once; a function reached with other layouts (a block called
with whole and with local inputs) is E008. A rewritten function's backward is derived
again (derive_backward), from the primitives' rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.diagnostics import error
from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.ops.shapes_comm import local as local_dim
from modulec.types.dim_text import parse_dim

SEQ = 1  # the sequence dim of a [B, T, ...] activation
ROW_WISE = frozenset((
    "add", "add3", "mul", "scale", "neg", "exp", "exp_neg", "relu", "relu2", "gelu", "silu",
    "sigmoid", "swiglu", "geglu", "cast", "copy", "contiguous", "stop_gradient",
    "scale_gradient", "rmsnorm", "layernorm", "fused_residual_rmsnorm",
    "fused_residual_layernorm"))
CONSTANTS = ("zeros", "ones", "fill")
WHOLE, LOCAL, GATHERED = "whole", "local", "gathered"


def apply_sequence_parallel(graph: Graph, context) -> Graph:
    plan = getattr(context, "tensor_parallel", None)
    if plan is None or plan.size == 1 or not getattr(plan, "sequence_parallel", False):
        return graph
    entry = graph.function(graph.entry)
    first = entry.inputs[0].shape if entry.inputs else ()
    run = _Pass(graph, plan.size, context, first[SEQ] if len(first) > SEQ else None)
    run.function(entry, (WHOLE,) * len(entry.inputs))
    rewritten = run.rewritten
    functions = tuple(rewritten.get(f.name, f) for f in graph.functions
                      if f.gradient_of not in rewritten)  # derived again
    return Graph(graph.model, graph.entry, "" if rewritten else graph.backward, functions)


@dataclass
class _Pass:
    graph: Graph
    size: int
    context: object
    seq: str | None  # the whole sequence dim, as text (the entry's first input's dim 1)
    rewritten: dict = field(default_factory=dict)  # function name -> Function
    layouts: dict = field(default_factory=dict)  # function name -> (inputs, outputs)
    _regions: dict = field(default_factory=dict)  # function name -> holds a region

    def function(self, function: Function, inputs: tuple) -> tuple:
        """Rewrite `function` for its inputs' layouts; the layouts of its outputs."""
        seen = self.layouts.get(function.name)
        if seen is not None:
            if seen[0] != inputs:
                self._error(function, function.nodes[0] if function.nodes else None,
                            f"`{function.module}` is called with {_show(inputs)} inputs "
                            f"and with {_show(seen[0])} ones")
            return seen[1]
        self.layouts[function.name] = (inputs, tuple(WHOLE for _ in function.outputs))
        done = _Function(self, function, inputs).run()
        if done.function != function:  # one it left as it was keeps its own backward
            self.rewritten[function.name] = done.function
        self.layouts[function.name] = (inputs, done.outputs)
        return done.outputs

    def has_region(self, name: str) -> bool:
        """Whether the function (or one it calls) holds a tensor-parallel region."""
        if name not in self._regions:
            self._regions[name] = False
            function = self.graph.function(name)
            self._regions[name] = any(
                n.target in ("tp_copy", "tp_all_reduce") or
                (n.kind == "call" and self.has_region(n.target)) for n in function.nodes)
        return self._regions[name]

    def _error(self, function: Function, node: Node | None, problem: str,
               code: str = "E008") -> None:
        from modulec.lower.tensor_parallel import _span

        span = _span(self.context, node.span) if node is not None else None
        self.context.diagnostics.append(error(
            code, f"sequence parallel: {problem}", span, "here",
            notes=[f"in `{function.module}` ({function.scope}) at tp_size {self.size} "
                   "with `--sp`"],
            help=["build without `--sp` (tensor parallel alone), or see docs/distributed.md, "
                  "Sequence parallel"]))


def _show(layouts: tuple) -> str:
    return "(" + ", ".join(layouts) + ")"


@dataclass
class _Function:
    owner: _Pass
    function: Function
    inputs: tuple
    nodes: list = field(default_factory=list)
    layout: dict = field(default_factory=dict)  # value -> LOCAL | GATHERED (else whole)
    shapes: dict = field(default_factory=dict)  # value -> its local shape
    values: list = field(default_factory=list)  # values this pass adds
    made_by: dict = field(default_factory=dict)  # value -> index in self.nodes
    # value -> its uses: each input slot of a node and each return (not
    # modulec.plan.in_place.readers_of, distinct reader nodes without the returns): a
    # constant is made local in place only where the scatter is its one use
    readers: dict = field(default_factory=dict)
    outputs: tuple = ()  # the layouts of what it returns
    returned: tuple = ()  # what it returns (a whole output with the sequence dim scattered)
    _count: int = 0

    def run(self) -> "_Function":
        f = self.function
        for node in f.nodes:
            for value in node.inputs:
                self.readers[value] = self.readers.get(value, 0) + 1
        for value in f.outputs:
            self.readers[value] = self.readers.get(value, 0) + 1
        for info, layout in zip(f.inputs, self.inputs):
            if layout == LOCAL:
                self._make_local(info.id)
        for node in f.nodes:
            self._node(node)
        self.returned = f.outputs
        self._finish_outputs()
        self.function = replace(
            f, nodes=tuple(self.nodes), outputs=tuple(self.returned),
            inputs=tuple(self._typed(v) for v in f.inputs),
            values=tuple(self._typed(v) for v in f.values) + tuple(self.values))
        return self

    # ------------------------------------------------------------------ nodes
    def _node(self, node: Node) -> None:
        kinds = {self.layout.get(v, WHOLE) for v in node.inputs if v}
        if node.kind == "call":
            return self._call(node)
        if node.kind == "alias":
            return self._emit(node, self.layout.get(node.inputs[0], WHOLE))
        if node.target == "tp_copy" and LOCAL in kinds:
            return self._emit(self._renamed(node, "tp_copy", "sp_all_gather"), GATHERED,
                              whole_outputs=True)
        if node.target == "vocab_parallel_embedding":  # every token's partial sum: the
            return self._emit(node, GATHERED, whole_outputs=True)  # all-reduce scatters it
        if node.target == "tp_all_reduce" and GATHERED in kinds and \
                self._splits(node.outputs[0]):
            return self._emit(self._renamed(node, "tp_all_reduce", "sp_reduce_scatter"),
                              LOCAL)
        if GATHERED in kinds:
            if LOCAL in kinds:
                self._fail(node, f"`{node.target}` reads a sequence-split value inside a "
                           "tensor-parallel region")
            return self._emit(node, GATHERED, whole_outputs=True)
        if LOCAL not in kinds:
            return self._emit(node, WHOLE)
        if node.target == "dropout":  # reported; kept, so that the IR stays valid
            self._fail(node, "dropout on sequence-split rows is not supported yet (each "
                       "rank would draw its rows' mask from the same state)")
        if (node.target in ROW_WISE and self._rows_agree(node)) or node.target == "dropout":
            return self._emit(replace(node, inputs=tuple(self._beside(v, node)
                                                         for v in node.inputs)), LOCAL)
        inputs = tuple(self._gather(v, node) if self.layout.get(v) == LOCAL else v
                       for v in node.inputs)
        self._emit(replace(node, inputs=inputs), WHOLE)

    def _rows_agree(self, node: Node) -> bool:
        """Whether a row-wise op may run on this rank's rows. A rank holds a block of the
        B x T tokens flattened (runtime/kernels/comm.py), not of each sequence, so every
        operand with the sequence dim must have the same batch dims (split alike), and
        any other must not vary along B or T (a weight, a [1, 1, d] broadcast); else the
        op reads gathered rows (always correct)."""
        out = len(self._info(node.outputs[0]).shape) if node.outputs and node.outputs[0] \
            else 0
        rows = set()
        for value in (v for v in node.inputs if v):
            shape = self._info(value).shape
            if self.layout.get(value) == LOCAL or self._has_seq(value):
                rows.add(tuple(shape[:SEQ]))  # the batch dims (the sequence is T or T / M)
                continue
            first = out - len(shape)  # right-aligned: dims at or before SEQ must be 1
            if any(str(d) != "1" for i, d in enumerate(shape) if first + i <= SEQ):
                return False
        return len(rows) <= 1

    def _renamed(self, node: Node, old: str, new: str) -> Node:
        """The tensor-parallel collective `node` as its sequence-parallel counterpart."""
        return replace(node, id=node.id.replace(old, new), target=new, attrs=self._attrs())

    def _call(self, node: Node) -> None:
        callee = self.owner.graph.function(node.target)
        inputs = node.inputs
        if self.function.name == self.owner.graph.entry and self.owner.has_region(node.target):
            inputs = tuple(self._scatter(v, node) if self._has_seq(v) and
                           self.layout.get(v, WHOLE) == WHOLE else v for v in inputs)
        layouts = tuple(self.layout.get(v, WHOLE) for v in inputs)
        if GATHERED in layouts:  # reported; the callee is rewritten as if it were whole
            self._fail(node, f"a gathered value is passed to `{callee.module}`")
            layouts = tuple(WHOLE if k == GATHERED else k for k in layouts)
        outputs = self.owner.function(callee, layouts)
        if int(node.repeat) != 1 and tuple(outputs) != layouts[:len(outputs)]:
            self._fail(node, f"`{callee.module}` runs {node.repeat} times, but returns "
                       f"{_show(tuple(outputs))} values for {_show(layouts)} inputs")
        self.nodes.append(replace(node, inputs=inputs))
        for value, layout in zip(node.outputs, outputs):
            if value and layout == LOCAL:
                self._make_local(value)
            self._made(value)

    def _emit(self, node: Node, layout: str, whole_outputs: bool = False) -> None:
        self.nodes.append(node)
        for value in node.outputs:
            if not value:
                continue
            self._made(value)
            if layout == LOCAL and not whole_outputs:
                self._make_local(value)
            elif layout != WHOLE:
                self.layout[value] = layout

    def _made(self, value: str) -> None:
        if value:
            self.made_by[value] = len(self.nodes) - 1

    # ------------------------------------------------------------------ layouts
    def _beside(self, value: str, node: Node) -> str:
        """A whole value a row-wise op reads beside local rows: scattered when it has the
        sequence dim, else (a parameter, a broadcast operand) summed over the ranks'
        gradients by tp_copy."""
        if not value or self.layout.get(value) == LOCAL:
            return value
        if self._has_seq(value):
            return self._scatter(value, node)
        return self._insert(node, "tp_copy", value, self._info(value).shape, "copy")

    def _scatter(self, value: str, before: Node) -> str:
        info = self._info(value)
        shape = self._local_shape(info, before)
        if shape is None:
            return value
        at = self.made_by.get(value)
        made = self.nodes[at] if at is not None else None
        if made is not None and made.target in CONSTANTS and self.readers.get(value) == 1:
            self.nodes[at] = replace(made, attrs=tuple(
                (k, _local_attr(v, self.owner.size) if k == "shape" else v)
                for k, v in made.attrs))
            self._make_local(value)
            return value
        new = self._insert(before, "sp_scatter", value, shape, "local")
        self.layout[new] = LOCAL
        return new

    def _gather(self, value: str, before: Node) -> str:
        whole = self._info(value).shape
        return self._insert(before, "sp_gather", value, whole, "whole")

    def _insert(self, before: Node, op: str, value: str, shape: tuple, what: str) -> str:
        self._count += 1
        info = self._info(value)
        new = f"%sp_{what}{self._count}"
        self.values.append(ValueInfo(new, tuple(shape), info.dtype))
        attrs = self._attrs() if op.startswith("sp_") else (("group", "tp"),
                                                            ("size", self.owner.size))
        self.nodes.append(Node(f"{before.id}.{op}{self._count}", "op", op, (value,), (new,),
                               attrs, phase=before.phase, span=before.span))
        self._made(new)
        return new

    def _splits(self, value: str) -> bool:
        """Whether the value's sequence dim splits evenly (else it stays whole here, and
        the scatter before the first region reports E027 naming it)."""
        shape = self._info(value).shape
        return len(shape) > SEQ and shape[0] != "*" and \
            local_dim(parse_dim(shape[SEQ]), self.owner.size) is not None

    def _make_local(self, value: str) -> None:
        info = self._info(value)
        shape = self._local_shape(info, None)
        if shape is not None:
            self.shapes[value] = shape
        self.layout[value] = LOCAL

    def _local_shape(self, info: ValueInfo, node: Node | None) -> tuple | None:
        if len(info.shape) <= SEQ or info.shape[0] == "*":
            self._fail(node, f"`{info.name or info.id}` has no sequence dim (dim {SEQ}) to "
                       "split")
            return None
        part = local_dim(parse_dim(info.shape[SEQ]), self.owner.size)
        if part is None:
            self._fail(node, f"dim {SEQ} of `{info.name or info.id}` ({info.shape[SEQ]}, the "
                       f"sequence) is not divisible by tp_size {self.owner.size}", "E027")
            return None
        return info.shape[:SEQ] + (str(part),) + info.shape[SEQ + 1:]

    def _has_seq(self, value: str) -> bool:
        """Whether a whole value has the sequence dim (a parameter never has)."""
        info = self._info(value)
        return not value.startswith("param:") and len(info.shape) > SEQ and \
            info.shape[0] != "*" and self.owner.seq in (None, info.shape[SEQ])

    def _finish_outputs(self) -> None:
        """The entry returns whole values: a local output is gathered (its id kept, so
        the runtime finds it by name)."""
        f = self.function
        if f.name != self.owner.graph.entry:
            if LOCAL in self.inputs and self.nodes:  # what flows between regions is local
                self.returned = tuple(self._scatter(o, self.nodes[-1]) if self._has_seq(o)
                                      and self.layout.get(o, WHOLE) == WHOLE else o
                                      for o in f.outputs)
            self.outputs = tuple(self.layout.get(o, WHOLE) for o in self.returned)
            return
        for output in f.outputs:
            if self.layout.get(output) == LOCAL:
                self._rename_gather(output)
        self.outputs = tuple(WHOLE for _ in f.outputs)

    def _rename_gather(self, output: str) -> None:
        self._count += 1
        new = f"%sp_out{self._count}"
        rename = lambda vs: tuple(new if v == output else v for v in vs)  # noqa: E731
        self.nodes = [replace(n, inputs=rename(n.inputs), outputs=rename(n.outputs))
                      for n in self.nodes]
        info = self._info(output)
        self.values.append(ValueInfo(new, self.shapes.pop(output, info.shape), info.dtype))
        self.layout[new], self.layout[output] = LOCAL, WHOLE
        last = self.nodes[-1]
        self.nodes.append(Node(f"{last.id}.sp_gather{self._count}", "op", "sp_gather",
                               (new,), (output,), self._attrs(), phase=last.phase,
                               span=last.span))

    # ------------------------------------------------------------------ helpers
    def _info(self, value: str) -> ValueInfo:
        found = self.function.value(value)
        if found is None:
            found = next(v for v in self.values if v.id == value)
        return found

    def _typed(self, info: ValueInfo) -> ValueInfo:
        shape = self.shapes.get(info.id)
        return info if shape is None else replace(info, shape=shape)

    def _attrs(self) -> tuple:
        return (("dim", SEQ), ("group", "tp"), ("size", self.owner.size))

    def _fail(self, node: Node | None, problem: str, code: str = "E008") -> None:
        self.owner._error(self.function, node, problem, code)


def _local_attr(shape, size: int):
    """A constant's `shape` attribute with its sequence dim divided."""
    dims = list(shape)
    seq = dims[SEQ]
    dims[SEQ] = seq // size if isinstance(seq, int) else str(local_dim(parse_dim(str(seq)),
                                                                        size))
    return dims
