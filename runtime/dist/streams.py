"""The streams and events the distributed section's ops name (stream 0 compute, stream 2
communication), on CUDA; on the CPU every op runs in order where it is issued and events
are nothing. An event is keyed by its name and bucket instance (`grads:blocks[3]`);
every wait the section writes refers to a record made earlier in the same step, so the
whole step, collectives included, can be captured in one CUDA graph."""

from __future__ import annotations

from contextlib import nullcontext

import torch


class CudaStreams:
    def __init__(self):
        self.compute = torch.cuda.current_stream()
        self.comm = torch.cuda.Stream()
        self.events: dict[str, torch.cuda.Event] = {}

    def begin_step(self) -> None:
        """The compute stream is the one current when the step starts (a warm-up's side
        stream, or the capturing stream)."""
        self.compute = torch.cuda.current_stream()

    def on(self, stream: int):
        return torch.cuda.stream(self.comm) if stream else torch.cuda.stream(self.compute)

    def record(self, stream: int, key: str) -> None:
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = torch.cuda.Event()
        event.record(self.comm if stream else self.compute)

    def wait(self, stream: int, key: str) -> None:
        (self.comm if stream else self.compute).wait_event(self.events[key])


class InOrder:
    """The CPU: one stream, so ordering is program order and events are not needed."""

    def begin_step(self) -> None:
        pass

    def on(self, stream: int):
        return nullcontext()

    def record(self, stream: int, key: str) -> None:
        pass

    def wait(self, stream: int, key: str) -> None:
        pass
