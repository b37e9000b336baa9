"""Backward work nobody reads, left out of a run (the interpreters' `prune_dead`).

A derived backward computes the gradient of every input of a function; the call that
runs it may not want some of them. The first layer's input gradient is the gradient of
the embedding's output, which only the embedding's backward reads, and a frozen
embedding (LoRA) has no gradient to make: its `embedding_backward` has no output, so the
layer's d_x, the input norm's backward and the q/k/v projections' d_x GEMMs (133 us of
the LoRA 8B step on one H100, with its norm 37 us) were made and dropped.

`pruned(function, dead)` is `function` with the work that only feeds its outputs `dead`
(indices) left out: each op whose outputs are all unread is dropped, an op some of whose
outputs are unread has those outputs blanked (`""`: its kernel may skip them, as a
matmul backward skips an unwanted gradient), and each call whose outputs are unread is
kept (its parameters' gradients are wanted) with the indices of its unread outputs, so
that its callee is pruned in turn where it runs for the last time (the last repetition
of a stack hands the call's outputs over; earlier ones feed the next). Parameter
gradients are always read. The IR is not changed: a run leaves out what the IR says
nobody reads.

`prunable(graph)` says where a run may prune: no collective, no `wait` and no op on
another stream (whose pairing with other ranks or events must not move).
"""

from __future__ import annotations

from dataclasses import replace

from modulec.ir.graph import STREAM, WAIT, Function, Graph

# the IR's ops that meet other ranks (and their backwards): where a graph has one, nothing
# is left out (every rank must issue the same collectives)
COLLECTIVE_PREFIXES = ("tp_", "sp_", "vocab_parallel_")


def prunable(graph: Graph) -> bool:
    """No collective, `wait` or other-stream op anywhere in `graph`."""
    for function in graph.functions:
        for node in function.nodes:
            if node.kind == WAIT or node.attr(STREAM) is not None:
                return False
            if node.kind == "op" and node.target.startswith(COLLECTIVE_PREFIXES):
                return False
    return True


def pruned(function: Function, dead: frozenset) -> tuple[Function, dict]:
    """(`function` without the work that only makes its outputs `dead`, {call node id:
    the indices of that call's unread outputs}); `function` itself where nothing goes."""
    outputs = tuple("" if k in dead else o for k, o in enumerate(function.outputs))
    read = {o for o in outputs if o} | {v for _, v in function.param_grads}
    kept, dead_calls = [], {}
    for node in reversed(function.nodes):
        wanted = tuple(o if o and o in read else "" for o in node.outputs)
        if node.kind == "call":
            unread = frozenset(k for k, o in enumerate(node.outputs) if o and not wanted[k])
            if unread:
                dead_calls[node.id] = unread
        elif node.kind == "op" and node.outputs and not any(wanted):
            continue  # nothing it makes is read: left out
        elif node.kind == "op" and wanted != node.outputs:
            node = replace(node, outputs=wanted)
        kept.append(node)
        read.update(v for v in node.inputs if v)
    nodes = tuple(reversed(kept))
    if nodes == function.nodes and outputs == function.outputs and not dead_calls:
        return function, {}
    return replace(function, nodes=nodes, outputs=outputs), dead_calls
