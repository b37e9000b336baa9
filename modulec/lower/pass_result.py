"""What a pass returns beside its graph (modulec/lower/passes.py): a pass reads its
`PassContext` and writes nothing into it or the plans it holds; `run_pipeline` merges a
`PassResult` into the context for the passes after it and for the build."""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.ir.graph import Graph


@dataclass(frozen=True)
class PassResult:
    """A pass's graph and what it found beside it (a pass with nothing to add returns its
    Graph alone)."""
    graph: Graph
    shards: dict = field(default_factory=dict)  # function -> {param id: Shard}: join the plan
    vocab_outputs: tuple = ()  # entry outputs split over the vocabulary (`--tp`), by name
    lora_report: object = None  # modulec.lower.lora.LoraReport: what the lora pass adapted
