"""What the built program tells a trainer about each parameter (metadata `training`).

`@frozen` (and `@gradient(skip)`) parameters are listed in `frozen`: no gradient is
derived for them (Function.no_gradient) and a trainer keeps no optimizer state for them.
`@trainable(lr_scale=, wd_scale=, grad_clip=)` settings other than the defaults (and a
written `wd_scale`, which overrides the trainer's default weight-decay exclusions) are
listed by parameter path in `parameters`; runtime.train.param_groups turns them into each
parameter's learning rate, weight decay and clip, for the CPU trainer and the GPU step
alike (docs/build-output.md, "metadata.training").
"""

from __future__ import annotations

from modulec.ir.graph import Graph, function_runs

DEFAULTS = {"lr_scale": 1.0, "wd_scale": 1.0, "grad_clip": None}


def trainable_settings(notes, env) -> dict:
    """The non-default `@trainable` arguments among a parameter's annotations."""
    from modulec.check.annotation_table import argument_values
    from modulec.lower.value_marks import number

    note = next((a for a in notes if a.name == "trainable"), None)
    if note is None:
        return {}
    values = argument_values(note)
    settings = {key: number(values.get(key), default, env) for key, default in DEFAULTS.items()}
    # a written wd_scale is kept even at 1.0: it overrides the trainer's default
    # exclusion of norms, biases and embeddings from weight decay
    return {k: v for k, v in settings.items()
            if v != DEFAULTS[k] or (k == "wd_scale" and values.get(k) is not None)}


def training_metadata(graph: Graph, settings: dict[str, dict]) -> dict | None:
    """{"frozen": [paths], "parameters": {path: settings}} over every parameter path of
    the model (`blocks[3].mlp.up_weight`); None when nothing is frozen or set.
    `settings`: function name -> local parameter name -> its non-default settings."""
    frozen: set[str] = set()
    parameters: dict[str, dict] = {}
    for function, prefix in function_runs(graph, graph.function(graph.entry)):
        local = settings.get(function.name, {})
        for param in function.params:
            name = param.id[len("param:"):]
            path = _join(prefix, name)
            if param.id in function.no_gradient:
                frozen.add(path)
            if local.get(name):
                parameters[path] = dict(sorted(local[name].items()))
    if not frozen and not parameters:
        return None
    return {"frozen": sorted(frozen), "parameters": dict(sorted(parameters.items()))}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
