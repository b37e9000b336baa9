"""The planner's swap decisions on the GPU step: activations copied to pinned host memory
on a copy stream during the forward and back during the backward, inside the captured
CUDA graph.

- Unit: a storage. The planner decides per storage, and a storage's values (a projection
  and its split or transposed views) all carry its decision; the bytes move once and the
  views are rebuilt on the restored storage with their own sizes, strides and offsets.
- Swap-out, when the forward function run that made the values returns: the copy stream
  waits for the main stream, copies the storage into its pinned host buffer (one per
  (function, value, instance), kept by the step, so a captured graph replays into the
  same host memory), and records an event. The device storage is dropped `lag` releases
  later, after the main stream waited on that event: the caching allocator may then hand
  the bytes out again (no `record_stream`, which during capture would keep every block
  to the end of the capture).
- Swap-in, ahead of use: when the backward of a forward run starts, the storages swapped
  out by the runs released `lead` releases before it (or later) are copied back on the
  copy stream into new device memory allocated on the main stream; the read waits on its
  event. A value read before its prefetch was issued is fetched then (the main stream
  waits for the copy).
- `finish` joins the copy stream at the end of the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class Stored:
    """One swapped storage: its pinned host copy and the views that lived on it."""
    host: torch.Tensor  # uint8, pinned
    views: dict = field(default_factory=dict)  # value -> (dtype, size, stride, offset)
    function: str = ""  # the forward function whose run swapped it (not the frame:
    # frame.host refers to this object, and a cycle would keep the device copy alive
    # until the garbage collector ran, 0.7 GiB a step at the TinyLlama shape)
    release: int = 0  # the forward release it was swapped out at
    incoming: tuple | None = None  # (event, device uint8 tensor) once a swap-in started


class GpuSwaps:
    def __init__(self, lag: int = 48, lead: int = 36):
        """`lag`: forward releases between a copy-out and the main stream's wait for it.
        The copies run one after another on one link (55 GB/s: 8 ms for a TinyLlama
        layer's 450 MB, five layers of forward), so a short lag stalls the forward on
        them: at budget 21.2, 12 releases cost 14 ms a step, 36 about 5, 48 none. The
        freed bytes only have to be back before the forward's end, where the peak is.
        `lead`: how many releases ahead of its use a swap-in starts."""
        self.lag, self.lead = lag, lead
        self.stream: torch.cuda.Stream | None = None
        self.buffers: dict = {}  # (function, value, instance) -> pinned uint8 host tensor
        self.start_step()

    def start_step(self) -> None:
        self.releases = 0
        self.leaving: deque = deque()  # (release, event, device storage tensor)
        self.stored: list[Stored] = []  # in swap-out order

    # ------------------------------------------------------------------ forward
    def swap_out(self, frame, values: dict) -> list[Stored]:
        """Copy out the storages of `values` (value -> tensor) of `frame`; returns one
        `Stored` per storage (the caller forgets the values)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        groups: dict = {}
        for value, tensor in values.items():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append((value, tensor))
        out = []
        for members in groups.values():
            first_value, first = members[0]
            device = _bytes_of(first)
            key = (frame.function.name, first_value, frame.instance)
            host = self.buffers.get(key)
            if host is None or host.numel() != device.numel():
                host = self.buffers[key] = torch.empty(device.numel(), dtype=torch.uint8,
                                                       pin_memory=True)
            with torch.cuda.stream(self.stream):
                host.copy_(device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.leaving.append((self.releases, done, device))
            stored = Stored(host, {v: (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
                                   for v, t in members}, frame.function.name, self.releases)
            self.stored.append(stored)
            out.append(stored)
        return out

    def released(self) -> None:
        """A forward run returned: free the storages copied out `lag` releases ago."""
        self.releases += 1
        main = torch.cuda.current_stream()
        while self.leaving and self.leaving[0][0] <= self.releases - self.lag:
            _, done, _ = self.leaving.popleft()
            main.wait_event(done)

    def forward_done(self) -> None:
        """The forward ended: every copy-out finishes before the backward reuses memory."""
        main = torch.cuda.current_stream()
        while self.leaving:
            _, done, _ = self.leaving.popleft()
            main.wait_event(done)

    # ------------------------------------------------------------------ backward
    def prefetch_for(self, release: int) -> None:
        """The backward of the run released at `release` starts: bring back what was
        swapped out from `release - lead` on."""
        for stored in self.stored:
            if stored.incoming is None and stored.release >= release - self.lead:
                self._fetch(stored)

    def restore(self, stored: Stored, value: str) -> torch.Tensor:
        if stored.incoming is None:
            self._fetch(stored)
        done, device = stored.incoming
        torch.cuda.current_stream().wait_event(done)
        dtype, size, stride, offset = stored.views.pop(value)
        storage = device.untyped_storage()
        if not stored.views:  # every view rebuilt: they alone keep the storage now
            stored.incoming = (done, None)
        return torch.empty(0, dtype=dtype, device=device.device).set_(storage, offset, size,
                                                                      stride)

    def _fetch(self, stored: Stored) -> None:
        main = torch.cuda.current_stream()
        device = torch.empty(stored.host.numel(), dtype=torch.uint8, device="cuda")
        self.stream.wait_stream(main)  # the allocation (and what freed it before) first
        with torch.cuda.stream(self.stream):
            device.copy_(stored.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        stored.incoming = (done, device)

    def finish(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        self.start_step()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as a uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,))
