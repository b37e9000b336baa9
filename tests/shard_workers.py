"""Work run in each process of the shard-checkpoint test (torch.multiprocessing starts
them): `modulec train`'s own entry (runtime.train.run.train_model) called once per run, in
the environment torchrun would set, rank r's stdout (its JSON lines) to `out`.<run>.<r>."""

from __future__ import annotations

import contextlib
import os


def train_runs(rank: int, world: int, ports: list, runs: list, out: str) -> None:
    from runtime.train.run import train_model

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0")
    for index, (port, kwargs) in enumerate(zip(ports, runs)):
        os.environ["MASTER_PORT"] = str(port)  # each run joins (and leaves) its own group
        with open(f"{out}.{index}.{rank}", "w") as file, contextlib.redirect_stdout(file):
            print(train_model(**kwargs), flush=True)
