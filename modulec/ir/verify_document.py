"""The IR document around its graph: top-level keys, the weight schema, the metadata and
the config schema, checked against a verified graph (modulec.ir.load.check_document).

The runtime reads all three: the weight schema says which checkpoint tensors make which
parameter (a schema naming a parameter the graph lacks, or the wrong shape, loaded into
nothing or the wrong place), the metadata says which inputs `run` binds. Each must say
what the graph says.
"""

from __future__ import annotations

import math

from modulec.ir.graph import Graph, function_runs

TOP_LEVEL = ("ir_version", "graph", "schedule", "weight_schema", "config_schema", "metadata")
WEIGHT_KINDS = ("direct", "fuse", "transform", "tied", "stack")
MAX_PARAMETER_RUNS = 1_000_000  # function runs walked to list parameter paths


def unknown_keys(document: dict, where: str) -> list[str]:
    extra = sorted(k for k in document if k not in TOP_LEVEL)
    return [f"{where}: unknown top-level key `{extra[0]}` (keys: {', '.join(TOP_LEVEL)})"] \
        if extra else []


def document_problems(document: dict, graph: Graph) -> list[str]:
    return (_config_schema(document["config_schema"]) + _metadata(document["metadata"], graph)
            + weight_schema_problems(document["weight_schema"], graph))


def _config_schema(schema) -> list[str]:
    if not isinstance(schema, dict) or not all(
            isinstance(schema.get(k), dict) and all(isinstance(v, str) for v in schema[k].values())
            for k in ("defaults", "hf", "param_mapping")):
        return ["config_schema: expected an object with `defaults`, `hf` and `param_mapping`, "
                "each an object of strings"]
    return []


def _metadata(metadata, graph: Graph) -> list[str]:
    if not isinstance(metadata, dict):
        return ["metadata: expected an object"]
    entry = graph.function(graph.entry)
    inputs = [{"name": v.name or v.id, "shape": list(v.shape), "dtype": v.dtype}
              for v in entry.inputs]
    outputs = [{"value": o, "shape": list(entry.value(o).shape), "dtype": entry.value(o).dtype}
               for o in entry.outputs if entry.value(o)]
    problems = []
    for key, derived in (("inputs", inputs), ("outputs", outputs)):
        if metadata.get(key) != derived:
            problems.append(f"metadata: `{key}` is {_short(metadata.get(key))}, the entry "
                            f"function `{entry.name}` has {_short(derived)}")
    if "training" in metadata:
        problems += _training(metadata["training"], graph)
    if "precision" in metadata:  # the FP8 recipe per matmul (modulec.lower.fp8_recipe)
        from modulec.lower.fp8_recipe import section_problems

        problems += section_problems(metadata["precision"], graph)
    return problems


def _training(training, graph: Graph) -> list[str]:
    """What the trainers read: `frozen` (the graph's no-gradient parameters, exactly) and
    `parameters` (path -> settings of finite numbers, booleans or words)."""
    from modulec.lower.training_settings import training_metadata

    derived = training_metadata(graph, {}) or {"frozen": []}
    if not isinstance(training, dict) or training.get("frozen") != derived["frozen"]:
        return [f"metadata: `training.frozen` is "
                f"{_short(training.get('frozen') if isinstance(training, dict) else training)}"
                f", the graph's frozen parameters are {_short(derived['frozen'])}"]
    settings = training.get("parameters", {})
    shapes = _parameter_shapes(graph) or {}
    if not isinstance(settings, dict):
        return ["metadata: `training.parameters` must be an object"]
    for path, values in settings.items():
        if path not in shapes:
            return [f"metadata: `training.parameters` names `{path}`, not a parameter"]
        if not isinstance(values, dict) or not all(_setting(v) for v in values.values()):
            return [f"metadata: `training.parameters[{path!r}]` must map names to finite "
                    "numbers, booleans or words"]
    return []


def _setting(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (int, bool, str))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


# ====================================================================== the weight schema
def weight_schema_problems(schema, graph: Graph) -> list[str]:
    if not isinstance(schema, list) or not all(isinstance(e, dict) for e in schema):
        return ["weight_schema: expected a list of objects"]
    shapes = _parameter_shapes(graph)
    if shapes is None:
        return [f"weight_schema: the graph has more than {MAX_PARAMETER_RUNS} function runs"]
    problems = []
    for index, entry in enumerate(schema):
        problems += [f"weight_schema entry {index} (`{entry.get('param')}`): {m}"
                     for m in _entry_problems(entry, shapes)]
    return problems


def _entry_problems(entry: dict, shapes: dict) -> list[str]:
    if entry.get("kind") not in WEIGHT_KINDS:
        return [f"kind `{entry.get('kind')}`, not one of {', '.join(WEIGHT_KINDS)}"]
    if not isinstance(entry.get("param"), str):
        return ["`param` must be a string"]
    stacks = entry.get("stacks") or []
    if not isinstance(stacks, list) or not all(
            isinstance(s, dict) and isinstance(s.get("placeholder"), str) and
            _is_count(s.get("count")) for s in stacks):
        return ["`stacks` must be a list of {placeholder, count} with positive counts"]
    if math.prod(s["count"] for s in stacks) > len(shapes):
        return [f"its stacks make {math.prod(s['count'] for s in stacks)} parameters, the "
                f"graph has {len(shapes)}"]
    problems = []
    for path in _paths(entry["param"], stacks):
        if path not in shapes:
            problems.append(f"`{path}` is not a parameter of the graph")
        elif not _fits(entry, shapes[path]):
            problems.append(f"shape {entry.get('shape')}, the graph's `{path}` is "
                            f"[{', '.join(shapes[path])}]")
        if problems:
            break
    if entry["kind"] == "tied" and entry.get("target") is not None and not any(
            p in shapes for p in _paths(str(entry["target"]), stacks)):
        problems.append(f"tied to `{entry['target']}`, not a parameter of the graph")
    return problems


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_by_graph(schema: list, graph: Graph) -> list:
    """The entries of `schema` naming parameters the graph has: a parameter a program
    declares but never reads is in no function of its graph, so there is nothing to load
    it into (the build writes the schema through this; `ir verify` refuses the others)."""
    shapes = _parameter_shapes(graph)
    if shapes is None:
        return schema
    return [e for e in schema if any(p in shapes for p in
                                     _paths(e["param"], e.get("stacks") or []))]


def _paths(template: str, stacks: list):
    """Every concrete path of `template` (its `{i}` placeholders filled)."""
    paths = [template]
    for stack in stacks:
        mark = "{" + stack["placeholder"] + "}"
        paths = [p.replace(mark, str(i)) for p in paths for i in range(stack["count"])]
    return paths


def _fits(entry: dict, shape: tuple) -> bool:
    """The entry's shape is the parameter's; a tensor-parallel entry holds the whole
    tensor, so its sharded dim is larger than the rank's."""
    given = entry.get("shape")
    if given is None:
        return True
    if not isinstance(given, list) or len(given) != len(shape):
        return False
    shard = entry.get("shard") if isinstance(entry.get("shard"), dict) else {}
    return all(str(g) == s for i, (g, s) in enumerate(zip(given, shape))
               if i != shard.get("dim"))


def _parameter_shapes(graph: Graph) -> dict | None:
    """Every parameter path -> its shape (as text), or None for a graph too large to walk."""
    shapes, runs = {}, 0
    for function, prefix in function_runs(graph, graph.function(graph.entry)):
        runs += 1
        if runs > MAX_PARAMETER_RUNS:
            return None
        for p in function.params:
            name = p.id[len("param:"):]
            shapes[f"{prefix}.{name}" if prefix else name] = p.shape
    return shapes
