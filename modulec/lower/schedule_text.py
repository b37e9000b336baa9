"""The canonical text form of a Schedule IR (`modulec build --emit schedule`).

One line per op: its node (`-` for swap and sync ops), phase, stream (`s0` compute, `s1`
copy, `s2` communication: an async collective, joined by its `wait:<node>` op), kernel
and repeat count, what it acts on (`CausalSelfAttention#1/%6[i]`: that
function's node or value in the instance relative to the running one `i`), its event,
the instances it runs for (`when i in 0-17,19`) and its buffers. Then the activation
layout, one line per record and per saved value; then the distributed and pipeline
sections (modulec.lower.schedule_text_parallel).
"""

from __future__ import annotations


def print_schedule(data: dict) -> str:
    """Functions in execution order first, then the rest by name, then the layout."""
    functions = data["functions"]
    names = list(data["order"]) + sorted(set(functions) - set(data["order"]))
    text = "".join(_print_function(name, functions[name]) for name in names)
    return text + (_print_layout(data["layout"]) if data.get("layout") else "") + \
        _print_parallel(data)


def _print_parallel(data: dict) -> str:
    """The distributed and pipeline sections (modulec.lower.schedule_text_parallel)."""
    from modulec.lower.schedule_text_parallel import print_distributed, print_pipeline

    return (print_distributed(data["distributed"]) if data.get("distributed") else "") + \
        (print_pipeline(data["pipeline"]) if data.get("pipeline") else "")


def _print_function(name: str, ops: list[dict]) -> str:
    lines = [f"schedule @{name} ({len(ops)} op{'s' if len(ops) != 1 else ''}) {{"]
    lines += [_op_line(op) for op in ops]
    return "\n".join(lines + ["}", ""]) + "\n"


def _op_line(op: dict) -> str:
    label = f"%{op['node'][1:]}" if "node" in op else "-"
    line = f"  {label:<6} {op['phase']:<9} s{op.get('stream', 0)}  {op['kernel']}" \
        + _times(op["repeat"])
    if op.get("kind") == "recompute":
        replay = " apply_saved" if op.get("replay") == "apply_saved" else ""
        line += f"  replays {_target(op, '%' + op['node'][1:])}{replay}"
    elif "value" in op:
        line += f"  {_target(op, op['value'])}"
    if "event" in op:
        line += f"  event {op['event']}"
    if op.get("instances"):
        line += "  when i in " + ",".join(
            str(a) if a == b else f"{a}-{b}" for a, b in op["instances"])
    group = f"  [{op['fusion_group']}]" if "fusion_group" in op else ""
    return line + _buffers_text(op.get("buffers", ())) + group


def _target(op: dict, what: str) -> str:
    delta = op.get("instance", 0)
    shift = "" if delta == 0 else f"{delta:+d}"
    return f"{op['function']}/{what}[i{shift}]"


def _times(repeat) -> str:
    return "" if str(repeat) == "1" else f"  ×{repeat}"


def _buffers_text(buffers) -> str:
    """`value@region+offset:bytes`, `(in owner)` where another value owns the storage."""
    return "".join(f"  {value}@{region}+{offset}:{size}" + (f" (in {rest[0]})" if rest else "")
                   for value, region, offset, size, *rest in buffers)


def _print_layout(layout: dict) -> str:
    sizes = ", ".join(f"{region} {size} bytes" for region, size in layout["regions"].items())
    lines = [f"layout ({sizes}) {{"]
    for record in layout["functions"]:
        saved, host = record["saved"], record["host"]
        lines.append(f"  @{record['function']} ×{record['instances']}  saved "
                     f"+{saved['base']} + i*{saved['stride']}" + (
                         f"  host +{host['base']} + i*{host['stride']}" if host["stride"]
                         else ""))
        lines += [_value_line(v) for v in record["values"]]
    return "\n".join(lines + ["}", ""]) + "\n"


def _value_line(value: dict) -> str:
    name = f" {value['name']}" if value["name"] else ""
    shape = ", ".join(value["shape"])
    runs = value["decisions"]
    decisions = runs[0][0] if len(runs) == 1 else ", ".join(
        f"{kind} {a}-{b}" if a != b else f"{kind} {a}" for kind, a, b in runs)
    where = f"+{value['offset']}:{value['bytes']}" + (
        f" view of {value['view_of']}" if "view_of" in value else "")
    host = f"  host +{value['host_offset']}" if "host_offset" in value else ""
    return f"    {value['value']}{name}  [{shape}] {value['dtype']}  {where}  {decisions}{host}"
