"""The `fuse` pass: chains of primitive ops become fused ops (spec §7.5; the patterns are
data in modulec.lower.fusion_patterns).

It runs on forward functions before `derive_backward`, so a fused op's backward is its
fused primitive's own rule (the runtime's fused backward kernel), as a hand-written
`fused_residual_rmsnorm` gets. Requests first: each `@fuse(pattern)` / `@fuse(ops=[...])`
flow must contain a match, or it is E013 (§7.5.1; the codes table: "the operations it
covers do not form that pattern"). Then the automatic patterns, wherever they match.

Barriers: a node marked `@nofuse`; a value hooked with `mode=modify|replace` (§5.11.3: it
stays materialized, the ops before and after it cannot fuse); an intermediate the fused
op would not output but something outside the chain reads (another consumer, the
function's outputs, a written backward). Fused nodes keep the first member's id and span
and record the chain (`fused_from`, `fused_spans`, `fused_intermediates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.diagnostics import error
from modulec.ir.graph import Function, Graph, Node
from modulec.lower.fusion_patterns import BY_NAME, PATTERNS, FusionPattern, Link

BARRIER_HOOKS = ("modify", "replace")


def fuse(graph: Graph, context) -> Graph:
    """Fuse every forward function (a derived or written backward is left as it is)."""
    readers = _backward_reads(graph)
    functions = tuple(f if f.gradient_of else _fuse_function(f, readers.get(f.name, set()),
                                                             context)
                      for f in graph.functions)
    return replace(graph, functions=functions)


def _backward_reads(graph: Graph) -> dict[str, set[str]]:
    """Forward values each written backward function reads (they must stay materialized)."""
    reads: dict[str, set[str]] = {}
    for function in graph.functions:
        if function.gradient_of:
            used = {i for n in function.nodes for i in n.inputs} | set(function.saved)
            reads.setdefault(function.gradient_of, set()).update(used)
    return reads


# ====================================================================== the function's view
@dataclass
class _View:
    function: Function
    backward_reads: set[str]
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # value -> uses
    producer: dict[str, int] = field(default_factory=dict)  # value -> node index
    hooked: set[str] = field(default_factory=set)  # values under a modify/replace hook

    def __post_init__(self) -> None:
        for index, node in enumerate(self.function.nodes):
            for slot, value in enumerate(node.inputs):
                if value:
                    self.consumers.setdefault(value, []).append((index, slot))
            for value in node.outputs:
                self.producer[value] = index
            if _writes_hook(node):
                self.hooked.update(node.outputs)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.function.nodes

    def escapes(self, value: str, members: set[int]) -> str:
        """Why `value` must be materialized outside a chain of `members`, or ""."""
        if value in self.function.outputs:
            return "is an output of the function"
        if value in self.backward_reads:
            return "is read by the written backward"
        outside = [_op(self.nodes[i]) for i, _ in self.consumers.get(value, ())
                   if i not in members]
        return f"is also read by {', '.join(outside)}" if outside else ""


def _writes_hook(node: Node) -> bool:
    return any(name == "hook" and any(a.replace(" ", "") in (f"mode={m}" for m in BARRIER_HOOKS)
                                      for a in args) for name, args in node.annotations)


def _name(view: _View, value: str) -> str:
    """`n` for a named value, else what makes it: "the output of `add` (f0)"."""
    info = view.function.value(value)
    if info is not None and info.name:
        return f"`{info.name}`"
    maker = view.nodes[view.producer[value]] if value in view.producer else None
    return f"the output of {_op(maker)}" if maker is not None else f"`{value}`"


def _op(node: Node) -> str:
    return f"`{node.target}` ({node.id})"


# ====================================================================== matching
@dataclass
class Match:
    pattern: FusionPattern
    members: tuple[int, ...]  # node indices, chain order
    at: int = -1  # where a fused op goes (index of a member)


def match_at(view: _View, pattern: FusionPattern, start: int):
    """The match of `pattern` whose chain starts at node `start`: (Match, "") or
    (None, why not; "" when the chain's ops are simply not there). Nodes already fused
    (or in a group) take part in no other match."""
    if not _is_op(view.nodes[start], pattern.chain[0]):
        return None, ""
    members = [start]
    for link in pattern.chain[1:]:
        following = _follower(view, members[-1], link)
        if following is None:
            return None, ""
        members.append(following)
    found = Match(pattern, tuple(members))
    why = _barrier(view, found) or _condition(view, found) or _placement(view, found)
    return (None, why) if why else (found, "")


def _is_op(node: Node, link: Link) -> bool:
    fused = any(name in ("fusion", "fusion_group") for name, _ in node.attrs)
    return node.kind == "op" and node.phase == "forward" and node.target in link.ops \
        and not fused


def _follower(view: _View, previous: int, link: Link) -> int | None:
    """The first node after `previous` that is one of `link.ops` reading what it says."""
    outputs = view.nodes[previous].outputs
    for index in sorted({i for v in outputs if v for i, _ in view.consumers.get(v, ())}):
        node = view.nodes[index]
        if _is_op(node, link) and _reads(node, outputs, link.reads):
            return index
    return None


def _reads(node: Node, outputs: tuple[str, ...], reads) -> bool:
    def one(out: int, slot: int) -> bool:
        values = outputs if out < 0 else outputs[out:out + 1]
        slots = node.inputs if slot < 0 else node.inputs[slot:slot + 1]
        return any(v and v in slots for v in values)
    return all(one(out, slot) for out, slot in reads)


def _barrier(view: _View, found: Match) -> str:
    members = set(found.members)
    for index in found.members:
        node = view.nodes[index]
        if any(name == "nofuse" for name, _ in node.annotations):
            return f"{_op(node)} is marked `@nofuse`"
    kept = _fused_outputs(view, found)
    for index in found.members[:-1]:
        for value in view.nodes[index].outputs:
            if value in view.hooked and _read_inside(view, value, members):
                return f"{_name(view, value)} is a `modify`/`replace` hook point, which " \
                       "stays materialized between the ops"
            why = "" if value in kept or not value else view.escapes(value, members)
            if why:
                return f"the intermediate {_name(view, value)} {why}"
    return ""


def _read_inside(view: _View, value: str, members: set[int]) -> bool:
    return any(i in members for i, _ in view.consumers.get(value, ()))


def _fused_outputs(view: _View, found: Match) -> set[str]:
    """Values the fused result still provides: a fused op's outputs; a group's last op's."""
    if found.pattern.fused:
        return {view.nodes[found.members[p]].outputs[o] for p, o in found.pattern.outputs}
    return set(view.nodes[found.members[-1]].outputs)


def _condition(view: _View, found: Match) -> str:
    check = CONDITIONS.get(found.pattern.condition)
    return check(view, [view.nodes[i] for i in found.members]) if check else ""


def _placement(view: _View, found: Match) -> str:
    """A fused op stands where the first member was when its inputs are defined there,
    else where the last member was when nothing in between reads the chain's values."""
    if not found.pattern.fused:
        return ""
    first, last = found.members[0], found.members[-1]
    inputs = [view.nodes[found.members[p]].inputs[i] for p, i in found.pattern.inputs]
    if all(_defined_before(view, v, first) for v in inputs):
        found.at = first
        return ""
    produced = {v for i in found.members[:-1] for v in view.nodes[i].outputs}
    between = [n for n in view.nodes[first + 1:last] if produced & set(n.inputs)]
    if not between:
        found.at = last
        return ""
    return f"{_op(between[0])} reads the chain's values before its last op"


def _defined_before(view: _View, value: str, index: int) -> bool:
    return not value or view.producer.get(value, -1) < index


# ------------------------------------------------------------------ conditions (shapes)
def _shape(view: _View, value: str):
    info = view.function.value(value) if value else None
    return info.shape if info is not None else None


def _same_shapes(view: _View, chain: list[Node]) -> str:
    add = chain[0]
    shapes = {_shape(view, v) for v in add.inputs + add.outputs}
    return "" if len(shapes) == 1 and None not in shapes else \
        f"{_op(add)} broadcasts; `fused_residual_{chain[-1].target}` adds equal shapes"


def _bias_add(view: _View, chain: list[Node]) -> str:
    add = next(n for n in chain if n.target == "add")
    out = _shape(view, add.outputs[0])
    if any(_shape(view, v) != out for v in add.inputs):
        return ""
    return f"{_op(add)} adds two tensors of one shape, not a bias"


def _two_halves(view: _View, chain: list[Node]) -> str:
    split = chain[0]
    return "" if len(split.outputs) == 2 else \
        f"{_op(split)} makes {len(split.outputs)} parts, not (gate, up)"


CONDITIONS = {"same_shapes": _same_shapes, "bias_add": _bias_add, "two_halves": _two_halves}


# ====================================================================== requests and choice
@dataclass(frozen=True)
class Request:
    """One `@fuse(...)` flow: the consecutive op nodes of one source line that carry it."""
    pattern: FusionPattern
    members: tuple[str, ...]  # node ids
    annotation: tuple


def _fuse_function(function: Function, backward_reads: set[str], context) -> Function:
    """Requests first (E013 when one cannot apply), then the automatic patterns; each
    match is applied at once and the view rebuilt, so later matches see the result."""
    for request in requests_of(function):
        view = _View(function, backward_reads)
        found, why = _requested(view, request)
        if found is None:
            context.diagnostics.append(_not_applied(view, request, why, context))
        else:
            function = apply_match(function, found)
    for pattern in (p for p in PATTERNS if p.automatic):
        start, view = 0, _View(function, backward_reads)
        while start < len(function.nodes):
            found, _ = match_at(view, pattern, start)
            if found is not None and _exact(view, found):
                function = apply_match(function, found)
                view = _View(function, backward_reads)  # only a change needs a new view
            start += 1
    return function


def _exact(view: _View, found: Match) -> bool:
    """Whether the fused op computes bit for bit what the chain did: its intermediates are
    stored in a dtype the fused kernel does not narrow (fusion_patterns: exact_dtypes)."""
    if not found.pattern.exact_dtypes:
        return True
    values = [v for i in found.members[:-1] for v in view.nodes[i].outputs if v]
    infos = [view.function.value(v) for v in values]
    return all(i is not None and i.dtype in found.pattern.exact_dtypes for i in infos)


def requests_of(function: Function) -> list[Request]:
    runs: list[tuple[tuple, list[int]]] = []
    for index, node in enumerate(function.nodes):
        for note in (a for a in node.annotations if a[0] == "fuse"):
            key = (note, node.span[:2])
            last = runs[-1] if runs and runs[-1][0] == key and runs[-1][1][-1] == index - 1 \
                else None
            last[1].append(index) if last else runs.append((key, [index]))
    found = []
    for (note, _), members in runs:
        pattern = _requested_pattern(note[1])
        if pattern is not None:
            ids = tuple(function.nodes[i].id for i in members)
            found.append(Request(pattern, ids, note))
    return found


def _requested_pattern(args: tuple[str, ...]) -> FusionPattern | None:
    """The pattern `@fuse(...)` names, or the chain `ops=[a, b]` lists; None for
    `@fuse(scope=global)` (automatic fusion does that already) and unknown names (E013
    from the checker)."""
    for arg in args:
        key, _, value = arg.partition("=") if "=" in arg else ("pattern", "", arg)
        key, value = key.strip(), value.strip()
        if key == "pattern":
            return BY_NAME.get(value.strip("\""))
        if key == "ops":
            ops = [o.strip() for o in value.strip("[]").split(",") if o.strip()]
            return _ops_pattern(ops) if ops else None
    return None


def _ops_pattern(ops: list[str]) -> FusionPattern:
    chain = (Link((ops[0],)),) + tuple(Link((op,), ((-1, -1),)) for op in ops[1:])
    return FusionPattern("ops", "the chain " + " -> ".join(ops), chain)


def _requested(view: _View, request: Request):
    """The first match of the request's pattern that takes part in its flow (a chain may
    start before the annotated line: `n -> matmul(w) -> y @fuse(norm_linear)`), or why
    there is none."""
    if len(request.pattern.chain) < 2:
        return None, "it names one operation; fusing takes two or more"
    members = {i for i, n in enumerate(view.nodes) if n.id in request.members}
    why = ""
    for start in range(len(view.nodes)):
        found, reason = match_at(view, request.pattern, start)
        if found is not None and members & set(found.members):
            return found, ""
        if reason and not why and _overlaps(view, request, start):
            why = reason
    return None, why or _no_chain(view, request)


def _overlaps(view: _View, request: Request, start: int) -> bool:
    """Whether the (failed) chain starting at `start` reaches a node of the request."""
    reached, todo = set(), [start]
    for _ in request.pattern.chain:
        reached.update(todo)
        todo = [i for n in todo for v in view.nodes[n].outputs if v
                for i, _ in view.consumers.get(v, ())]
    return any(view.nodes[i].id in request.members for i in reached)


def _no_chain(view: _View, request: Request) -> str:
    ops = " -> ".join(n.target for n in view.nodes if n.id in request.members)
    chain = " -> ".join("|".join(link.ops) for link in request.pattern.chain)
    return f"this flow's operations are {ops}; {_label(request)} fuses {chain}"


def _label(request: Request) -> str:
    return f"`@fuse({', '.join(request.annotation[1])})`"


def _not_applied(view: _View, request: Request, why: str, context):
    first = next(n for n in view.nodes if n.id == request.members[0])
    return error("E013", f"{_label(request)} cannot apply: {why}",
                 context.annotation_span(first.span, "fuse"), "not fused",
                 help=["remove the annotation, or change the flow so that its operations "
                       "form the pattern"])


# ====================================================================== rewriting
def apply_match(function: Function, found: Match) -> Function:
    """One match applied: the fused op replaces its chain, or the group's members are
    tagged `fusion_group` (kept in place)."""
    nodes = list(function.nodes)
    if found.pattern.fused:
        members = [nodes[i] for i in found.members]
        nodes[found.at] = fused_node(found.pattern, members)
        nodes = [n for i, n in enumerate(nodes) if i == found.at or i not in found.members]
    else:
        group = f"{found.pattern.name}@{nodes[found.members[0]].id}"
        for i in found.members:
            nodes[i] = _with_attrs(nodes[i], (("fusion_group", group),))
    return replace(function, nodes=tuple(nodes))


def fused_node(pattern: FusionPattern, members: list[Node]) -> Node:
    inputs = tuple(members[p].inputs[i] if i < len(members[p].inputs) else ""
                   for p, i in pattern.inputs)
    while inputs and not inputs[-1]:  # an absent optional input (no bias) is left off
        inputs = inputs[:-1]
    outputs = tuple(members[p].outputs[o] for p, o in pattern.outputs)
    attrs = tuple((name, members[p].attr(attr)) for name, p, attr in pattern.attrs
                  if members[p].attr(attr) is not None)
    produced = [v for m in members[:-1] for v in m.outputs if v]
    chain = (("fusion", pattern.name), ("fused_from", [m.id for m in members]),
             ("fused_spans", [f"{m.span[1]}:{m.span[2]}" for m in members]),
             ("fused_intermediates", produced))
    notes = tuple(dict.fromkeys(a for m in members for a in m.annotations))
    first = members[0]
    return Node(first.id, "op", pattern.fused, inputs, outputs, tuple(sorted(attrs + chain)),
                notes, 1, first.phase, first.span)


def _with_attrs(node: Node, extra: tuple) -> Node:
    return replace(node, attrs=tuple(sorted(node.attrs + extra)))
