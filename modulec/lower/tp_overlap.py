"""Tensor-parallel backward overlap (`--tp M`, on unless `--no-tp-overlap`): Megatron's
overlap of the input gradient's collective with the weight gradient's GEMM.

In the derived backward a column-parallel matmul's input gradient is summed over the
ranks right after the matmul's backward makes it:

    b12: d_x_partial, d_W = matmul_backward(d_y, x, W)
    b13: d_x = tp_copy_backward(d_x_partial)          # all-reduce (--sp: sp_all_gather's
                                                      # backward, a reduce-scatter)

and the all-reduce waits for the weight gradient, which nothing after it needs. This pass
splits the node in two (the same op, each with the other gradient unwanted, as a frozen
weight's d_W is), issues the collective on the communication stream between them, and
joins it where d_x is first read (or at the function's end, where d_x is its output):

    b12: d_x_partial, _ = matmul_backward(d_y, x, W)
    b13: d_x = tp_copy_backward(d_x_partial, stream=comm)
    b12.weight: _, d_W = matmul_backward(d_y, x, W)
    b13.wait: wait b13(d_x)

A matmul backward is rewritten where its d_x has that collective as its only reader and
is no output of the function. The IR says what runs where (modulec.ir.graph STREAM, WAIT);
the planner keeps the collective's input and output bytes until the wait
(modulec.plan.from_graph), the verifier checks that every async op has one wait before
any reader of its outputs (modulec.ir.verify), and the runtimes run the wait as the
compute stream's join (runtime/cuda/step_interpreter.py; the CPU reference runs in
order, so its results are the same by construction).
"""

from __future__ import annotations

from dataclasses import replace

from modulec.ir.graph import COMM, STREAM, WAIT, Function, Graph, Node

# the backward collectives a column-parallel matmul's input gradient goes through: tp_copy's
# all-reduce (sp_all_gather's reduce-scatter under --sp). Narrower on purpose than the op
# table's collectives (modulec.ops.registry collective_ops, all of which the verifier lets
# run on the communication stream): the pass rewrites backwards only, and the other
# backward collectives (sp_reduce_scatter's and sp_scatter's all-gathers) read no matmul
# backward's input gradient: they make a gradient the next backward op reads first, so no
# GEMM is left to run beside them. tests/test_tp_overlap.py checks this is part of the table's.
COLLECTIVES = ("tp_copy_backward", "sp_all_gather_backward")


def apply_tp_overlap(graph: Graph, context) -> Graph:
    plan = getattr(context, "tensor_parallel", None)
    if plan is None or plan.size == 1 or not getattr(plan, "overlap", True):
        return graph
    functions = tuple(overlapped(f) if f.gradient_of else f for f in graph.functions)
    return replace(graph, functions=functions)


def overlapped(function: Function) -> Function:
    """`function` with each matching matmul backward split around its collective."""
    nodes = list(function.nodes)
    index = 0
    while index < len(nodes):
        pair = _pair(function, nodes, index)
        if pair is not None:
            nodes = _split(nodes, index, *pair)
        index += 1
    return function if len(nodes) == len(function.nodes) else replace(function,
                                                                      nodes=tuple(nodes))


def _pair(function: Function, nodes: list, index: int) -> tuple[int, Node] | None:
    """(index, node) of the collective that alone reads the input gradient of matmul
    backward nodes[index], or None where the node does not qualify."""
    node = nodes[index]
    if node.kind != "op" or node.target != "matmul_backward" or len(node.outputs) != 2 \
            or not all(node.outputs):
        return None
    d_x = node.outputs[0]
    if d_x in function.outputs or any(g == d_x for _, g in function.param_grads):
        return None
    readers = [(i, n) for i, n in enumerate(nodes) if d_x in n.inputs]
    if len(readers) != 1:
        return None
    at, reader = readers[0]
    if reader.kind != "op" or reader.target not in COLLECTIVES or reader.attr(STREAM) \
            or list(reader.inputs).count(d_x) != 1 or at < index:
        return None
    return at, reader


def _split(nodes: list, index: int, at: int, collective: Node) -> list:
    node = nodes[index]
    d_x, d_w = node.outputs
    inputs = replace(node, outputs=(d_x, ""),
                     accumulate=tuple(a for a in node.accumulate if a == d_x))
    weight = replace(node, id=f"{node.id}.weight", outputs=("", d_w),
                     accumulate=tuple(a for a in node.accumulate if a == d_w))
    issued = replace(collective, attrs=collective.attrs + ((STREAM, COMM),))
    ready = tuple(o for o in collective.outputs if o)
    wait = Node(f"{collective.id}.wait", WAIT, collective.id, ready, (),
                phase=collective.phase, span=collective.span)
    rest = nodes[index + 1:at] + nodes[at + 1:]
    first = next((i for i, n in enumerate(rest) if set(ready) & set(n.inputs)), len(rest))
    return nodes[:index] + [inputs, issued, weight] + rest[:first] + [wait] + rest[first:]
