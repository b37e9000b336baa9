"""The Schedule IR verifier (`modulec ir verify`): what a runtime executing the schedule
relies on, checked against the document's graph.

Shape first (a hand-edited document gets messages, never a traceback): every op an object
with a kernel, phase, stream and, where given, well-formed buffers and instance ranges.
Then meaning: graph ops name nodes of their function; compute ops run on stream 0, swaps
on stream 1; walking the schedule in execution order (calls entered once per repetition,
predicated ops for their instances), every `wait_event` finds its event recorded before
for the same owner instance, and every `swap_in` a `swap_out` of the same value;
recompute ops sit in a backward function, replay a forward node of a real function and
precede a graph op (their consumer); two buffers of a function's ops do not overlap while
both are live (liveness read off the graph: from the defining node up to the last
reader; views and in-place updates share bytes by design and are not compared); the
layout's records do not overlap.
"""

from __future__ import annotations

from modulec.ir.graph import Graph

KINDS = ("recompute", "swap_out", "swap_in", "record_event", "wait_event")
STREAMS = {"recompute": (0,), "swap_out": (1,), "swap_in": (1,), "record_event": (0, 1),
           "wait_event": (0, 1), None: (0,)}
PHASES = ("forward", "backward", "recompute")
SHARED = ("view", "transpose", "permute", "split")


def verify_schedule(schedule, graph: Graph) -> list[str]:
    problems = _shape(schedule, graph)
    if problems:
        return problems
    counts = instance_counts(graph)
    functions = {f.name: f for f in graph.functions}
    for name, ops in schedule["functions"].items():
        problems += _function_problems(name, ops, functions, counts)
    problems += _executed(schedule, graph)
    if isinstance(schedule.get("layout"), dict):
        problems += _layout(schedule["layout"])
    return problems


def instance_counts(graph: Graph) -> dict:
    """How often each function runs in the forward (a backward: as its forward)."""
    counts: dict = {}
    known = {f.name: f for f in graph.functions}

    def visit(name: str, times: int, depth: int) -> None:
        if name not in known or depth > 64:
            return
        counts[name] = counts.get(name, 0) + times
        for node in known[name].nodes:
            if node.kind == "call" and isinstance(node.repeat, int):
                visit(node.target, times * node.repeat, depth + 1)

    visit(graph.entry, 1, 0)
    for function in graph.functions:
        if function.gradient_of:
            counts[function.name] = counts.get(function.gradient_of, 0)
    return counts


# ====================================================================== shape
def _shape(schedule, graph: Graph) -> list[str]:
    if not isinstance(schedule, dict) or not isinstance(schedule.get("functions"), dict):
        return ["schedule: expected an object with `functions` (function name -> ops)"]
    if not isinstance(schedule.get("order"), list):
        return ["schedule: `order` must be a list of function names"]
    names = {f.name for f in graph.functions}
    problems = [f"schedule: `order` names `{n}`, not a function of the graph"
                for n in schedule["order"] if n not in names]
    for name, ops in schedule["functions"].items():
        if name not in names:
            problems.append(f"schedule: `{name}` is not a function of the graph")
        elif not isinstance(ops, list):
            problems.append(f"schedule @{name}: expected a list of ops")
        else:
            problems += [f"schedule @{name}, op {i}: {m}" for i, op in enumerate(ops)
                         for m in _op_shape(op)]
    return problems


def _op_shape(op) -> list[str]:
    if not isinstance(op, dict):
        return ["expected an object"]
    problems = []
    if not isinstance(op.get("kernel"), str):
        problems.append("`kernel` must be a string")
    if op.get("phase") not in PHASES:
        problems.append(f"`phase` must be one of {', '.join(PHASES)}")
    if not _is_int(op.get("stream")):
        problems.append("`stream` must be an integer")
    if op.get("kind") is not None and op.get("kind") not in KINDS:
        problems.append(f"unknown kind `{op.get('kind')}` (kinds: {', '.join(KINDS)})")
    if op.get("kind") is None and not isinstance(op.get("node"), str):
        problems.append("a graph op needs its `node`")
    if op.get("kind") is not None:
        problems += _inserted_shape(op)
    buffers = op.get("buffers", [])
    if not isinstance(buffers, list) or not all(_is_buffer(b) for b in buffers):
        problems.append("`buffers` must be a list of [value, region, offset, bytes] (and "
                        "the value whose storage it shares) with offset, bytes non-negative "
                        "integers")
    return problems


def _inserted_shape(op: dict) -> list[str]:
    problems = []
    if not isinstance(op.get("function"), str):
        problems.append(f"a {op['kind']} op needs the `function` it acts on")
    if not _is_int(op.get("instance", 0)):
        problems.append("`instance` must be an integer (relative instance)")
    runs = op.get("instances")
    if runs is not None and not (isinstance(runs, list) and all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r)
            and 0 <= r[0] <= r[1] for r in runs)):
        problems.append("`instances` must be a list of [first, last] instance indices")
    if op["kind"] == "recompute" and not isinstance(op.get("node"), str):
        problems.append("a recompute op needs the `node` it replays")
    if op["kind"] != "recompute" and not isinstance(op.get("value"), str):
        problems.append(f"a {op['kind']} op needs the `value` it acts on")
    if op["kind"] in ("record_event", "wait_event") and not isinstance(op.get("event"), str):
        problems.append(f"a {op['kind']} op needs its `event`")
    return problems


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_buffer(item) -> bool:
    """[value, region, offset, bytes] and, for a value in another's storage, that value."""
    return isinstance(item, list) and len(item) in (4, 5) and isinstance(item[0], str) and \
        isinstance(item[1], str) and all(_is_int(x) and x >= 0 for x in item[2:4]) and \
        (len(item) == 4 or isinstance(item[4], str))


# ====================================================================== one function
def _function_problems(name: str, ops: list, functions: dict, counts: dict) -> list[str]:
    function = functions[name]
    nodes = {n.id for n in function.nodes}
    problems = []
    for index, op in enumerate(ops):
        where = f"schedule @{name}, op {index}"
        kind = op.get("kind")
        if op["stream"] not in STREAMS[kind]:
            problems.append(f"{where}: {kind or 'a compute op'} runs on stream "
                            f"{op['stream']}, expected {' or '.join(map(str, STREAMS[kind]))}")
        if kind is None and op["node"] not in nodes:
            problems.append(f"{where}: node {op['node']} is not a node of `{name}`")
        if kind is not None:
            problems += [f"{where}: {m}" for m in _inserted(op, ops, index, function,
                                                             functions, counts)]
    return problems + _overlaps(name, ops, function)


def _inserted(op, ops, index, function, functions, counts) -> list[str]:
    problems = []
    target = functions.get(op["function"])
    if target is None:
        return [f"`{op['function']}` is not a function of the graph"]
    last = counts.get(function.name, 1) - 1
    if any(r[1] > last for r in op.get("instances") or ()):
        problems.append(f"`instances` go past instance {last} of `{function.name}`")
    if op["kind"] == "recompute":
        problems += _recompute(op, ops, index, function, target)
    return problems


def _recompute(op, ops, index, function, target) -> list[str]:
    problems = []
    if not function.gradient_of:
        problems.append(f"a recompute op in the forward function `{function.name}`: "
                        "replays belong to the backward")
    if op["phase"] != "recompute":
        problems.append("a recompute op must have phase `recompute`")
    node = next((n for n in target.nodes if n.id == op["node"]), None)
    if node is None or target.gradient_of:
        problems.append(f"replays {op['node']}, not a forward node of `{target.name}`")
    if not any(o.get("kind") is None for o in ops[index + 1:]):
        problems.append("a recompute op with no op after it to consume what it rebuilds")
    return problems


def _overlaps(name: str, ops: list, function) -> list[str]:
    """Output buffers of graph ops that overlap in bytes while both values are live."""
    index = {n.id: i for i, n in enumerate(function.nodes)}
    spans = _liveness(function)
    placed = []
    for op in ops:
        node_index = index.get(op.get("node")) if op.get("kind") is None else None
        if node_index is None or function.nodes[node_index].target in SHARED:
            continue
        for value, region, offset, size, *storage in op.get("buffers", ()):
            # a `result` lives in the caller's bytes (its offset is its position there)
            if value in spans and size > 0 and region != "result":
                placed.append((region, offset, offset + size, spans[value], value,
                               storage[0] if storage else value))
    problems = []
    placed.sort()
    for i, (region, start, end, live, value, storage) in enumerate(placed):
        for other in placed[i + 1:]:
            if other[0] != region or other[1] >= end:
                break
            if live[0] < other[3][1] and other[3][0] < live[1] and storage != other[5]:
                problems.append(f"schedule @{name}: `{value}` and `{other[4]}` overlap in "
                                f"{region} (+{start}:{end - start} and +{other[1]}:"
                                f"{other[2] - other[1]}) while both are live")
    return problems


def _liveness(function) -> dict:
    """Value -> [defining node, last reader) over node positions; outputs live to the end."""
    born, last = {}, {}
    end = len(function.nodes)
    for i, node in enumerate(function.nodes):
        for value in node.inputs:
            last[value] = i
        for value in node.outputs:
            born.setdefault(value, i)
    for value in function.outputs:
        last[value] = end
    return {v: (b, max(last.get(v, b), b)) for v, b in born.items()
            if max(last.get(v, b), b) > b}


# ====================================================================== across functions
MAX_STEPS = 2_000_000  # op executions walked before giving up (a hostile repeat count)


class _TooLarge(Exception):
    pass


def _walk(schedule, graph: Graph):
    """(function, op index, op, running instance) in execution order: the entry's
    schedule, calls entering their callee once per repetition, the backward's calls
    entering the callee's backward for the instance it differentiates (repetitions in
    reverse), inserted ops only for the instances they list."""
    functions = {f.name: f for f in graph.functions}
    ops = schedule["functions"]
    index: dict = {}   # forward instance path -> instance index
    seen: dict = {}
    steps = [0]

    def run(name: str, path: tuple, backward: bool):
        function = functions.get(name)
        if function is None or name not in ops:
            return
        if not backward:
            index[path] = seen.get(name, 0)
            seen[name] = index[path] + 1
        running = index.get(path, 0)
        nodes = {n.id: n for n in function.nodes}
        for position, op in enumerate(ops[name]):
            steps[0] += 1
            if steps[0] > MAX_STEPS or len(path) > 64:
                raise _TooLarge
            if not _runs(op, running):
                continue
            yield name, position, op, running
            node = nodes.get(op.get("node")) if op.get("kind") is None else None
            if node is not None and node.kind == "call" and isinstance(node.repeat, int):
                yield from _enter(node, path, backward, run)

    yield from run(graph.entry, (), False)
    if graph.backward:
        yield from run(graph.backward, (), True)


def _enter(node, path: tuple, backward: bool, run):
    count = node.repeat
    for repetition in range(count):
        if backward:
            step = (node.attr("forward_node", node.id), count - 1 - repetition)
        else:
            step = (node.id, repetition)
        yield from run(node.target, path + (step,), backward)


def _runs(op: dict, running: int) -> bool:
    runs = op.get("instances")
    return runs is None or any(a <= running <= b for a, b in runs)


def _executed(schedule, graph: Graph) -> list[str]:
    """Events recorded before they are waited for, swaps out before they come back in,
    per owner instance, in execution order."""
    recorded, swapped, problems = set(), set(), []
    try:
        for name, position, op, running in _walk(schedule, graph):
            kind = op.get("kind")
            if kind is None or kind == "recompute":
                continue
            owner = running + op.get("instance", 0)
            where = f"schedule @{name}, op {position} (instance {running})"
            if kind == "record_event":
                recorded.add((op["event"], owner))
            elif kind == "wait_event" and (op["event"], owner) not in recorded:
                problems.append(f"{where}: waits for event `{op['event']}` of instance "
                                f"{owner}, not recorded before")
            elif kind == "swap_out":
                swapped.add((op["function"], op["value"], owner))
            elif kind == "swap_in" and (op["function"], op["value"], owner) not in swapped:
                problems.append(f"{where}: swap_in of {op['function']}/{op['value']} "
                                f"(instance {owner}) without a swap_out of it before")
    except _TooLarge:
        problems.append("schedule: too many op executions to verify events and swaps "
                        f"(over {MAX_STEPS})")
    return _first_of_each(problems)


def _first_of_each(problems: list[str]) -> list[str]:
    """One message per op (not one per instance it fails for)."""
    seen, kept = set(), []
    for message in problems:
        key = message.split(" (instance")[0]
        if key not in seen:
            seen.add(key)
            kept.append(message)
    return kept


def _layout(layout: dict) -> list[str]:
    records = layout.get("functions")
    if not isinstance(records, list):
        return ["schedule layout: `functions` must be a list"]
    problems, spans = [], []
    for record in records:
        try:
            base, stride = record["saved"]["base"], record["saved"]["stride"]
            if not all(_is_int(x) for x in (base, stride, record["instances"])):
                raise TypeError
            spans.append((base, base + stride * record["instances"], record["function"]))
            problems += [f"schedule layout @{record['function']}: `{v['value']}` ends past "
                         f"the record's stride {stride}" for v in record["values"]
                         if v["offset"] + v["bytes"] > stride]
        except (KeyError, TypeError):
            problems.append("schedule layout: a record needs function, instances, "
                            "saved {base, stride} and values [{value, offset, bytes}]")
    spans.sort()
    problems += [f"schedule layout: the records of `{a[2]}` and `{b[2]}` overlap"
                 for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return problems
