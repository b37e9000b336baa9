"""`modulec ir verify` of a pipeline section's `outputs` (docs/build-output.md): how the
last stage's loss takes the entry's outputs, and that each reaches it.

`outputs` lists the entry's outputs in order, each by the value that makes it (an
alias's input), with the stage that makes it and its `loss`: the first `cross_entropy`
(the logits), then `auxiliary` (a 0-d floating output: added, gradient seed 1) or
`none`. An output made before the last stage is in every boundary after its stage (it is
carried to the loss, and its gradient, the loss's seed, back). A document built before
`outputs` has none: the runtime then trains one output only.
"""

from __future__ import annotations

from modulec.ir.graph import Graph

LOSSES = ("cross_entropy", "auxiliary", "none")


def verify_outputs(section: dict, graph: Graph) -> list[str]:
    rows = section.get("outputs")
    if rows is None:
        return []
    from modulec.plan.pipeline import entry_outputs

    made = entry_outputs(graph)
    if not isinstance(rows, list) or [r.get("value") if isinstance(r, dict) else r
                                      for r in rows] != made:
        return [f"`outputs` must list the entry's outputs by the values that make them, "
                f"{made}, in order"]
    problems = []
    for index, row in enumerate(rows):
        loss = row.get("loss")
        if loss not in LOSSES or (index == 0) != (loss == "cross_entropy"):
            problems.append(f"output {row['value']}: loss {loss!r} (the first is "
                            "cross_entropy, the others auxiliary or none)")
    stages = _made_at(section, graph)
    for row in rows:
        if row.get("stage") != stages.get(row["value"], len(section["stages"]) - 1):
            problems.append(f"output {row['value']} is made on stage "
                            f"{stages.get(row['value'])}, not {row.get('stage')!r}")
            continue
        for boundary in section["boundaries"][row["stage"]:]:
            if row["value"] not in {t["value"] for t in boundary["tensors"]}:
                problems.append(f"output {row['value']}, made on stage {row['stage']}, is "
                                f"not carried from stage {boundary['from']} to "
                                f"{boundary['to']} (the loss is on the last stage)")
    return problems


def _made_at(section: dict, graph: Graph) -> dict[str, int]:
    """Each value an entry node makes -> the stage of its unit (a repeated call's
    outputs: its last layer's)."""
    from modulec.plan.pipeline import unit_stages

    stage_of, made = unit_stages(section), {}
    for node in graph.function(graph.entry).nodes:
        layer = int(node.repeat) - 1 if node.kind == "call" else None
        if (node.id, layer) in stage_of:
            made.update({o: stage_of[(node.id, layer)] for o in node.outputs if o})
    return made
