"""Tensor parallel (`--tp M`, spec §7.6.1): one rank's program of M, Megatron-style.

A module marks its parameters `@shard(column)` (the output dim of an `[out, in]` weight
multiplied as x @ W^T: QKV, gate/up) or `@shard(row)` (its input dim: O, down) and writes
its shapes and graph over this rank's part, `num_heads // tp_size` heads, `d_ff //
tp_size` columns (`tp_size` is the build's topology constant, 1 without `--tp`, so the
same module is the unsharded one). Then, for tp_size = M:

- `shards` reads each sharded parameter's layout (the dim, the global parts it is made
  of, each split evenly across the ranks) and reports a sharding that cannot work: a
  dim or a part not divisible by M (E027), a shape not written over the local part, a
  row shard of a vector (E008);
- the `tensor_parallel` pass puts the conjugate pair around each sharded region of a
  function: `tp_copy` (identity forward, all-reduce backward) before the activation of a
  column-parallel matmul and before a replicated parameter read inside the region (its
  gradient is a sum over the ranks' heads), `tp_all_reduce` (all-reduce forward,
  identity backward) after a row-parallel matmul; a sharded value that reaches anything
  else (a call, the function's outputs, a second column matmul) is a layout conflict
  (E008). A rewritten function's written backward is dropped: derive_backward derives
  it from the primitives' rules, where each collective's gradient is the other;
- `@shard(vocab)` on a [V, D] table (the embedding, the LM head; a tied head shares its
  table's shard): its `embedding` lookup becomes `vocab_parallel_embedding` (zeros for a
  token outside the rank's rows) + `tp_all_reduce`, its matmul is column-parallel and the
  result may be an output of the model's forward, split over the vocabulary (the
  section's `vocab_outputs`: the trainers take the vocab-parallel loss on it);
- `section` is the document's `tensor_parallel` section (each sharded parameter's
  layout, by function), and `shard_weight_schema` gives the weight schema's sharded
  entries their global shape and layout, so that each rank loads its slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.check.sharding import STRATEGIES, dims_at
from modulec.diagnostics import error
from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.lower.pass_result import PassResult
from modulec.semantic.consteval import NotConst, Undefined, evaluate
from modulec.syntax.printer import expr as show
from modulec.types.dims import Dim
MATMULS = ("matmul", "grouped_gemm")  # ops whose second input is an [.., out, in] weight
SP_NEEDS_TP = ("--sp splits the sequence across the tensor-parallel ranks: give --tp M "
               "(M of at least 2)")


def sequence_parallel_problem(tp: int | None, sp: bool) -> str | None:
    """`--sp` without a tensor-parallel group to split over: the one message the CLI (a
    usage error), the build (E008) and the runtime (runtime.dist.context) give; None when
    `sp` is off or `tp` is at least 2."""
    return SP_NEEDS_TP if sp and not (tp and tp > 1) else None


@dataclass(frozen=True)
class Shard:
    """A parameter's split across `size` ranks: along `dim` (of the global shape), made
    of `parts` (global sizes along `dim`, in elements: q, k, v rows), each part split into
    `size` equal blocks, rank r holding block r of every part."""

    strategy: str
    dim: int
    parts: tuple[int, ...]
    size: int

    def data(self) -> dict:
        return {"strategy": self.strategy, "dim": self.dim, "parts": list(self.parts),
                "size": self.size}


@dataclass
class TensorParallel:
    """What the pass needs: the group size and, by function, its sharded parameters."""

    size: int
    shards: dict = field(default_factory=dict)  # function name -> {param id: Shard}
    # `--sp`: the residual stream split along the sequence between the sharded regions
    # (modulec.lower.sequence_parallel)
    sequence_parallel: bool = False
    # the entry's outputs split over the vocabulary (the logits of a `@shard(vocab)` head),
    # found by the pass
    vocab_outputs: list = field(default_factory=list)
    # each backward collective after a matmul backward overlapped with its weight gradient
    # (modulec.lower.tp_overlap; `--no-tp-overlap`: off)
    overlap: bool = True

    def extended(self, shards: dict, vocab_outputs=()) -> "TensorParallel":
        """A new plan with more sharded parameters (function -> {param id: Shard}) and
        vocabulary-split outputs: what a pass returns, merged by run_pipeline."""
        merged = {name: dict(found) for name, found in self.shards.items()}
        for name, found in shards.items():
            merged.setdefault(name, {}).update(found)
        return replace(self, shards=merged,
                       vocab_outputs=list(self.vocab_outputs) + list(vocab_outputs))


# ====================================================================== reading @shard
def shards(world, model, function_name) -> TensorParallel:
    """The sharded parameters of every instance under `model` at the world's tp_size;
    problems go to world.diagnostics (reported also while instantiating quietly)."""
    size = world.dims["tp_size"].value
    plan = TensorParallel(size)
    for instance in _instances(model):
        found = {}
        for param in instance.definition.params:
            shard = _shard_of(world, instance, param, size)
            if shard is not None:
                found[f"param:{param.name}"] = shard
        for name, value in instance.params.items():  # a tied head is its table's shard
            target = getattr(value, "tied_to", None)
            if target is not None and f"param:{target}" in found:
                found[f"param:{name}"] = found[f"param:{target}"]
        if found:
            plan.shards[function_name(world, instance)] = found
    return plan


def _instances(model):
    from modulec.check.instance import Stack, Submodule

    seen, todo = set(), [model]
    while todo:
        instance = todo.pop()
        if id(instance) in seen:
            continue
        seen.add(id(instance))
        yield instance
        todo += [v.instance for v in instance.params.values() if isinstance(v, (Submodule, Stack))]


def _shard_of(world, instance, param, size: int) -> Shard | None:
    from modulec.check.annotation_table import argument_values
    from modulec.check.instance import TensorParamValue
    from modulec.check.sharding import env_at, shard_note, shard_strategy, sharded_dim

    note = shard_note(param)
    value = instance.params.get(param.name)
    if note is None or size == 1 or not isinstance(value, TensorParamValue):
        return None
    strategy = shard_strategy(note)
    if strategy not in STRATEGIES:
        return None
    local = [d.value for d in value.type.dims]
    report = _Reporter(world, instance, param, strategy)
    if (strategy == "row" and len(local) < 2) or not local:
        return report.fail("E008", f"a {strategy} shard splits a dim of an [out, in] "
                           f"weight; `{param.name}` has {len(local)} dim(s)")
    dim = sharded_dim(strategy, len(local))
    unsharded = env_at(instance, Dim.const(1))
    whole = _whole_dims(param.type, unsharded)
    if whole is None or len(whole) != len(local):
        return report.fail("E008", f"the shape of `{param.name}` without tensor parallel "
                           "(tp_size = 1) is not a list of compile-time sizes")
    parts_node = _let_list(instance, argument_values(note).get("parts"))
    parts = _parts(parts_node, unsharded, whole[dim], report, dim)
    if parts is None:
        return None
    if local[dim] * size != whole[dim]:
        return report.fail("E008", f"dim {dim} of `{param.name}` is {local[dim]} at tp_size "
                           f"{size}, not {whole[dim]} // {size}: write the shape over this "
                           "rank's part (`d_ff // tp_size`)", dim)
    return Shard(strategy, dim, parts, size)


def _let_list(instance, node):
    """`parts=qkv_parts`: the list its `let` binds (so a message names its items)."""
    from modulec.syntax import ast as A

    if not isinstance(node, A.Name):
        return node
    binding = next((b for b in instance.definition.lets
                    if getattr(b.target, "id", None) == node.id), None)
    return binding.value if binding is not None and isinstance(binding.value, A.ListExpr) \
        else node


def _parts(node, env, total: int, report, dim: int) -> tuple[int, ...] | None:
    """The parts along the sharded dim in elements; each unit-count must split evenly."""
    size = report.size
    if node is None:
        if total % size:
            return report.fail("E027", f"dim {dim} ({total}) is not divisible by tp_size "
                               f"{size}", dim)
        return (total,)
    counts = []
    if not hasattr(node, "items"):
        return report.fail("E008", f"`parts={show(node)}` is not a list of sizes", dim)
    for item in node.items:
        item = getattr(item, "value", item)
        count = _int(item, env)
        if count is None:
            return report.fail("E008", f"part `{show(item)}` of `parts` is not a "
                               "compile-time size", dim)
        if count % size:
            return report.fail("E027", f"dim {dim} part `{show(item)}` = {count} is not "
                               f"divisible by tp_size {size}", dim)
        counts.append(count)
    if not counts or total % sum(counts):
        return report.fail("E008", f"`parts` add up to {sum(counts)}, which does not divide "
                           f"dim {dim} ({total})", dim)
    unit = total // sum(counts)
    return tuple(c * unit for c in counts)


_HELP = {"column": "choose a `--tp` that divides it (num_heads and num_kv_heads for "
                   "attention, d_ff for an MLP)",
         "vocab": "choose a `--tp` that divides vocab_size, or build with a vocab_size "
                  "padded to a multiple of it (a checkpoint's table then needs the same "
                  "padding rows; the vocabulary is not padded for you)"}


@dataclass
class _Reporter:
    world: object
    instance: object
    param: object
    strategy: str

    @property
    def size(self) -> int:
        return self.world.dims["tp_size"].value

    def fail(self, code: str, problem: str, dim: int | None = None) -> None:
        name = self.param.name
        where = f"dim {dim} of `{name}`" if dim is not None else f"`{name}`"
        diagnostic = error(code, f"`@shard({self.strategy})` of `{name}` cannot split "
                           f"across tp_size {self.size}: {problem}", self.param.span,
                           f"{where} in {self.instance.describe()}",
                           help=[_HELP.get(self.strategy, _HELP["column"])])
        key = (diagnostic.code, diagnostic.message, diagnostic.primary_span)
        if key not in self.world._seen:  # also while the instance was made quietly
            self.world._seen.add(key)
            self.world.diagnostics.append(diagnostic)
        return None


def _whole_dims(type_node, env) -> list[int] | None:
    """A parameter's dims at tp_size = 1, as integers (None if one is not known)."""
    dims = dims_at(type_node, env)
    if dims is None or not all(d.is_const for d in dims):
        return None
    return [d.value for d in dims]


def _int(node, env) -> int | None:
    try:
        value = evaluate(node, env)
    except (NotConst, Undefined):
        return None
    return value.value if isinstance(value, Dim) and value.is_const else None


# ====================================================================== the pass
def apply_tensor_parallel(graph: Graph, context) -> Graph | PassResult:
    plan = getattr(context, "tensor_parallel", None)
    if plan is None or plan.size == 1 or not plan.shards:
        return graph
    rewritten: dict[str, Function] = {}
    vocab: list = []  # the outputs split over the vocabulary, by name (as the runtime's)
    for function in graph.functions:
        found = plan.shards.get(function.name)
        if found and not function.gradient_of:
            rewrite = _Rewrite(function, found, plan.size, context,
                               entry=function.name == graph.entry)
            rewritten[function.name] = rewrite.run()
            vocab += [function.value(o).name or o for o in function.outputs
                      if o in rewrite.vocab]
    functions = tuple(rewritten.get(f.name, f) for f in graph.functions
                      if f.gradient_of not in rewritten)  # derived again, with the pair
    return PassResult(Graph(graph.model, graph.entry, graph.backward if not rewritten else "",
                            functions), vocab_outputs=tuple(vocab))


@dataclass
class _Rewrite:
    function: Function
    shards: dict  # param id -> Shard
    size: int
    context: object
    nodes: list = field(default_factory=list)
    values: list = field(default_factory=list)
    sharded: set = field(default_factory=set)  # values split across the ranks
    copies: dict = field(default_factory=dict)  # value -> its tp_copy
    entry: bool = False  # the model's forward: its logits may stay split over the vocabulary
    vocab: set = field(default_factory=set)  # values split over the vocabulary (logits)

    def run(self) -> Function:
        for node in self.function.nodes:
            self._node(node)
        for output in self.function.outputs:
            if output in self.sharded and not (self.entry and output in self.vocab):
                self._conflict(self.function.nodes[-1], f"a column-sharded value (`{output}`) "
                               f"is an output of `{self.function.module}`: a row-sharded "
                               "matmul must reduce it first")
        return replace(self.function, nodes=tuple(self.nodes),
                       values=self.function.values + tuple(self.values))

    def _node(self, node: Node) -> None:
        shard = self.shards.get(node.inputs[1]) if node.kind == "op" and \
            node.target in MATMULS and len(node.inputs) > 1 else None
        if shard is not None and node.attr("transpose") != "NT":
            self._conflict(node, f"`{node.inputs[1][6:]}` is {shard.strategy}-sharded, so "
                           "it must be multiplied as x @ W^T (transpose=NT)")
        if shard is not None and shard.strategy in ("column", "vocab"):
            self._column(node)
            if shard.strategy == "vocab":  # an LM head: logits split over the vocabulary
                self.vocab.update(node.outputs[:1])
        elif shard is not None:
            self._row(node)
        else:
            self._other(node)

    def _column(self, node: Node) -> None:
        activation = node.inputs[0]
        if activation in self.sharded:
            self._conflict(node, f"`{node.inputs[1][6:]}` is column-sharded, but its input "
                           "is already split across the ranks")
        inputs = (self._copy(activation, node),) + node.inputs[1:]
        self.nodes.append(replace(node, inputs=inputs))
        self.sharded.update(node.outputs)

    def _row(self, node: Node) -> None:
        if node.inputs[0] not in self.sharded:
            self._conflict(node, f"`{node.inputs[1][6:]}` is row-sharded, but its input is "
                           "not split across the ranks (no column-sharded matmul before it)")
        partial = self._value_like(node.outputs[0], "partial")
        self.nodes.append(replace(node, outputs=(partial,) + node.outputs[1:], annotations=()))
        # the reduced value keeps the matmul's output id, so its readers and hooks see
        # what they see without tensor parallel
        self.nodes.append(Node(f"{node.id}.tp_all_reduce", "op", "tp_all_reduce", (partial,),
                               (node.outputs[0],), self._attrs(), node.annotations,
                               phase=node.phase, span=node.span))

    def _other(self, node: Node) -> None:
        if node.kind == "op" and node.target == "embedding" and len(node.inputs) > 1 and \
                getattr(self.shards.get(node.inputs[1]), "strategy", "") == "vocab":
            return self._embedding(node)
        inside = any(i in self.sharded or i in self.shards for i in node.inputs if i)
        if not inside:
            return self.nodes.append(node)
        if node.kind == "call":
            self._conflict(node, f"a value split across the ranks is passed to "
                           f"`{node.target.split('#')[0]}`: keep a sharded region inside one "
                           "module (column-sharded matmul ... row-sharded matmul)")
        elif not any(i in self.sharded for i in node.inputs if i):
            name = next(i for i in node.inputs if i in self.shards)[6:]
            self._conflict(node, f"`{name}` is sharded, but `{node.target}` reads it "
                           "outside a sharded region")
        # a replicated parameter read inside the region (Qwen3's q_norm) gets a partial
        # gradient on each rank: tp_copy sums it
        inputs = tuple(self._copy(i, node) if i.startswith("param:") and i not in self.shards
                       else i for i in node.inputs)
        self.nodes.append(replace(node, inputs=inputs))
        self.sharded.update(o for o in node.outputs if o)

    def _embedding(self, node: Node) -> None:
        """A lookup in this rank's rows of the table (zeros for other tokens), summed over
        the ranks: the whole embedding on every rank (Megatron's VocabParallelEmbedding)."""
        if node.inputs[0] in self.sharded:
            self._conflict(node, "the token ids of a vocab-sharded embedding are split "
                           "across the ranks")
        partial = self._value_like(node.outputs[0], "partial")
        self.nodes.append(replace(node, target="vocab_parallel_embedding",
                                  attrs=node.attrs + self._attrs(),
                                  outputs=(partial,), annotations=()))
        self.nodes.append(Node(f"{node.id}.tp_all_reduce", "op", "tp_all_reduce", (partial,),
                               node.outputs, self._attrs(), node.annotations,
                               phase=node.phase, span=node.span))

    def _copy(self, value: str, before: Node) -> str:
        if value not in self.copies:
            copy = self._value_like(value, "copy")
            self.nodes.append(Node(f"{before.id}.tp_copy{len(self.copies)}", "op", "tp_copy",
                                   (value,), (copy,), self._attrs(), phase=before.phase,
                                   span=before.span))
            self.copies[value] = copy
        return self.copies[value]

    def _value_like(self, value: str, what: str) -> str:
        info = self.function.value(value)
        new = f"%tp_{what}{len(self.values) + 1}"
        self.values.append(ValueInfo(new, info.shape, info.dtype))
        return new

    def _attrs(self) -> tuple:
        return (("group", "tp"), ("size", self.size))

    def _conflict(self, node: Node, problem: str) -> None:
        self.context.diagnostics.append(error(
            "E008", f"tensor parallel: {problem}", _span(self.context, node.span),
            "sharded layouts conflict here",
            notes=[f"in `{self.function.module}` ({self.function.scope}) at tp_size "
                   f"{self.size}"],
            help=["`@shard(column)` weights feed the region, `@shard(row)` weights end it "
                  "(spec §7.6.1)"]))


def _span(context, at: tuple):
    file, line, column = at
    source = context._source(file) if file else None
    if source is None or line < 1:
        return None
    return source.span(source.offset(line, column))


# ====================================================================== the document
def section(plan: TensorParallel) -> dict:
    """The document's `tensor_parallel` section: the size and each sharded parameter's
    layout by function (what a runtime needs to slice weights and to run the pair)."""
    sequence = {"sequence_parallel": True} if plan.sequence_parallel else {}
    vocab = {"vocab_outputs": list(plan.vocab_outputs)} if plan.vocab_outputs else {}
    return {"size": plan.size, "group": "tp", **sequence, **vocab, "overlap": plan.overlap,
            "shards": {function: {p[len("param:"):]: s.data() for p, s in sorted(found.items())}
                       for function, found in sorted(plan.shards.items())}}


def shard_weight_schema(schema: list, graph: Graph, plan: TensorParallel) -> list:
    """The schema with each sharded entry's global shape (what the checkpoint holds) and
    its layout (`shard`): a rank loads the whole tensor and keeps its slice."""
    by_path = sharded_patterns(graph, plan)
    out = []
    for entry in schema:
        shard = by_path.get(_pattern(entry["param"]))
        if shard is not None:
            entry = dict(entry, shard=shard.data())
            shape = list(entry["shape"])
            shape[shard.dim] = sum(shard.parts)
            entry["shape"] = shape
        out.append(entry)
    return out


def sharded_patterns(graph: Graph, plan: TensorParallel) -> dict:
    """Parameter path patterns (`blocks[*].attention.qkv_weight`) -> Shard."""
    found: dict = {}

    def walk(function: Function, path: str) -> None:
        for param, shard in plan.shards.get(function.name, {}).items():
            found[_join(path, param[len("param:"):])] = shard
        for node in function.nodes:
            if node.kind == "call":
                name = node.attr("instance", "")
                index = "[*]" if node.attr("first") is not None else ""
                walk(graph.function(node.target), _join(path, name + index) if name else path)

    walk(graph.function(graph.entry), "")
    return found


def _pattern(path: str) -> str:
    import re

    return re.sub(r"\[(\{\w+\}|\d+)\]", "[*]", path)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
