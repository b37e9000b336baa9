"""The one IR loader: `ir verify`, `run` and `train` read documents through here.

Limits come first (bytes before parsing, JSON depth via Python's recursion guard),
then the verifier; a caller gets problems as data, never an exception.
"""
import json
from pathlib import Path

MAX_IR_BYTES = 256 * 2**20  # a real IR is kilobytes; refuse a 1 GB file before reading it


def read_document(path: Path) -> tuple[object, list[str]]:
    """The parsed document, or None and why it cannot be read."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_IR_BYTES:
            return None, [f"{path}: {size} bytes, more than the {MAX_IR_BYTES}-byte limit"]
        return json.loads(Path(path).read_text(encoding="utf-8")), []
    except RecursionError:  # deeply nested JSON: a diagnostic, not exit 101
        return None, [f"{path}: JSON nested too deeply"]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, [f"{path} is not a JSON document: {exc}"]


MAX_STRING = 2**20  # longest string in a document (a 1 GB string is refused)
MAX_VALUES = 10_000_000  # lists, objects and scalars in all
MAX_REPEAT = 2**20  # a call's repeat count: layer counts, not 10**12


def size_problems(document, where: str) -> list[str]:
    """Limits checked by an explicit stack (no recursion) before the verifier walks it."""
    stack, seen = [document], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return [f"{where}: more than {MAX_VALUES} JSON values"]
        if isinstance(value, str) and len(value) > MAX_STRING:
            return [f"{where}: a string of {len(value)} characters, limit {MAX_STRING}"]
        if isinstance(value, dict):
            repeat = value.get("repeat")
            if isinstance(repeat, int) and repeat > MAX_REPEAT:
                return [f"{where}: repeat {repeat} is more than the limit {MAX_REPEAT}"]
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return []


def check_document(document, where: str = "IR") -> list[str]:
    """Everything wrong with a parsed IR document (empty when it may run)."""
    from modulec.ir.serialize import IR_VERSION, graph_from_data
    from modulec.ir.verify import verify_graph
    from modulec.ir.verify_document import document_problems, unknown_keys
    from modulec.ir.verify_schedule import verify_schedule

    if not isinstance(document, dict):
        return [f"{where}: the top level must be an object"]
    if problems := size_problems(document, where):
        return problems
    missing = [k for k in ("ir_version", "graph", "schedule", "weight_schema",
                           "config_schema", "metadata") if k not in document]
    if missing:
        return [f"{where}: missing top-level keys: {', '.join(missing)}"]
    if problems := unknown_keys(document, where):
        return problems
    if document["ir_version"] != IR_VERSION:
        return [f"{where}: ir_version {document['ir_version']!r}, this modulec reads {IR_VERSION}"]
    try:
        graph = graph_from_data(document["graph"])
        problems = verify_graph(graph)
    except RecursionError:
        return [f"{where}: graph nested too deeply"]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return [f"{where}: malformed graph: {type(exc).__name__}: {exc}"]
    if problems:
        return problems  # the schedule is checked against a sound graph only
    try:
        problems += document_problems(document, graph)
        problems += verify_schedule(document["schedule"], graph)
        if isinstance(document["schedule"], dict):  # distributed and pipeline sections
            from modulec.ir.verify_parallel import verify_parallel

            problems += verify_parallel(document["schedule"], graph)
    except (RecursionError, KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        problems.append(f"{where}: malformed schedule: {type(exc).__name__}: {exc}")
    return problems


def load_document(path: Path) -> tuple[object, list[str]]:
    """Read and verify: (document, []) or (None-or-document, problems)."""
    document, problems = read_document(path)
    return document, problems or check_document(document, str(path))
