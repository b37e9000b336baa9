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
layout's records do not overlap. Against the graph: the graph ops run the function's
nodes once each, in order, with their phase and repeat; each buffer holds an output of its
op's node, is as large as the value and lies inside its record (saved and host slots
within the function's stride, a `result` at a position the function returns).
"""

from __future__ import annotations

from modulec.ir.graph import COMM_STREAM, Graph, async_reads, is_async

KINDS = ("recompute", "swap_out", "swap_in", "record_event", "wait_event")
STREAMS = {"recompute": (0,), "swap_out": (1,), "swap_in": (1,), "record_event": (0, 1),
           "wait_event": (0, 1), None: (0, 2)}  # a graph op: 2 if it is async (COMM)
PHASES = ("forward", "backward", "recompute")
SHARED = ("view", "transpose", "permute", "split")


def verify_schedule(schedule, graph: Graph) -> list[str]:
    problems = _shape(schedule, graph)
    if problems:
        return problems
    counts = instance_counts(graph)
    functions = {f.name: f for f in graph.functions}
    records = _records(schedule.get("layout"))
    for name, ops in schedule["functions"].items():
        problems += _function_problems(name, ops, functions, counts)
        problems += _follows_graph(name, ops, functions[name])
        problems += _in_range(name, ops, functions[name], records)
    problems += _executed(schedule, graph)
    if isinstance(schedule.get("layout"), dict):
        problems += _layout(schedule["layout"])
    return problems


def instance_counts(graph: Graph) -> dict:
    """How often each function runs in the forward (a backward: as its forward). Counts
    flow down the call graph in topological order: linear in the calls, however deep or
    shared the calls are (a cycle, reported by the graph verifier, adds nothing)."""
    known = {f.name: f for f in graph.functions}
    calls = {name: [(n.target, n.repeat) for n in f.nodes if n.kind == "call" and
                    n.target in known and isinstance(n.repeat, int) and n.repeat > 0]
             for name, f in known.items()}
    waiting = {name: 0 for name in known}
    for edges in calls.values():
        for target, _ in edges:
            waiting[target] += 1
    counts = {name: 0 for name in known}
    if graph.entry in counts:
        counts[graph.entry] = 1
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:
        name = ready.pop()
        for target, repeat in calls[name]:
            counts[target] += counts[name] * repeat
            waiting[target] -= 1
            if waiting[target] == 0:
                ready.append(target)
    counts = {name: n for name, n in counts.items() if n}
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
    problems += [f"schedule: function `{f.name}` of the graph has no schedule"
                 for f in graph.functions if f.name not in schedule["functions"]]
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
    """Output buffers of graph ops that overlap in bytes while both are live. A storage
    (a buffer and the views and in-place outputs that name it as theirs) is live from its
    first value's definition to its last value's last reader. One sweep over node
    positions: the live storages of a region never overlap, so a storage that starts is
    compared with its two neighbours by offset only (n log n, not all pairs)."""
    index = {n.id: i for i, n in enumerate(function.nodes)}
    spans = _liveness(function)
    storage_of, placed = {}, {}
    for op in ops:
        node_index = index.get(op.get("node")) if op.get("kind") is None else None
        if node_index is None:
            continue
        node = function.nodes[node_index]
        for value, region, offset, size, *storage in op.get("buffers", ()):
            owner = storage[0] if storage else (
                node.inputs[0] if node.target in SHARED and node.inputs else value)
            storage_of[value] = storage_of.get(owner, owner)
            # a `result` lives in the caller's bytes (its offset is its position there)
            if not storage and node.target not in SHARED and size > 0 and region != "result":
                placed[value] = (region, offset, offset + size)
    live = {}  # storage -> [first definition, last reader) over all its values
    for value, (born, last) in spans.items():
        owner = storage_of.get(value, value)
        if owner in live:
            live[owner] = (min(live[owner][0], born), max(live[owner][1], last))
        else:
            live[owner] = (born, last)
    return [f"schedule @{name}: {m}" for m in _sweep(
        [(live[v], placed[v], v) for v in placed if v in live])]


def _sweep(storages: list) -> list[str]:
    """Pairs of (live span, (region, start, end), value) overlapping in time and bytes."""
    import bisect

    # a storage read last by node k is still live while node k writes: ends after starts
    events = sorted([(span[0], 0, i) for i, (span, _, _) in enumerate(storages)] +
                    [(span[1], 1, i) for i, (span, _, _) in enumerate(storages)])
    by_region: dict = {}  # region -> sorted [(start, end, index)] of live storages
    problems = []
    for _, ends, i in events:
        _, (region, start, end), value = storages[i]
        row = by_region.setdefault(region, [])
        key = (start, end, i)
        if ends:
            at = bisect.bisect_left(row, key)
            if at < len(row) and row[at] == key:
                row.pop(at)
            continue
        at = bisect.bisect_left(row, key)
        clash = [row[j] for j in (at - 1, at) if 0 <= j < len(row) and
                 row[j][0] < end and start < row[j][1]]
        if clash:
            other = storages[clash[0][2]]
            problems.append(f"`{other[2]}` and `{value}` overlap in {region} "
                            f"(+{other[1][1]}:{other[1][2] - other[1][1]} and "
                            f"+{start}:{end - start}) while both are live")
        else:
            row.insert(at, key)
    return problems


def _liveness(function) -> dict:
    """Value -> [defining node, last reader) over node positions; outputs live to the end;
    what an async op reads and writes, to its wait at least."""
    born, last = {}, {}
    end = len(function.nodes)
    waits = async_reads(function)
    for i, node in enumerate(function.nodes):
        for value in node.inputs + waits.get(node.id, ()):  # a wait: its op's values too
            last[value] = i
        for value in node.outputs:
            born.setdefault(value, i)
    for value in function.outputs:
        last[value] = end
    return {v: (b, max(last.get(v, b), b)) for v, b in born.items()
            if max(last.get(v, b), b) > b}


# ====================================================================== against the graph
def _follows_graph(name: str, ops: list, function) -> list[str]:
    """The graph ops run the function's nodes, each once, in the graph's order, with the
    node's phase and repeat count (a call op its callee); each buffer holds an output of
    the op's node."""
    nodes = {n.id: n for n in function.nodes}
    graph_ops = [(i, op) for i, op in enumerate(ops) if op.get("kind") is None]
    order = [op["node"] for _, op in graph_ops]
    if order != [n.id for n in function.nodes]:
        return [f"schedule @{name}: the graph ops run nodes {_listed(order)}, the graph has "
                f"{_listed([n.id for n in function.nodes])} (each node once, in order)"]
    problems = []
    for index, op in graph_ops:
        node, where = nodes[op["node"]], f"schedule @{name}, op {index} (node {op['node']})"
        if op["phase"] != node.phase:
            problems.append(f"{where}: phase `{op['phase']}`, the node's is `{node.phase}`")
        if op.get("repeat", 1) != node.repeat:
            problems.append(f"{where}: repeat {op.get('repeat')!r}, the node's is "
                            f"{node.repeat!r}")
        stream = COMM_STREAM if is_async(node) else 0
        if op["stream"] != stream:
            problems.append(f"{where}: stream {op['stream']}, the node runs on {stream}")
        if node.kind == "call" and op["kernel"] != f"call:{node.target}":
            problems.append(f"{where}: kernel `{op['kernel']}`, expected `call:{node.target}`")
        problems += [f"{where}: a buffer for `{b[0]}`, which is not an output of the node"
                     for b in op.get("buffers", ()) if b[0] not in node.outputs]
    return problems


def _listed(ids: list) -> str:
    shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
    return f"[{shown}]"


def _records(layout) -> dict:
    """Function -> (saved stride, host stride) of its layout record."""
    if not isinstance(layout, dict) or not isinstance(layout.get("functions"), list):
        return {}
    found = {}
    for record in layout["functions"]:
        try:
            found[record["function"]] = (record["saved"]["stride"], record["host"]["stride"])
        except (KeyError, TypeError):
            continue  # reported by _layout
    return found


def _in_range(name: str, ops: list, function, records: dict) -> list[str]:
    """A buffer holds its value's bytes, inside its region: a saved or host slot inside
    its function's record (the stride), a `result` at a position the callee returns."""
    problems = []
    infos = {v.id: v for v in function.values + function.inputs}
    for index, op in enumerate(ops):
        owner = op.get("function", name) if op.get("kind") is not None else name
        rows = op.get("rows") if isinstance(op.get("rows"), dict) else {}
        for value, region, offset, size, *_ in op.get("buffers", ()):
            where = f"schedule @{name}, op {index}: the buffer of `{value}`"
            needed = _value_bytes(infos.get(value)) if owner == name else None
            if needed is not None and value in rows:
                needed, problem = _laid_wide(needed, rows[value])
                problems += [f"{where}: {problem}"] if problem else []
            if region not in BUFFER_REGIONS:
                problems.append(f"{where} is in region `{region}`; regions: "
                                f"{', '.join(BUFFER_REGIONS)}")
            if needed is not None and size != needed and region != HOST:
                problems.append(f"{where} holds {size} bytes, the value needs {needed}")
            if offset + size > MAX_BUFFER_END:
                problems.append(f"{where} (+{offset}:{size}) ends past {MAX_BUFFER_END} bytes, "
                                "the most a plan of 2^40-element tensors places")
            limit = _region_limit(region, records.get(owner))
            if region == "result" and offset >= len(function.outputs):
                problems.append(f"{where} is result {offset}, but `{name}` returns "
                                f"{len(function.outputs)}")
            elif limit is not None and offset + size > limit:
                problems.append(f"{where} (+{offset}:{size}) ends past the {limit}-byte "
                                f"record of `{owner}` in {region}")
    return problems


SAVED, HOST, TRANSIENT = "saved_activations", "host_activations", "transient_activations"
BUFFER_REGIONS = (TRANSIENT, SAVED, HOST, "result")
MAX_BUFFER_END = 2**46  # 8 TiB tensors (2^40 elements of 8 bytes), a few of them


def _region_limit(region: str, record) -> int | None:
    if record is None:
        return None
    return {SAVED: record[0], HOST: record[1]}.get(region)


def _laid_wide(needed: int, rows) -> tuple[int | None, str]:
    """The bytes of a value laid as rows of `elements` `stride` apart (an op's `rows`:
    modulec.plan.pads), and what is wrong with the entry ("" when nothing)."""
    if not (isinstance(rows, list) and len(rows) == 2 and all(isinstance(n, int) for n in rows)
            and 0 < rows[0] <= rows[1]):
        return None, f"`rows` {rows!r} is not [elements, stride] with 0 < elements <= stride"
    return needed * rows[1] // rows[0], ""


def _value_bytes(info) -> int | None:
    """The bytes of a value of known shape and storage dtype (None: not known here)."""
    from modulec.types.dim_text import parse_dim
    from modulec.types.tensor import BITS

    if info is None or info.dtype not in BITS:
        return None
    count = 1
    for text in info.shape:
        try:
            dim = parse_dim(text)
        except (ValueError, TypeError):
            return None
        if not dim.is_const:
            return None
        count *= dim.value
    return -(-count * BITS[info.dtype] // 8)


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
            problems += _record_problems(record)
            base, stride = record["saved"]["base"], record["saved"]["stride"]
            spans.append((base, base + stride * record["instances"], record["function"]))
        except (KeyError, TypeError):
            problems.append("schedule layout: a record needs function, instances, "
                            "saved and host {base, stride} (non-negative integers) and "
                            "values [{value, offset, bytes}]")
    spans.sort()
    problems += [f"schedule layout: the records of `{a[2]}` and `{b[2]}` overlap"
                 for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return problems


def _record_problems(record: dict) -> list[str]:
    """One function's record: its saved and host slots (`base + stride * instances`
    bytes, allocated by the runtime's arena) and its values inside the stride."""
    problems, where = [], f"schedule layout @{record['function']}"
    for region in ("saved", "host"):
        base, stride = record[region]["base"], record[region]["stride"]
        if not all(_is_int(x) and x >= 0 for x in (base, stride, record["instances"])):
            raise TypeError
        if base + stride * record["instances"] > MAX_BUFFER_END:
            problems.append(f"{where}: the {region} record ends at "
                            f"{base + stride * record['instances']} bytes, past "
                            f"{MAX_BUFFER_END}")
    stride = record["saved"]["stride"]
    for v in record["values"]:
        if not (_is_int(v["offset"]) and _is_int(v["bytes"]) and v["offset"] >= 0 and
                v["bytes"] >= 0):
            raise TypeError
        if v["offset"] + v["bytes"] > stride:
            problems.append(f"{where}: `{v['value']}` ends past the record's stride {stride}")
    return problems
