"""The pass pipeline: a flat, named list. Each pass maps Graph IR to Graph IR; the verifier
runs after every pass (a pass that breaks the IR is a compiler bug, caught where it
happens), and `--dump-after NAME` prints the IR a pass produced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from modulec.ir.graph import Graph
from modulec.ir.verify import verify_graph
from modulec.lower import pass_names
from modulec.lower.backward import derive_backward


@dataclass(frozen=True)
class Pass:
    name: str
    summary: str
    run: Callable[[Graph], Graph]


PIPELINE: tuple[Pass, ...] = (
    Pass("lower", "checked model instance -> forward Graph IR, one function per instance",
         lambda graph: graph),
    Pass("derive_backward", "reverse mode from the primitives' backward rules; frozen "
         "parameters and @gradient(skip) inputs pruned", derive_backward),
)
PASS_NAMES = tuple(p.name for p in PIPELINE)
assert PASS_NAMES == pass_names.PASS_NAMES, "update modulec/lower/pass_names.py"


def run_pipeline(graph: Graph, dump_after: str | None = None,
                 dump: Callable[[str, Graph], None] | None = None) -> Graph:
    for step in PIPELINE:
        graph = step.run(graph)
        problems = verify_graph(graph)
        if problems:
            raise AssertionError(f"pass `{step.name}` produced invalid Graph IR:\n"
                                 + "\n".join(problems))
        if dump is not None and step.name == dump_after:
            dump(step.name, graph)
    return graph
