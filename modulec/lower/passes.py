"""The pass pipeline: a flat, named list. Each pass maps Graph IR to Graph IR; the verifier
runs after every pass (a pass that breaks the IR is a compiler bug, caught where it
happens), and `--dump-after NAME` prints the IR a pass produced. A pass reports problems
with the source (E013 for a `@fuse` that cannot apply) into its `PassContext`.

A pass reads the context and never writes it otherwise: what it finds beside the graph
(the `lora` pass's adapters and their tensor-parallel shards, the `tensor_parallel`
pass's vocabulary-split outputs) it returns in a `PassResult` (modulec/lower/pass_result.py),
which `run_pipeline` merges into the context for the passes after it and for the build."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from modulec.ir.graph import Graph
from modulec.ir.verify import verify_graph
from modulec.lower import pass_names
from modulec.lower.backward import derive_backward
from modulec.lower.fusion import fuse
from modulec.lower.lora import apply_lora
from modulec.lower.pass_result import PassResult
from modulec.lower.sequence_parallel import apply_sequence_parallel
from modulec.lower.tensor_parallel import apply_tensor_parallel
from modulec.lower.tp_overlap import apply_tp_overlap
from modulec.source import SourceFile, Span


@dataclass
class PassContext:
    """What passes share besides the graph: the diagnostics they report, and the source
    files (read on demand) their nodes' spans point into."""
    diagnostics: list = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # file name -> SourceFile
    lora: object = None  # modulec.lower.lora.LoraOptions: LoRA on (None: the pass is off)
    weight_schema: list = field(default_factory=list)  # HF names (the lora pass's targets)
    lora_report: object = None  # what the lora pass adapted (modulec.lower.lora.LoraReport)
    # modulec.lower.tensor_parallel.TensorParallel: `--tp` on (None: the pass is off)
    tensor_parallel: object = None

    def annotation_span(self, at: tuple, name: str) -> Span | None:
        """The span of the first `@name(...)` at or after a node's (file, line, column),
        on that line or the next few (a flow's annotations follow its last step)."""
        file, line, column = at
        source = self._source(file)
        if source is None or line < 1:
            return None
        start = source.text.find(f"@{name}", source.offset(line, column))
        if start < 0 or source.position(start)[0] > line + 3:
            return source.span(source.offset(line, column))
        return source.span(start, _annotation_end(source.text, start))

    def _source(self, file: str) -> SourceFile | None:
        if file not in self.sources:
            try:
                self.sources[file] = SourceFile.read(file)
            except OSError:
                self.sources[file] = None
        return self.sources[file]


def _annotation_end(text: str, start: int) -> int:
    """The end of `@name(...)` (its closing parenthesis), or of `@name`."""
    end = start + 1
    while end < len(text) and (text[end].isalnum() or text[end] == "_"):
        end += 1
    if end < len(text) and text[end] == "(":
        depth = 0
        for index in range(end, len(text)):
            depth += {"(": 1, ")": -1}.get(text[index], 0)
            if depth == 0:
                return index + 1
    return end


@dataclass(frozen=True)
class Pass:
    name: str
    summary: str
    run: Callable[[Graph, PassContext], Graph | PassResult]


PIPELINE: tuple[Pass, ...] = (
    Pass("lower", "checked model instance -> forward Graph IR, one function per instance",
         lambda graph, context: graph),
    Pass("tensor_parallel", "with `--tp M` (spec §7.6.1): tp_copy before each "
         "column-sharded matmul's input (and replicated parameters read in the sharded "
         "region), tp_all_reduce after each row-sharded matmul; rewritten functions' "
         "written backwards dropped, derived with the pair (E008 on layout conflicts)",
         apply_tensor_parallel),
    Pass("sequence_parallel", "with `--tp M --sp`: the values between the sharded regions "
         "split along the sequence (T / M rows a rank): sp_scatter into the blocks, "
         "sp_all_gather / sp_reduce_scatter in place of each region's tp_copy / "
         "tp_all_reduce, sp_gather before what needs every row (the LM head); types "
         "re-derived, backwards derived again", apply_sequence_parallel),
    Pass("lora", "with LoRA on (`--lora`): each `@adapter(lora)` matmul y = x @ W^T gets "
         "y += (alpha/rank) (x @ A^T) @ B^T per selected part of a fused weight; base "
         "parameters frozen, written backwards dropped (E008 when misplaced); with `--tp` "
         "A or B split as W is, the other read through a tp_copy", apply_lora),
    Pass("fuse", "chains of ops -> fused ops (fusion_patterns.py): `@fuse` requests (E013 "
         "when one cannot apply), then the patterns the runtime has kernels for; `@nofuse`, "
         "modify/replace hooks and intermediates read elsewhere are barriers", fuse),
    Pass("derive_backward", "reverse mode from the primitives' backward rules (a fused "
         "op's from its fused primitive's); frozen parameters and @gradient(skip) inputs "
         "pruned", lambda graph, context: derive_backward(graph)),
    Pass("tp_overlap", "with `--tp M` (unless `--no-tp-overlap`): each backward "
         "collective that alone reads a matmul backward's input gradient runs on the "
         "communication stream (`stream=comm`) while the weight gradient's GEMM runs (the "
         "node split in two), joined by a `wait` node before the gradient's first reader",
         apply_tp_overlap),
)
PASS_NAMES = tuple(p.name for p in PIPELINE)
assert PASS_NAMES == pass_names.PASS_NAMES, "update modulec/lower/pass_names.py"


def run_pipeline(graph: Graph, dump_after: str | None = None,
                 dump: Callable[[str, Graph], None] | None = None,
                 context: PassContext | None = None) -> Graph:
    context = context if context is not None else PassContext()
    verified = None
    for step in PIPELINE:
        graph = _merged(step.run(graph, context), context)
        # A pass with nothing to do (tensor_parallel, sequence_parallel and lora without
        # their flags, tp_overlap without --tp) returns the graph it was given, which the
        # previous pass's check verified: the IR is frozen, so the verifier's answer is the
        # same: four of a plain build's seven verifications.
        if graph is not verified:
            problems = verify_graph(graph)
            if problems:
                raise AssertionError(f"pass `{step.name}` produced invalid Graph IR:\n"
                                     + "\n".join(problems))
            verified = graph
        if dump is not None and step.name == dump_after:
            dump(step.name, graph)
    return graph


def _merged(result: Graph | PassResult, context: PassContext) -> Graph:
    """The graph a pass returned; its findings merged into the context (a new
    tensor-parallel plan with the shards and outputs added, the LoRA report)."""
    if isinstance(result, Graph):
        return result
    if result.shards or result.vocab_outputs:
        context.tensor_parallel = context.tensor_parallel.extended(result.shards,
                                                                   result.vocab_outputs)
    if result.lora_report is not None:
        context.lora_report = result.lora_report
    return result.graph
