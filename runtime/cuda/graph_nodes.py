"""A captured step's CUDA graph with its memset nodes made kernel nodes.

cuBLAS and cuDNN zero small workspaces and flags before many of their kernels; captured,
each zeroing is a memset node, and in a replay the kernel after a memset node starts 4-5 us
after it, where a kernel after a kernel starts within ~1 us (LoRA 8B on one H100: 193
memset nodes a step, ~1 ms of such gaps; benchmarks/gpu/graph_gaps.py). So the step is
captured keeping its cudaGraph_t (torch's CUDAGraph(keep_graph=True)), each memset node is
replaced by a fill kernel node writing the same bytes with the same dependencies
(csrc/kernels/graph_fills.cu), and the graph is instantiated then. Where it was measured
to pay (TrainStep.capture): one-process steps with a frozen base (LoRA 8B, one H100: 0.3 ms
in both orders of an A/B); the full fine-tuning step measured none (TinyLlama: 114.82 ->
115.30 ms, one order), and data-, tensor- and pipeline-parallel steps were not measured:
they keep their memset nodes. MODULEC_GRAPH_FILLS=0, or a torch without keep_graph, keeps
them everywhere.
"""

from __future__ import annotations

import os

import torch


def enabled() -> bool:
    return os.environ.get("MODULEC_GRAPH_FILLS", "1") != "0"


def new_graph(fills: bool = True) -> torch.cuda.CUDAGraph:
    """A CUDAGraph for `torch.cuda.graph(...)` that keeps its cudaGraph_t for `finish`
    where `fills` (the caller's choice: where it was measured to pay), the switch is on and
    this torch can, else a plain one."""
    if fills and enabled():
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # a torch before keep_graph (and raw_cuda_graph, instantiate)
            return torch.cuda.CUDAGraph()
        graph._modulec_kept = True
        return graph
    return torch.cuda.CUDAGraph()


def finish(graph: torch.cuda.CUDAGraph) -> int:
    """After the capture: the kept graph's memset nodes replaced, then instantiated (a plain
    graph is instantiated already). Returns how many memset nodes were replaced."""
    if not getattr(graph, "_modulec_kept", False):
        return 0
    from runtime.cuda.build import load

    replaced = load().graph_memsets_to_kernels(graph.raw_cuda_graph())
    graph.instantiate()
    return replaced
