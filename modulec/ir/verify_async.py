"""The verifier's checks of asynchronous collectives (modulec.ir.graph STREAM, WAIT;
made by modulec.lower.tp_overlap): an op on the communication stream is a collective,
it has exactly one wait after it in its function, nothing reads its outputs before that
wait, and a wait names an op issued before it and waits for exactly its outputs."""

from __future__ import annotations

from modulec.ir.graph import COMM, STREAM, WAIT, Function, is_async
from modulec.ops.registry import collective_ops, is_collective


def async_problems(function: Function) -> list[tuple[int, str]]:
    """(node index, message) for each broken issue / wait pair of `function`."""
    found: list[tuple[int, str]] = []
    issued: dict[str, int] = {}  # async op id -> its index
    waited: dict[str, int] = {}  # async op id -> its wait's index
    for index, node in enumerate(function.nodes):
        if node.attr(STREAM) is not None:
            found += [(index, m) for m in _issue_problems(node)]
            issued[node.id] = index
        elif node.kind == WAIT:
            found += [(index, m) for m in _wait_problems(node, function, issued, waited)]
            waited.setdefault(node.target, index)
    for op_id, index in issued.items():
        if op_id not in waited:
            found.append((index, f"`{function.nodes[index].target}` runs on the "
                                 f"communication stream but no `wait {op_id}` joins it: "
                                 "its outputs would be read while it runs"))
    return found + _early_readers(function, issued, waited)


def _issue_problems(node) -> list[str]:
    """Only an op whose kernel is a collective alone runs on the communication stream: the
    op table says which (a primitive's `collective:` phases; runtime/kernels/comm.py)."""
    if node.attr(STREAM) != COMM:
        return [f"`{STREAM}={node.attr(STREAM)}`: the only other stream is `{COMM}`"]
    if not is_async(node) or not is_collective(node.target):
        return [f"`{node.target}` on the communication stream: only a collective "
                f"({', '.join(sorted(collective_ops()))}) runs there"]
    return []


def _wait_problems(node, function: Function, issued: dict, waited: dict) -> list[str]:
    if node.target not in issued:
        return [f"`wait {node.target}` waits for no op issued before it on the "
                "communication stream"]
    if node.target in waited:
        return [f"a second `wait {node.target}` (the first is node "
                f"{function.nodes[waited[node.target]].id})"]
    op = function.nodes[issued[node.target]]
    problems = [] if tuple(node.inputs) == tuple(o for o in op.outputs if o) else [
        f"`wait {node.target}` must list the outputs of {node.target} "
        f"({', '.join(o for o in op.outputs if o)}), not ({', '.join(node.inputs)})"]
    if node.outputs:
        problems.append(f"`wait {node.target}` defines no values, not "
                        f"{', '.join(node.outputs)}")
    return problems


def _early_readers(function: Function, issued: dict, waited: dict) -> list[tuple[int, str]]:
    """Readers of an async op's outputs between the op and its wait."""
    found = []
    for op_id, start in issued.items():
        end = waited.get(op_id)
        if end is None:
            continue
        outputs = {o for o in function.nodes[start].outputs if o}
        for index in range(start + 1, end):
            read = outputs & set(function.nodes[index].inputs)
            if read:
                found.append((index, f"reads `{sorted(read)[0]}` before `wait {op_id}`: "
                                     "the collective making it may still be running"))
    return found
