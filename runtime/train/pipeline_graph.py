"""A GPU pipeline stage's whole step as one CUDA graph (the design's "the whole step in one
CUDA graph", for pipelines): after `WARMUP` eager steps (which create the moments, NCCL's
point-to-point communicators and cuDNN's plans) the step's body is captured once, and each
later step copies its rows into the static window and replays it: every forward, send,
receive, backward, gradient sum, all-reduce, AdamW update of the stage's masters and the
loss's all-reduce, with no Python per kernel. The host reads the loss once a step.

What a replay would get wrong stays eager (`capturable`): dropout (its seeds are Python
ints per step) and packed sequences (their documents are made per step); and the CPU
(gloo), which has no graphs. A replay reads and writes the tensors it recorded, so what
the host changes between steps goes into those, never into new ones: the learning rate
and the step count the updates read are device scalars (runtime/train/
pipeline_precision.py DeviceAdamW: `set_lr` fills the rate), and a loaded state is
copied into the masters, compute copies and moments the stage holds."""

from __future__ import annotations

import torch
from torch import Tensor

WARMUP = 2


def capturable(trainer) -> str | None:
    """Why `trainer`'s steps cannot be one captured graph (None: they can)."""
    if not trainer.precision.mixed or not str(trainer.device).startswith("cuda"):
        return "not a GPU run"
    if trainer.packing is not None:
        return "packed sequences (their documents are made per step)"
    graph = trainer.program.graph
    if any(node.target == "dropout" for f in graph.functions for node in f.nodes):
        return "dropout (its masks are seeded per step on the host)"
    return None


class PipelineGraph:
    """Runs `body(window)` (a device window of the step's rows -> the loss, a device
    tensor) eagerly WARMUP times, then captured once and replayed."""

    def __init__(self, body, device: str):
        self.body, self.device = body, device
        self.window: Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: Tensor | None = None
        self.eager = 0

    def __call__(self, window: Tensor) -> Tensor:
        if self.window is None or self.window.shape != window.shape:
            if self.graph is not None:
                raise ValueError(f"a captured pipeline step takes {tuple(self.window.shape)}"
                                 f" rows; got {tuple(window.shape)}")
            self.window = window.to(self.device, copy=True)
        else:
            self.window.copy_(window)
        if self.eager < WARMUP:
            self.eager += 1
            return self.body(self.window)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.loss

    def _capture(self) -> None:
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self.body(self.window)
