"""Work run in each process of the streamed-save test (torch.multiprocessing starts them):
`modulec train`'s own entry (runtime.train.run.train_model) once per run, as under
torchrun, with rank 0's streamed files written through `Probe` (the injectable writer):
it counts the bytes of the tensors handed to the writer that are still alive, by their
storage (a view counts its whole base: a gathered bucket once), and writes the peak and
the largest single tensor to `out`.<run>.json."""

from __future__ import annotations

import contextlib
import json
import os
import weakref

from runtime.hf_weights.stream import StreamFile


class Probe(StreamFile):
    live: dict = {}  # storage pointer -> [bytes, tensors alive]
    peak = largest = written = 0

    @classmethod
    def reset(cls) -> None:
        cls.live, cls.peak, cls.largest, cls.written = {}, 0, 0, 0

    def write(self, name, tensor) -> None:
        cls = type(self)
        key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        entry = cls.live.setdefault(key, [size, 0])
        entry[1] += 1
        weakref.finalize(tensor, cls._dropped, key)
        cls.peak = max(cls.peak, sum(e[0] for e in cls.live.values()))
        cls.largest = max(cls.largest, tensor.numel() * tensor.element_size())
        cls.written += tensor.numel() * tensor.element_size()
        super().write(name, tensor)

    @classmethod
    def _dropped(cls, key) -> None:
        entry = cls.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del cls.live[key]


def save_runs(rank: int, world: int, ports: list, runs: list, out: str) -> None:
    import runtime.train.checkpoint as checkpoint
    from runtime.train.run import train_model

    checkpoint.StreamFile = Probe  # save_checkpoint's default writer
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    for index, (port, kwargs) in enumerate(zip(ports, runs)):
        os.environ["MASTER_PORT"] = str(port)  # each run joins (and leaves) its own group
        Probe.reset()
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            train_model(**kwargs)
        if rank == 0:
            counts = {"peak": Probe.peak, "largest": Probe.largest, "written": Probe.written}
            with open(f"{out}.{index}.json", "w") as file:
                json.dump(counts, file)
