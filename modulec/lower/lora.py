"""The `lora` pass (issue 6, spec §7.3.2 `@adapter`): low-rank adapters on annotated matmuls.

`@adapter(lora, ...)` marks an injection point; a build with LoRA on (`modulec build
--lora rank=8,alpha=16,targets=[q,v]`, `BuildRequest.lora`) rewrites each one. The
annotation sits on a matmul `y = x @ W^T` (NT, W a parameter) or on a module call whose
output is such a matmul (optionally plus a bias parameter); anything else is E008.

    y = x @ W^T                  becomes      y0 = x @ W^T
                                              y  = y0 + (alpha/rank) * (x @ A^T) @ B^T

with parameters `W.lora_A: [rank, in]` and `W.lora_B: [out, rank]` next to W. A fused
projection (qkv_weight: q, k, v rows; up_weight: gate, up rows) has one part per fused
tensor, named after its HF tensor (`q_proj` -> `q`) or the annotation's `targets`, sized by
the split that follows it; each selected part gets its own A and B (`qkv_weight.q.lora_A`),
so the adapters are PEFT's per-module ones. The delta of a fused weight is taken for its
whole output at once (`fused_delta`: the selected parts' A stacked, their B laid
block-diagonally by one `block_diag`, one add into y0); where a part's size is not a number,
y0 is split, the selected parts get their delta, the parts are concatenated again. With
`dropout=p` the deltas read x through one `dropout` (seeded per step by the runtime; none
at inference). `@adapter(ia3)` on a value y makes it y * l, l a trained vector (ones at
first; `_with_ia3`). Only existing primitives (matmul with alpha, split, add, concat,
block_diag, dropout, mul), so the derived backward differentiates it; every base
parameter is frozen (`no_gradient`) and the backward functions written in the source are dropped (the
forward changed; all backward is derived). rank/alpha/targets come from the annotation;
the build option overrides them. Under tensor parallel (`--tp M`) the pass adapts one
rank's program: each adapter splits as its weight does, the other matrix read through a
`tp_copy` (modulec/lower/lora_tp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.diagnostics import error
from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.lower.backward import without_written_backward
from modulec.lower.lora_tp import adapter_shards, replicated, whole_rows
from modulec.lower.pass_result import PassResult

DEFAULT_RANK = 16  # spec §7.3.2
DEFAULT_ALPHA = 32.0
IA3_SUFFIX = "ia3_l"  # PEFT's name of the (IA)^3 scaling vector
ADAPTER_SUFFIXES = ("lora_A", "lora_B", IA3_SUFFIX)


@dataclass(frozen=True)
class LoraOptions:
    """LoRA on: what the build option sets (None / () keep the annotation's values)."""
    rank: int | None = None
    alpha: float | None = None
    targets: tuple[str, ...] = ()
    dropout: float | None = None  # on the adapters' input (PEFT's lora_dropout)

    @classmethod
    def of(cls, value) -> "LoraOptions | None":
        """From a LoraOptions, a dict (`rank=8, alpha=16, targets=[q, v], dropout=0.1`),
        text, or None."""
        if value is None or isinstance(value, LoraOptions):
            return value
        if isinstance(value, str):
            return parse_lora(value)
        unknown = set(value) - {"rank", "alpha", "targets", "dropout"}
        if unknown:
            raise ValueError(f"unknown LoRA option(s): {', '.join(sorted(unknown))} "
                             f"(known: rank, alpha, targets, dropout)")
        targets = value.get("targets") or ()
        rank, alpha, dropout = value.get("rank"), value.get("alpha"), value.get("dropout")
        return _checked(cls(int(rank) if rank is not None else None,
                            float(alpha) if alpha is not None else None,
                            (targets,) if isinstance(targets, str) else tuple(targets),
                            float(dropout) if dropout is not None else None))


def parse_lora(text: str) -> LoraOptions:
    """`rank=8,alpha=16,targets=[q,v]` (targets also `q+v`); an empty text: all defaults."""
    fields: dict = {}
    for item in _top_level_items(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"`{item}`: expected name=value")
        key, value = key.strip(), value.strip()
        if key == "targets":
            fields[key] = [t.strip() for t in value.strip("[]").replace("+", ",").split(",")
                           if t.strip()]
        else:
            fields[key] = value
    return LoraOptions.of(fields)


def _top_level_items(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [i.strip() for i in items + [current] if i.strip()]


def _checked(options: LoraOptions) -> LoraOptions:
    if options.rank is not None and options.rank < 1:
        raise ValueError(f"LoRA rank must be positive, not {options.rank}")
    if options.dropout is not None and not 0 <= options.dropout < 1:
        raise ValueError(f"LoRA dropout is a probability below 1, not {options.dropout}")
    return options


def is_adapter(param: str) -> bool:
    """Whether a parameter name or path is a LoRA adapter matrix (`...lora_A`)."""
    return param.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


# ====================================================================== sites
@dataclass(frozen=True)
class Part:
    """Rows [start, start + rows) of a (possibly fused) weight, adapted on their own."""
    name: str  # q, k, v, o, gate, up, down; or the weight's name
    start: int
    rows: int | str  # text when the weight's rows are not a number (an unset size)
    hf_module: str = ""  # `model.layers.{i}.self_attn.q_proj` (from the weight schema)
    placeholders: tuple[str, ...] = ()  # the stack indices in hf_module, outermost first


@dataclass
class Site:
    function: str
    node: str  # the matmul's id
    weight: str  # param id (`param:qkv_weight`)
    parts: tuple[Part, ...]
    rank: int
    alpha: float
    annotation_targets: tuple[str, ...] = ()
    prefix: str = ""  # the function's parameter path prefix (`blocks[*].attention`)
    selected: tuple[Part, ...] = ()
    dropout: float = 0.0  # on the adapters' input x (PEFT's lora_dropout); 0: none
    shard: object = None  # the weight's tensor-parallel Shard (modulec/lower/lora_tp.py)


@dataclass
class LoraReport:
    """What the pass did, for the IR document's metadata (the runtime exports from it)."""
    adapters: list = field(default_factory=list)
    matched: set = field(default_factory=set)  # option targets some part answered to


def apply_lora(graph: Graph, context) -> Graph | PassResult:
    """The graph with each selected site adapted; beside it (a PassResult) the report and,
    with `--tp`, the split adapters' shards, which join the tensor-parallel plan."""
    options = getattr(context, "lora", None)
    if options is None:
        return graph
    from modulec.lower.lora_sites import find_sites
    from modulec.lower.lora_tp import weight_shard

    graph = without_written_backward(graph)
    sites = find_sites(graph, context)
    report = LoraReport()
    plan = getattr(context, "tensor_parallel", None)
    for site in sites:
        site.selected = _selected(site, options, report)
        site.rank = options.rank or site.rank
        site.alpha = options.alpha if options.alpha is not None else site.alpha
        site.dropout = options.dropout if options.dropout is not None else site.dropout
        site.shard = weight_shard(plan, site)
    _unmatched_targets(options, sites, report, context)
    sites = [s for s in sites if s.selected and not _split_problem(graph, s, context)]
    functions, shards = [], {}
    for function in graph.functions:
        rewritten, found = _rewrite(function, [s for s in sites if s.function == function.name],
                                    report)
        functions.append(_with_ia3(rewritten, context))
        if found:  # the split adapters (--tp) join the tensor_parallel section
            shards[function.name] = found
    return PassResult(Graph(graph.model, graph.entry, graph.backward, tuple(functions)),
                      shards=shards, lora_report=report)


def _split_problem(graph: Graph, site: Site, context) -> bool:
    """Whether the adapters of a tensor-parallel weight cannot split as it does (E008)."""
    from modulec.lower.lora_tp import problem

    if site.shard is None:
        return False
    function = graph.function(site.function)
    found = problem(site, function.value(site.weight).shape)
    if found is not None:
        context.diagnostics.append(error(
            "E008", f"LoRA on `{site.weight[len('param:'):]}` of `{function.module}` under "
            f"tensor parallel: {found}", None,
            help=["adapt another projection (`targets=[...]`), or train without `--tp`"]))
    return found is not None


def _names(part: Part, site: Site) -> set[str]:
    weight = site.weight[len("param:"):]
    names = {part.name, weight}
    if part.hf_module:
        names.add(part.hf_module.rsplit(".", 1)[-1])
    return names


def _selected(site: Site, options: LoraOptions, report: LoraReport) -> tuple[Part, ...]:
    wanted = set(options.targets or site.annotation_targets)
    if not wanted:
        return site.parts
    chosen = []
    for part in site.parts:
        hits = _names(part, site) & wanted
        report.matched |= hits
        if hits:
            chosen.append(part)
    return tuple(chosen)


def _unmatched_targets(options, sites, report, context) -> None:
    missing = [t for t in options.targets if t not in report.matched]
    if not missing:
        return
    known = sorted({p.name for s in sites for p in s.parts})
    context.diagnostics.append(error(
        "E008", f"LoRA target(s) {', '.join(f'`{t}`' for t in missing)} match no "
        "`@adapter(lora)` injection point", None,
        help=[f"targets here: {', '.join(known) or 'none (no @adapter(lora) in the model)'}"]))


# ====================================================================== rewriting
def _rewrite(function: Function, sites: list[Site], report: LoraReport) -> tuple[Function, dict]:
    """(the function with its sites adapted and its base parameters frozen, param id ->
    Shard of its adapters that are split under `--tp`)."""
    base = tuple(p.id for p in function.params)
    frozen = tuple(dict.fromkeys(function.no_gradient + base))
    if not sites:
        return replace(function, no_gradient=frozen), {}
    builder = _Rewriter(function)
    by_node = {s.node: s for s in sites}
    for node in function.nodes:
        if node.id in by_node:
            builder.adapt(node, by_node[node.id], report)
        else:
            builder.nodes.append(node)
    nodes = tuple(replace(n, id=f"f{i}") for i, n in enumerate(builder.nodes))
    return replace(function, params=function.params + tuple(builder.params),
                   values=function.values + tuple(builder.values), nodes=nodes,
                   no_gradient=frozen), builder.shards


def _with_ia3(function: Function, context) -> Function:
    """`@adapter(ia3)` on a value y: y = y0 * l, l a trained vector over y's last dim (ones
    at first: the base model), named after the weight of the matmul that makes y0
    (`v_weight.ia3_l`) or after y. Applied after the LoRA rewrite, so l is not frozen."""
    sites = [n for n in function.nodes
             if any(name == "adapter" and args and args[0] == "ia3"
                    for name, args in n.annotations)]
    if not sites:
        return function
    nodes, params, values = [], [], []
    for node in function.nodes:
        if node not in sites or len(node.outputs) != 1:
            if node in sites:
                context.diagnostics.append(error(
                    "E008", f"`@adapter(ia3)` is on `{node.target}`, which makes "
                    f"{len(node.outputs)} values: put it on one of them", None))
            nodes.append(node)
            continue
        info = function.value(node.outputs[0])
        vector = f"param:{_ia3_owner(function, node, info)}.{IA3_SUFFIX}"
        base = f"%ia3_{len(values) + 1}"
        values.append(ValueInfo(base, info.shape, info.dtype))
        params.append(ValueInfo(vector, (info.shape[-1],), info.dtype, vector[6:]))
        adapter = tuple(a for a in node.annotations if a[0] == "adapter")
        nodes.append(replace(node, outputs=(base,), annotations=adapter))
        nodes.append(Node(node.id, "op", "mul", (base, vector), node.outputs, (),
                          tuple(a for a in node.annotations if a[0] != "adapter"), 1,
                          node.phase, node.span))
    nodes = [replace(n, id=f"f{i}") for i, n in enumerate(nodes)]
    return replace(function, params=function.params + tuple(params),
                   values=function.values + tuple(values), nodes=tuple(nodes))


def _ia3_owner(function: Function, node: Node, info: ValueInfo) -> str:
    if node.target == "matmul" and len(node.inputs) > 1 and node.inputs[1].startswith("param:"):
        return node.inputs[1][len("param:"):]
    return info.name or info.id.lstrip("%")


@dataclass
class _Rewriter:
    function: Function
    nodes: list = field(default_factory=list)
    params: list = field(default_factory=list)
    values: list = field(default_factory=list)
    counter: int = 0
    shards: dict = field(default_factory=dict)  # --tp: the split adapters' Shards

    def value(self, like: ValueInfo, last: str) -> str:
        self.counter += 1
        value_id = f"%lora{self.counter}"
        self.values.append(ValueInfo(value_id, like.shape[:-1] + (last,), like.dtype))
        return value_id

    def op(self, origin: Node, target: str, inputs, outputs, attrs=(), notes=()) -> None:
        self.nodes.append(Node(origin.id, "op", target, tuple(inputs), tuple(outputs),
                               tuple(attrs), tuple(notes), 1, origin.phase, origin.span))

    def adapt(self, node: Node, site: Site, report: LoraReport) -> None:
        """y = matmul(x, W) -> y0 = matmul(x, W); y = y0 + delta (per part when fused),
        the deltas reading x through a dropout when the site has one."""
        x = node.inputs[0]
        y = self.function.value(node.outputs[0])
        base = self.value(y, y.shape[-1])
        adapter = tuple(a for a in node.annotations if a[0] == "adapter")
        self.nodes.append(replace(node, outputs=(base,), annotations=adapter))
        if site.dropout > 0:
            x = self.dropped(node, x, site.dropout)
        keep = tuple(a for a in node.annotations if a[0] != "adapter")
        if len(site.parts) == 1:
            delta = self.delta(node, site, site.parts[0], x, y, report)
            self.op(node, "add", (base, delta), (y.id,), notes=keep)
            return
        if all(isinstance(p.rows, int) for p in site.parts):
            delta = self.fused_delta(node, site, x, y, report)
            self.op(node, "add", (base, delta), (y.id,), notes=keep)
            return
        pieces = [self.value(y, str(p.rows)) for p in site.parts]
        self.op(node, "split", (base,), pieces,
                (("dim", -1), ("sizes", [p.rows for p in site.parts])))
        for index, part in enumerate(site.parts):
            if part in site.selected:
                delta = self.delta(node, site, part, x, y, report)
                total = self.value(y, str(part.rows))
                self.op(node, "add", (pieces[index], delta), (total,))
                pieces[index] = total
        self.op(node, "concat", pieces, (y.id,), (("dim", -1),), notes=keep)

    def fused_delta(self, node, site: Site, x: str, y: ValueInfo, report) -> str:
        """The delta of a fused weight's whole output in one pass: the selected parts' A
        stacked ([k*rank, in], k selected parts), B block-diagonal ([out, k*rank]: part i's
        rows hold its B in columns [i*rank, (i+1)*rank), zeros elsewhere: `block_diag`,
        one op, with a band of zero rows for each run of unselected parts), so
        delta = (alpha / rank) * (x @ A_cat^T) @ B_blk^T equals the per-part deltas laid out
        side by side (the zero blocks add exact zeros). The parameters stay PEFT's per-part
        A and B; A_cat and B_blk are built from them each step (tiny), and each part's
        gradient is its block of the stacked ones."""
        weight = self.function.value(site.weight)
        rank, selected = site.rank, [p for p in site.parts if p in site.selected]
        width = str(rank * len(selected))
        a_parts, b_parts, zero_rows = [], [], [0]
        for part in site.parts:
            if part not in site.selected:
                zero_rows[-1] += part.rows
                continue
            stem = f"{site.weight}.{part.name}"
            a, b = f"{stem}.lora_A", f"{stem}.lora_B"
            self.params += [ValueInfo(a, (str(rank), weight.shape[1]), weight.dtype, a[6:]),
                            ValueInfo(b, (str(part.rows), str(rank)), weight.dtype, b[6:])]
            report.adapters.append(_entry(site, part, a[6:], b[6:]))
            self.shards.update(adapter_shards(site, part, a, b))
            a_parts.append(a)
            b_parts.append(b)
            zero_rows.append(0)
        a_cat = self.matrix(width, weight.shape[1], weight.dtype)
        b_blk = self.matrix(weight.shape[0], width, weight.dtype)
        if len(a_parts) == 1:
            a_cat = a_parts[0]
        else:
            self.op(node, "concat", a_parts, (a_cat,), (("dim", 0),))
        gaps = (("zero_rows", zero_rows),) if any(zero_rows) else ()
        self.op(node, "block_diag", b_parts, (b_blk,), gaps)
        low = self.value(y, width)
        delta = self.value(y, y.shape[-1])
        attrs = dict(node.attrs)
        self.op(node, "matmul", (x, self.read(node, site, "lora_A", a_cat)), (low,),
                tuple(attrs.items()))
        attrs["alpha"] = site.alpha / site.rank
        self.op(node, "matmul", (low, self.read(node, site, "lora_B", b_blk)), (delta,),
                tuple(attrs.items()))
        return delta

    def read(self, origin: Node, site: Site, which: str, value: str) -> str:
        """`value` (the site's A or B) as its matmul reads it: through a `tp_copy` where
        it is whole on every rank inside a tensor-parallel region (its gradient there
        is a partial sum over the ranks: modulec/lower/lora_tp.py)."""
        if replicated(site) != which:
            return value
        info = next(v for v in self.function.params + tuple(self.params) + tuple(self.values)
                    if v.id == value)
        copy = self.matrix(*info.shape, info.dtype)
        self.op(origin, "tp_copy", (value,), (copy,),
                (("group", "tp"), ("size", site.shard.size)))
        return copy

    def dropped(self, origin: Node, x: str, p: float) -> str:
        """x through dropout(p): one mask for all parts of a fused weight."""
        info = self.function.value(x)
        kept, mask = (self.value(info, info.shape[-1]) for _ in range(2))
        self.op(origin, "dropout", (x,), (kept, mask), (("p", p),))
        return kept

    def matrix(self, rows, cols, dtype: str) -> str:
        self.counter += 1
        value_id = f"%lora{self.counter}"
        self.values.append(ValueInfo(value_id, (str(rows), str(cols)), dtype))
        return value_id

    def delta(self, node, site: Site, part: Part, x: str, y: ValueInfo, report) -> str:
        """(alpha / rank) * (x @ A^T) @ B^T, with A: [rank, in], B: [rows, rank]."""
        weight = self.function.value(site.weight)
        stem = site.weight if len(site.parts) == 1 else f"{site.weight}.{part.name}"
        a, b = f"{stem}.lora_A", f"{stem}.lora_B"
        rank = str(site.rank)
        self.params += [ValueInfo(a, (rank, weight.shape[1]), weight.dtype, a[6:]),
                        ValueInfo(b, (str(part.rows), rank), weight.dtype, b[6:])]
        low = self.value(y, rank)
        delta = self.value(y, str(part.rows))
        attrs = dict(node.attrs)
        self.op(node, "matmul", (x, self.read(node, site, "lora_A", a)), (low,),
                tuple(attrs.items()))
        attrs["alpha"] = site.alpha / site.rank
        self.op(node, "matmul", (low, self.read(node, site, "lora_B", b)), (delta,),
                tuple(attrs.items()))
        report.adapters.append(_entry(site, part, a[6:], b[6:]))
        self.shards.update(adapter_shards(site, part, a, b))
        return delta


def _entry(site: Site, part: Part, a: str, b: str) -> dict:
    prefix = site.prefix
    join = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    return {"weight": join(site.weight[len("param:"):]), "target": part.name,
            "rows": list(whole_rows(site, part)), "rank": site.rank,
            "alpha": site.alpha, "dropout": site.dropout, "lora_A": join(a), "lora_B": join(b),
            "hf_module": part.hf_module, "placeholders": list(part.placeholders)}
