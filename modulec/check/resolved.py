"""`modulec check --emit resolved`: the checked program with every inferred shape."""

from __future__ import annotations

from modulec.check.instance import Instance, Stack, Submodule, TensorParamValue


def print_resolved(instances: list[Instance]) -> str:
    return "\n".join(_instance_lines(i) for i in instances)


def _instance_lines(instance: Instance) -> str:
    lines = [f"{instance.definition.kind} {instance.describe()}:"]
    constants = [f"{n} = {v}" for n, v in instance.values.items()
                 if n not in {p.name for p in instance.definition.decl.params or ()}]
    if constants:
        lines += ["  let:"] + [f"    {c}" for c in constants]
    if instance.params:
        lines += ["  params:"] + [f"    {n}: {_param(p)}" for n, p in instance.params.items()]
    for phase in ("forward", "backward"):
        tensors = [(n, t, s) for p, n, t, s in instance.inferred if p == phase]
        if tensors:
            lines += [f"  {phase}:"] + [f"    {n}: {t}    # line {s.line}" for n, t, s in tensors]
    return "\n".join(lines) + "\n"


def _param(value) -> str:
    if isinstance(value, TensorParamValue):
        suffix = " @frozen" if value.frozen else ""
        return (f"tied_to({value.tied_to})" if value.tied_to else str(value.type)) + suffix
    if isinstance(value, Submodule):
        return value.instance.describe()
    if isinstance(value, Stack):
        return f"[{value.count}] x {value.instance.describe()}"
    return str(value)
