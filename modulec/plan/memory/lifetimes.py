"""Lifetimes and storage sharing: which buffers own storage, and for how long.

One pass over the schedule (planner notes, "unified alias + in-place memory sharing"):
1. a view or split shares its source's storage unconditionally (the alias root, followed
   through chains, with the byte offset accumulated);
2. an elementwise op marked `inplace_ok` may write an output into the storage of an input
   that dies at this op, when both are whole buffers of the same size in the same region;
   chains (exp -> relu -> ...) share one storage, since the test follows storage roots;
3. anything else gets storage of its own.

"Dies at this op" is decided on alias roots (their uses include their views' uses), which
do not depend on earlier in-place decisions, so the pass needs no fixpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.plan.memory.model import Buffer, BufferId, Op, PlanError, round_up, validate

Span = tuple[int, int]


@dataclass(frozen=True)
class Block:
    """One piece of storage: an alias root plus the outputs written in place into it."""
    id: BufferId          # the buffer that owns the storage
    key: int              # its position in the buffer list: the stable tie-break
    region: str
    size: int             # bytes, rounded up to `alignment`
    alignment: int
    start: int            # first op index it is live at (inclusive)
    end: int              # last op index it is live at (inclusive)
    pinned: bool = False


@dataclass(frozen=True)
class Storage:
    blocks: tuple[Block, ...]                            # in buffer order
    placement: dict[BufferId, tuple[BufferId, int]]      # buffer -> (block id, byte offset)
    spans: dict[BufferId, Span]                          # each buffer's own lifetime
    inplace: dict[BufferId, BufferId]                    # output -> input whose storage it took


def storage(ops: list[Op], buffers: list[Buffer]) -> Storage:
    by_id = validate(ops, buffers)
    spans = buffer_spans(ops, buffers)
    roots = {b.id: alias_root(b.id, by_id) for b in buffers}
    root_span: dict[BufferId, Span] = {}
    for b in buffers:
        root = roots[b.id][0]
        root_span[root] = _union(root_span.get(root, spans[b.id]), spans[b.id])
    owner = {root: root for root in root_span}
    block_span = dict(root_span)
    inplace = _share_inplace(ops, by_id, roots, root_span, owner, block_span)
    blocks = _blocks(buffers, by_id, owner, block_span)
    placement = {b.id: (owner[roots[b.id][0]], roots[b.id][1]) for b in buffers}
    return Storage(blocks, placement, spans, inplace)


def buffer_spans(ops: list[Op], buffers: list[Buffer]) -> dict[BufferId, Span]:
    """Each buffer's own [first_use, last_use], before aliases extend their sources."""
    t0 = ops[0].index if ops else 0
    produced: dict[BufferId, int] = {}
    first_read: dict[BufferId, int] = {}
    last_read: dict[BufferId, int] = {}
    for op in ops:
        for bid in op.inputs:
            first_read.setdefault(bid, op.index)
            last_read[bid] = op.index
        for bid in op.outputs:
            produced[bid] = op.index
    spans = {}
    for b in buffers:
        start = produced.get(b.id, t0)
        if b.pinned_lifetime is None and first_read.get(b.id, start) < start:
            raise PlanError(f"buffer {b.id!r} is read at op #{first_read[b.id]} "
                            f"before it is produced at op #{start}")
        span = (start, max(start, last_read.get(b.id, start)))
        spans[b.id] = span if b.pinned_lifetime is None else _union(span, b.pinned_lifetime)
    return spans


def alias_root(bid: BufferId, by_id: dict[BufferId, Buffer]) -> tuple[BufferId, int]:
    """The buffer owning `bid`'s storage through views, and `bid`'s byte offset in it."""
    offset = 0
    b = by_id[bid]
    while b.alias_of is not None:
        offset += b.offset_in_source
        b = by_id[b.alias_of]
    return b.id, offset


def _union(a: Span, b: Span) -> Span:
    return (min(a[0], b[0]), max(a[1], b[1]))


def _share_inplace(ops, by_id, roots, root_span, owner, block_span) -> dict[BufferId, BufferId]:
    inplace: dict[BufferId, BufferId] = {}
    for op in ops:
        if op.kind != "elementwise" or not op.inplace_ok:
            continue
        taken: set[BufferId] = set()
        for out in op.outputs:
            ob = by_id[out]
            if ob.alias_of is not None or ob.pinned_lifetime is not None:
                continue
            for inp in op.inputs:
                root = roots[inp][0]
                if root in taken or not _can_take(op, by_id, roots, root_span, inp, ob):
                    continue
                shared = owner[root]
                owner[out] = shared
                block_span[shared] = _union(block_span[shared], root_span[out])
                taken.add(root)
                inplace[out] = inp
                break
    return inplace


def _can_take(op: Op, by_id, roots, root_span, inp: BufferId, out: Buffer) -> bool:
    root, offset = roots[inp]
    rb = by_id[root]
    return (root != out.id and rb.pinned_lifetime is None and offset == 0
            and root_span[root][1] == op.index and rb.region == out.region
            and by_id[inp].size_bytes == rb.size_bytes == out.size_bytes)


def _blocks(buffers, by_id, owner, block_span) -> tuple[Block, ...]:
    alignment: dict[BufferId, int] = {}
    for b in buffers:
        if b.alias_of is None:
            o = owner[b.id]
            alignment[o] = max(alignment.get(o, 1), b.alignment)
    blocks = []
    for key, b in enumerate(buffers):
        if b.alias_of is None and owner[b.id] == b.id:
            start, end = block_span[b.id]
            align = alignment[b.id]
            blocks.append(Block(b.id, key, b.region, round_up(b.size_bytes, align), align,
                                start, end, b.pinned_lifetime is not None))
    return tuple(blocks)
