"""Work run in each process of the LoRA-under-tensor-parallel tests (tests/test_tp_lora.py,
tests/test_cuda_tp_lora.py; torch.multiprocessing starts them: the functions must be
importable)."""

from __future__ import annotations

import contextlib
import os

import torch

from tests.runtime_models import TINY

LORA = dict(rank=4, alpha=8, targets=["q", "k", "v", "o", "gate", "up", "down"])
STATE_PARTS = ("masters", "exp_avg", "exp_avg_sq")


def lora_model(tp: int = 1, rank: int = 0, sp: bool = False, dtype=torch.float64):
    """The tiny Llama with LoRA on every projection (rank 4), built for `tp` ranks."""
    from runtime.model import Model

    path, settings = TINY["llama"]
    model = Model.from_module(path, settings={k: str(v) for k, v in settings.items()},
                              dtype=dtype, lora=LORA, tensor_parallel=tp, tp_rank=rank,
                              sequence_parallel=sp)
    model.check_finite = False
    return model


def whole_params() -> dict:
    """The one-process model's parameters: random base weights and adapters, B != 0 (so
    that both adapter matrices have gradients from the first step)."""
    model = lora_model().init_random(seed=0)
    generator = torch.Generator().manual_seed(2)
    for path, tensor in model.params.items():
        if path.endswith("lora_B"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator,
                                           dtype=torch.float64))
    return {p: t.detach().clone() for p, t in model.params.items()}


def rank_model(whole: dict, tp: int, rank: int, sp: bool = False):
    """Rank `rank`'s program of `tp` with its slices of `whole` (copies: trained in place)."""
    from runtime.tensor_parallel import shard_params

    model = lora_model(tp, rank, sp)
    sliced = shard_params(whole, model.source.program(planned=False), rank)
    model.params = {p: t.clone() for p, t in sliced.items()}
    return model


def lora_steps(trainer, steps: int, rows: int, seq: int, part: slice = slice(None)) -> list:
    from tests.tp_workers import windows

    return [trainer.train_step(w[part]) for w in windows(steps, rows, seq)]


def one_process(whole: dict, steps: int, rows: int, seq: int) -> dict:
    """The reference: one process, the whole model and batch (CPU trainer, float64)."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    model = lora_model()
    model.params = {p: t.clone() for p, t in whole.items()}
    trainer = CPUTrainer(model, rows, seq, AdamW(lr=1e-2, weight_decay=0.1))
    losses = lora_steps(trainer, steps, rows, seq)
    state = trainer.state()
    return {"losses": losses, "params": dict(model.params),
            **{k: dict(state[k]) for k in STATE_PARTS}}


def lora_rank(rank: int, world: int, ports: list, whole: dict, runs: list, sizes: tuple,
              cli_runs: list, out: str) -> None:
    """`steps_rank` on ports[0], then each of `cli_runs` (train_model's arguments) on the
    ports after it (`train_runs`): one process start for both."""
    steps_rank(rank, world, ports[0], whole, runs, sizes, out)
    train_runs(rank, world, ports[1:], cli_runs, out)


def steps_rank(rank: int, world: int, port: int, whole: dict, runs: list, sizes: tuple,
               out: str) -> None:
    """Each of `runs` ((sp, zero)) over `world` gloo ranks, --tp 2 (world 4: DP 2 x TP 2
    under ZeRO `zero`, each TP pair its rows), float64, from rank slices of `whole`: the
    losses, the whole state (the slices joined) and the rank's parameters after the
    steps, saved to `out`.<rank> by run."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.data_parallel import CPUDataParallelTrainer, whole_state
    from runtime.train.optim import AdamW
    from tests.dist_workers import join

    steps, rows, seq = sizes
    context = join(rank, world, port)
    got = {}
    try:
        for sp, zero in runs:
            parallel = context.data_parallel(zero or 0, tp=2, sp=sp)
            model = rank_model(whole, 2, rank % 2, sp)
            adamw = AdamW(lr=1e-2, weight_decay=0.1)
            own = rows // parallel.dp
            if parallel.dp == 1:  # as runtime.train.run.Run._trainer
                parallel.use_tensor_parallel_group()
                trainer = CPUTrainer(model, own, seq, adamw)
            else:
                trainer = CPUDataParallelTrainer(model, own, seq, adamw, parallel)
            part = slice(parallel.dp_rank * own, (parallel.dp_rank + 1) * own)
            losses = lora_steps(trainer, steps, rows, seq, part)
            joined = whole_state(trainer.state(), model, parallel)
            got[sp, zero] = {"losses": losses, "params": dict(model.params),
                             **{k: dict(joined[k]) for k in STATE_PARTS}}
            got[sp, zero]["gpu_gathered"] = gpu_gathered(trainer, model, parallel)
            if parallel.dp == 1:
                got[sp, zero]["gpu_paths"] = gpu_paths(rank_model(whole, 2, rank % 2, sp))
    finally:
        from runtime.kernels.comm import set_tp_group

        set_tp_group(None)
        context.close()
    torch.save(got, f"{out}.{rank}")


def gpu_gathered(trainer, model, parallel) -> dict:
    """The GPU trainer's checkpoint state under data parallel (CUDATrainer._gathered_state:
    the adapters from its ZeRO run, here one that yields the CPU trainer's state as the
    gathered shards would, the frozen base from its host copy) joined over the TP pair
    as runtime.train.run.Run._save does: the whole masters and moments. The TP partner
    of rank 0 is not the main rank; it once kept nothing, so rank 0's join raised."""
    from types import SimpleNamespace

    from runtime.train.backends import CUDATrainer
    from runtime.train.data_parallel import whole_state
    from runtime.train.param_groups import frozen_parameters

    state = trainer.state()
    frozen = frozen_parameters(model.source.program(planned=False))
    trained = [p for p in state["masters"] if p not in frozen]
    zero = SimpleNamespace(full_state=lambda moments: (
        (p, state["masters"][p].detach().clone(), state["exp_avg"][p], state["exp_avg_sq"][p])
        for p in trained))
    step = SimpleNamespace(zero=zero, dist=parallel, step_count=torch.tensor(2.0))
    gpu = SimpleNamespace(step=step, model=SimpleNamespace(params={}),
                          frozen={p: state["masters"][p] for p in state["masters"]
                                  if p in frozen})
    joined = whole_state(CUDATrainer._gathered_state(gpu), model, parallel)
    return {k: dict(joined[k]) for k in STATE_PARTS}


def gpu_paths(model) -> dict:
    """One forward + backward of a rank's program by the reference interpreter and by the
    GPU step's (runtime/cuda/step_interpreter.py: its train kernels on the CPU, LoRA's
    addmm pairs of the forward and d_x sums of the backward): the differences, and how
    many pairs each run fused."""
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.cuda.train_kernels import train_kernels
    from tests.tp_workers import step

    want, runs = step(model), []

    def interpreter():
        runs.append(_StepInterpreter(model.program.graph, model.params, model.dtype,
                                     check_finite=False, kernels=train_kernels("cpu"),
                                     keep_only_saved=True, decisions=None))
        return runs[-1]
    model._interpreter = interpreter
    got = step(model)
    return {"loss": abs(float(got["loss"] - want["loss"])),
            "grads": max(float((got["grads"][p] - g).abs().max())
                         for p, g in want["grads"].items()),
            "same_grads": set(got["grads"]) == set(want["grads"]),
            "fused": sum(r.lora_fused for r in runs),
            "dx_fused": sum(r.lora_dx_fused for r in runs)}


def train_runs(rank: int, world: int, ports: list, runs: list, out: str) -> None:
    """`modulec train`'s entry (runtime.train.run.train_model) once per run in the
    environment torchrun sets; rank r's stdout to `out`.<run>.<r>."""
    from runtime.train.run import train_model

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0")
    for index, (port, kwargs) in enumerate(zip(ports, runs)):
        os.environ["MASTER_PORT"] = str(port)
        with open(f"{out}.{index}.{rank}", "w") as file, contextlib.redirect_stdout(file):
            print(train_model(**kwargs), flush=True)
