"""Work run in each process of the multi-process tests (torch.multiprocessing starts them:
the functions must be importable). Each process joins a gloo group on a free localhost
port given by the test."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.runtime_models import TINY


def join(rank: int, world: int, port: int, device: str = "cpu", timeout_s: int = 60):
    """This process as rank `rank` of `world` (gloo on the CPU, NCCL on "cuda")."""
    from runtime.dist import DistContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0")
    return DistContext.from_env(device=device, timeout_s=timeout_s)


def tiny_model(name: str):
    from runtime.model import Model

    path, settings = TINY[name]
    model = Model.from_module(path, settings={k: str(v) for k, v in settings.items()},
                              dtype=torch.float64)
    model.check_finite = False
    return model.init_random(seed=0)


def windows(steps: int, rows: int, seq: int, vocab: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (rows, seq + 1), generator=generator)
            for _ in range(steps)]


def train_reference(name: str, steps: int, rows: int, seq: int) -> tuple[list, dict]:
    """One process, the whole batch: the losses and the state after `steps`."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(tiny_model(name), rows, seq, AdamW(lr=1e-2, weight_decay=0.1))
    losses = [trainer.train_step(w) for w in windows(steps, rows, seq)]
    return losses, trainer.state()


def train_sharded(rank: int, world: int, port: int, name: str, zero: int, steps: int,
                  rows: int, seq: int, out: str) -> None:
    """`world` processes, each its rows of the same batches; rank 0 saves the losses and
    the gathered state to `out`."""
    from runtime.train.data_parallel import CPUDataParallelTrainer
    from runtime.train.optim import AdamW

    context = join(rank, world, port)
    per_rank = rows // world
    trainer = CPUDataParallelTrainer(tiny_model(name), per_rank, seq,
                                     AdamW(lr=1e-2, weight_decay=0.1),
                                     context.data_parallel(zero))
    losses = [trainer.train_step(w[rank * per_rank:(rank + 1) * per_rank])
              for w in windows(steps, rows, seq)]
    state = trainer.state()
    if rank == 0:
        from modulec.plan.distributed import (
            COMPUTE_BYTES, GRAD_BYTES, entry_buffer_bytes, rank_fixed_bytes,
        )

        run = trainer.zero
        held = {"parts": run.fixed_parts(), "buffer_numel_after": run.buffer_numel(),
                "peak_buffer_numel": run.peak_buffer_numel,
                "predicted_buffer_numel": entry_buffer_bytes(run.section) // COMPUTE_BYTES,
                "predicted_slot_numel":
                    rank_fixed_bytes(run.section)["gradient_buffers"] // GRAD_BYTES,
                "slot_itemsize": run.precision.gradient.itemsize,
                "gradient_slots": {b["name"]: b.get("gradient_slot")
                                   for b in run.section["buckets"]}}
        torch.save({"losses": losses, "state": state, "held": held}, out)
    context.close()


def train_sharded_runs(rank: int, world: int, ports: list, runs: list, steps: int, rows: int,
                       seq: int, out_folder: str) -> None:
    """train_sharded for each (name, zero) of `runs` in turn, each in a group of its own
    (its port of `ports`), from one spawn: a process start costs more than a tiny run."""
    for port, (name, zero) in zip(ports, runs):
        train_sharded(rank, world, port, name, zero, steps, rows, seq,
                      str(Path(out_folder) / f"{name}-{zero}.pt"))


# ------------------------------------------------- packed steps and evaluation (gloo)
SEP = 1  # the end-of-document id of the packed runs


def packed_windows(steps: int, rows: int, seq: int, vocab: int = 64) -> list[torch.Tensor]:
    """Windows whose rows end documents at very different rates (row k: a separator at
    each place with probability k / rows), so the ranks' and micro-batches' counts of
    counted targets differ."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, vocab, (rows, seq + 1), generator=generator)
        rate = torch.arange(rows, dtype=torch.float64)[:, None] / rows
        ends = torch.rand(rows, seq + 1, generator=generator, dtype=torch.float64) < rate
        out.append(torch.where(ends, SEP, ids))
    return out


def one_process_rows(window: torch.Tensor, world: int, accumulation: int) -> torch.Tensor:
    """The rows of a data-parallel step's window in the order one process's micro-batches
    hold them: micro-batch j is every rank's micro-batch j, rank by rank."""
    ranks = window.reshape(world, accumulation, -1, window.shape[1])
    return ranks.transpose(0, 1).reshape(window.shape)


def packed_reference(name: str, steps: int, rows: int, seq: int, accumulation: int,
                     world: int, eval_path: str) -> dict:
    """One process, packed, every rank's rows (micro-batches of world x rows): the losses,
    the state and the eval loss after each step."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing

    trainer = CPUTrainer(tiny_model(name), rows * world, seq,
                         AdamW(lr=1e-2, weight_decay=0.1), accumulation, Packing(SEP))
    data = EvalData(Path(eval_path), "uint16", seq, rows, 64)
    losses, evals = [], []
    for window in packed_windows(steps, rows * world * accumulation, seq):
        losses.append(trainer.train_step(one_process_rows(window, world, accumulation)))
        evals.append(evaluate(trainer, data))
    return {"losses": losses, "evals": evals, "state": trainer.state()}


def packed_sharded(rank: int, world: int, port: int, name: str, zeros: tuple, steps: int,
                   rows: int, seq: int, accumulation: int, eval_path: str,
                   out: str) -> None:
    """`world` ranks, packed, each its rows of the same windows (as `modulec train` gives
    them, with the denominators of runtime.train.packing), at each ZeRO stage of `zeros`,
    each step followed by the evaluation split over the ranks. Every rank saves its
    losses, eval losses and the ZeRO-3 entry buffers held after each evaluation by stage,
    rank 0 the gathered states."""
    from runtime.train.data_parallel import CPUDataParallelTrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing, denominators

    context = join(rank, world, port)
    packing, saved = Packing(SEP), {}
    data = EvalData(Path(eval_path), "uint16", seq, rows, 64)
    for zero in zeros:
        parallel = context.data_parallel(zero)
        trainer = CPUDataParallelTrainer(tiny_model(name), rows, seq,
                                         AdamW(lr=1e-2, weight_decay=0.1), parallel,
                                         accumulation, packing)
        losses, evals, held, mine = [], [], [], rows * accumulation
        for window in packed_windows(steps, mine * world, seq):
            losses.append(trainer.train_step(window[rank * mine:(rank + 1) * mine],
                                             denominators(window, packing, rows, world)))
            evals.append(evaluate(trainer, data, parallel))
            held.append(trainer.zero.buffer_numel())
        if zero == 3:  # the GPU evaluation's pass too (on the reference kernels)
            held.append(_forward_only_pass(trainer, data.batch_at(rank), rows, seq))
        state = trainer.state()
        saved[zero] = {"losses": losses, "evals": evals, "held": held} | \
            ({"state": state} if rank == 0 else {})
    torch.save(saved, f"{out}.{rank}")
    context.close()


def _forward_only_pass(trainer, window, rows: int, seq: int) -> tuple:
    """runtime/cuda/evaluate.py's pass (the fused head split off, the step's kernels on
    the CPU) over a ZeRO-3 trainer's sharded weights, through its ZeroRun as on the GPU:
    (its loss, cpu_loss's, the entry-buffer elements held after it)."""
    from types import SimpleNamespace

    from runtime.cuda.evaluate import eval_loss
    from runtime.cuda.lm_head import split_head
    from runtime.cuda.train_kernels import train_kernels
    from runtime.train.data_parallel import program_of
    from runtime.train.evaluate import cpu_loss
    from runtime.train.packing import split_batch

    program = program_of(trainer.model, rows, seq)
    split = split_head(program.graph)
    step = SimpleNamespace(graph=split.graph, compute=trainer.model.params,
                           dtype=torch.float64, kernels=train_kernels("cpu", ("flash",)),
                           input_names=program.input_names(), split=split,
                           chunk_rows=2048, ignore_index=trainer.packing.ignore_index,
                           zero=trainer.zero)
    tokens, labels, documents = split_batch(window, trainer.packing)
    loss = float(eval_loss(step, tokens, labels, documents))
    return loss, cpu_loss(trainer, window), trainer.zero.buffer_numel()


# ---------------------------------------------------------------------- on GPUs (NCCL)
GPU_LLAMA = ("std/models/llama.module",
             dict(vocab_size=512, d_model=256, n_layers=3, num_heads=8, num_kv_heads=2,
                  d_ff=512, max_seq=128, eps=1e-5))


def gpu_batches(steps: int, rows: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, GPU_LLAMA[1]["vocab_size"], (rows, seq), generator=generator,
                          dtype=torch.int32) for _ in range(steps)]


def gpu_train(step, batches: list) -> list[float]:
    """An eager step, then capture (one warm-up step) and replays: the CUDA graph path."""
    losses = [float(step(batches[0].cuda()))]
    step.set_batch(batches[1].cuda())
    step.capture(warmup=1)
    losses.append(float(step.loss))
    for tokens in batches[2:]:
        losses.append(float(step(tokens.cuda())))
    return losses


def gpu_reference(steps: int, rows: int, seq: int, clip: float | None = None,
                  more: dict | None = None) -> tuple[list, dict]:
    """One GPU on the whole batch; `clip`: global gradient-norm clipping with weight
    decay 0.1 (the default exclusions), the last step's norm under `grad_norm`; `more`:
    settings over GPU_LLAMA's."""
    from runtime.cuda.step import TrainStep

    step = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1] | (more or {}), batch=rows,
                                 seq=seq, **_optimizer(clip))
    step.init_random(0)
    losses = gpu_train(step, gpu_batches(steps, rows, seq))
    masters = {p: step.masters[p].cpu() for p in step.names}
    if clip is not None:
        masters["grad_norm"] = step.grad_norm.cpu()
    return losses, masters


def _optimizer(clip: float | None) -> dict:
    from runtime.cuda.step import AdamWConfig

    return {} if clip is None else {"adamw": AdamWConfig(weight_decay=0.1, clip_grad=clip)}


def gpu_sharded(rank: int, world: int, port: int, zero: int, steps: int, rows: int,
                seq: int, out: str, clip: float | None = None, more: dict | None = None
                ) -> None:
    """ZeRO stage `zero` over `world` GPUs, each rank its own rows of every batch; `clip`
    and `more` (settings over GPU_LLAMA's) as gpu_reference takes them."""
    from runtime.cuda.step import TrainStep

    context = join(rank, world, port, "cuda", 120)
    per_rank = rows // world
    step = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1] | (more or {}), batch=per_rank,
                                 seq=seq, dist=context.data_parallel(zero), **_optimizer(clip))
    step.init_random(0)
    own = [b[rank * per_rank:(rank + 1) * per_rank] for b in gpu_batches(steps, rows, seq)]
    local = gpu_train(step, own)
    losses = []
    for loss in local:  # the mean over the ranks' rows
        value = torch.tensor([loss], device="cuda")
        torch.distributed.all_reduce(value)
        losses.append(float(value) / world)
    masters = {path: master for path, master, _, _ in step.zero.full_state()}
    if clip is not None:
        masters["grad_norm"] = step.grad_norm.cpu()
    if rank == 0:
        from modulec.plan.distributed import (
            COMPUTE_BYTES, entry_buffer_bytes, rank_fixed_bytes,
        )

        section = step.program.document["schedule"]["distributed"]
        torch.save({"losses": losses, "masters": masters,
                    "gather_transport": step.zero.gather_transport,
                    "fixed_bytes": step.zero.fixed_bytes(),
                    "predicted_bytes": rank_fixed_bytes(section)["total"],
                    "buffer_numel_after": step.zero.buffer_numel(),
                    "peak_buffer_numel": step.zero.peak_buffer_numel,
                    "predicted_buffer_numel": entry_buffer_bytes(section) // COMPUTE_BYTES},
                   out)
    context.close()
    context.exit_now()


def gpu_dp_tp(rank: int, world: int, port: int, zero: int, steps: int, rows: int, seq: int,
              out: str, tp: int = 2, clip: float | None = None) -> None:
    """DP x TP over `world` GPUs (TP groups of `tp` consecutive ranks, ZeRO stage `zero`
    across them; `world` = `tp`: one TP group, no ZeRO): the whole model's random weights
    sliced per TP rank, each data-parallel rank its own rows of every batch (the ranks of
    a TP group the same rows); rank 0 saves the losses averaged over the ranks (a TP
    group's are equal) and, with `clip` (global clipping), the last step's norm."""
    from runtime.cuda.step import TrainStep, random_params
    from runtime.tensor_parallel import shard_params

    context = join(rank, world, port, "cuda", 120)
    run = context.data_parallel(zero, tp=tp)
    per_rank = rows // run.dp
    step = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1], batch=per_rank, seq=seq,
                                 dist=run, **_optimizer(clip))
    whole = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1], batch=per_rank, seq=seq)
    step.load(shard_params(random_params(whole.shapes(), 0), step.program, rank % tp))
    del whole
    first = run.dp_rank * per_rank
    local = gpu_train(step, [b[first:first + per_rank] for b in gpu_batches(steps, rows, seq)])
    losses = []
    for loss in local:
        value = torch.tensor([loss], device="cuda")
        torch.distributed.all_reduce(value)
        losses.append(float(value) / world)
    if rank == 0:
        torch.save({"losses": losses, "dp": run.dp, "grad_norm": step.grad_norm.cpu()}, out)
    context.close()
    context.exit_now()


def gpu_tensor_parallel(rank: int, world: int, port: int, steps: int, rows: int, seq: int,
                        out: str, sp: bool = False, more: dict | None = None) -> None:
    """TP over `world` GPUs (`sp`: with sequence parallel; `more`: settings over
    GPU_LLAMA's): the whole model's random weights sliced per rank, every rank the same
    batch; rank 0 saves the losses, the program's ops and whether the step took the
    vocab-parallel loss (no fused head split off)."""
    from runtime.cuda.step import TrainStep, random_params
    from runtime.tensor_parallel import shard_params

    context = join(rank, world, port, "cuda", 120)
    settings = GPU_LLAMA[1] | (more or {})
    step = TrainStep.from_module(GPU_LLAMA[0], settings, batch=rows, seq=seq,
                                 dist=context.data_parallel(2, tp=world, sp=sp))
    whole = TrainStep.from_module(GPU_LLAMA[0], settings, batch=rows, seq=seq)
    step.load(shard_params(random_params(whole.shapes(), 0), step.program, rank))
    losses = gpu_train(step, gpu_batches(steps, rows, seq))
    if rank == 0:
        ops = {n.target for f in step.program.graph.functions for n in f.nodes}
        torch.save({"losses": losses, "ops": ops, "vocab_sharded": step.vocab_sharded,
                    "split": step.split is not None}, out)
    context.close()
    context.exit_now()


def gpu_tp_overlap(rank: int, world: int, port: int, steps: int, rows: int, seq: int,
                   out: str, sp: bool = False) -> None:
    """TP over `world` GPUs (`sp`: with sequence parallel), built with the tp_overlap pass
    and with --no-tp-overlap, from the same sliced weights on the same batches: each
    one's first loss and gradients (eager, no update), then its training losses (eager,
    captured, replayed) and masters; rank 0 saves them by overlap, with the number of
    wait nodes of each program and the async ops its first backward issued."""
    from runtime.cuda.step import TrainStep, random_params
    from runtime.tensor_parallel import shard_params

    context = join(rank, world, port, "cuda", 120)
    whole = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1], batch=rows, seq=seq)
    params = random_params(whole.shapes(), 0)
    del whole
    batches = gpu_batches(steps, rows, seq)
    got = {}
    for overlap in (True, False):
        run = context.data_parallel(2, tp=world, sp=sp, tp_overlap=overlap)
        step = TrainStep.from_module(GPU_LLAMA[0], GPU_LLAMA[1], batch=rows, seq=seq,
                                     dist=run)
        step.load(shard_params(params, step.program, rank))
        step.set_batch(batches[0].cuda())
        issued = []
        original = step.interpreter

        def counted(on_gradient=None):  # the async ops the step's interpreter issues
            interpreter = original(on_gradient)
            issued.append(interpreter)
            return interpreter
        step.interpreter = counted
        loss, grads = step.loss_and_gradients()
        grads = {p: g.float().cpu() for p, g in grads.items()}
        flights = [i.in_flight.issued for i in issued if i.in_flight is not None]
        step.interpreter = original
        losses = gpu_train(step, batches)
        waits = sum(n.kind == "wait" for f in step.program.graph.functions for n in f.nodes)
        got[overlap] = {"loss": float(loss), "grads": grads, "losses": losses,
                        "masters": {p: step.masters[p].cpu() for p in step.names},
                        "waits": waits, "issued": sum(flights)}
        del step, grads
        torch.cuda.synchronize()
    if rank == 0:
        torch.save(got, out)
    context.close()
    context.exit_now()


# ----------------------------------------- packed steps and evaluation on GPUs (NCCL)
def _gpu_model():
    from runtime.model import Model

    model = Model.from_module(GPU_LLAMA[0], settings={k: str(v) for k, v in
                                                      GPU_LLAMA[1].items()},
                              dtype=torch.float32)
    return model.init_random(0)


def _gpu_packed_run(trainer, windows, own, evaluate_now) -> dict:
    """The eval loss before any step and after each, the steps' losses, the masters."""
    evals, losses = [evaluate_now(trainer)], []
    for window in windows:
        losses.append(trainer.train_step(*own(window)))
        evals.append(evaluate_now(trainer))
    masters = trainer.state()["masters"]  # data parallel: gathered (every rank)
    return {"evals": evals, "losses": losses,
            "masters": {p: masters[p].float().cpu() for p in masters}}


def gpu_packed_reference(steps: int, rows: int, seq: int, accumulation: int, world: int,
                         eval_path: str) -> dict:
    """One GPU, packed (CUDATrainer, bf16), every rank's rows in one process's order; the
    eval loss of its weights by a one-GPU trainer of the eval batch's `rows` (the GPU
    step's graph has the batch's sizes); the initial weights under `initial`."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing

    vocab = GPU_LLAMA[1]["vocab_size"]
    model = _gpu_model()
    initial = {p: t.detach().clone() for p, t in model.params.items()}
    trainer = CUDATrainer(model, rows * world, seq, AdamW(lr=1e-3), accumulation=accumulation,
                          packing=Packing(SEP))
    judge = CUDATrainer(_gpu_model(), rows, seq, AdamW(), packing=Packing(SEP))
    data = EvalData(Path(eval_path), "uint16", seq, rows, vocab)

    def evaluate_now(trained) -> float:
        masters = trained.state()["masters"]
        judge.step.load({p: masters[p] for p in judge.names})
        return evaluate(judge, data)
    windows = packed_windows(steps, rows * world * accumulation, seq, vocab)
    got = _gpu_packed_run(trainer, windows,
                          lambda w: (one_process_rows(w, world, accumulation),), evaluate_now)
    return got | {"initial": initial}


def gpu_packed_sharded(rank: int, world: int, port: int, zero: int, steps: int, rows: int,
                       seq: int, accumulation: int, eval_path: str, out: str) -> None:
    """`world` GPUs, packed data parallel through CUDATrainer (each rank its rows and the
    step's denominators, as `modulec train` gives them), the evaluation split over the
    ranks; each rank saves its losses, eval losses and the entry-buffer elements held
    after each evaluation, rank 0 the gathered masters."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing, denominators

    context = join(rank, world, port, "cuda", 120)
    parallel, packing = context.data_parallel(zero), Packing(SEP)
    vocab = GPU_LLAMA[1]["vocab_size"]
    trainer = CUDATrainer(_gpu_model(), rows, seq, AdamW(lr=1e-3), accumulation=accumulation,
                          dist=parallel, packing=packing)
    data = EvalData(Path(eval_path), "uint16", seq, rows, vocab)
    mine, held = rows * accumulation, []

    def evaluate_now(trained) -> float:
        loss = evaluate(trained, data, parallel)
        held.append(trained.step.zero.buffer_numel())  # ZeRO-3: no entry buffer kept
        return loss
    got = _gpu_packed_run(trainer, packed_windows(steps, mine * world, seq, vocab),
                          lambda w: (w[rank * mine:(rank + 1) * mine],
                                     denominators(w, packing, rows, world)), evaluate_now)
    got["held"] = held
    if rank != 0:
        del got["masters"]
    torch.save(got, f"{out}.{rank}")
    context.close()
    context.exit_now()


def gpu_unpacked_loss(rank: int, world: int, port: int, zero: int, steps: int, rows: int,
                      seq: int, out: str) -> None:
    """`world` GPUs, unpacked data parallel through CUDATrainer (each rank its own rows of
    the same windows, as `modulec train` gives them), eager, captured and replayed; each
    rank saves the loss `train_step` reported and its own step's loss (`step.loss`, the
    mean over its rows, which the report's all_reduce leaves as it is)."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.optim import AdamW

    context = join(rank, world, port, "cuda", 120)
    trainer = CUDATrainer(_gpu_model(), rows, seq, AdamW(lr=1e-3),
                          dist=context.data_parallel(zero))
    reported, own = [], []
    for window in windows(steps, rows * world, seq, GPU_LLAMA[1]["vocab_size"]):
        reported.append(trainer.train_step(window[rank * rows:(rank + 1) * rows]))
        own.append(float(trainer.step.loss))
    torch.save({"reported": reported, "own": own}, f"{out}.{rank}")
    context.close()
    context.exit_now()


# ------------------------------------ packed tensor parallel on GPUs (NCCL)
def _gpu_tp_model(world: int, rank: int, sp: bool):
    """This rank's slices of `_gpu_model`'s weights, in the model built with --tp `world`
    (`sp`: with --sp), as `modulec train --tp --init random` gives each rank."""
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params

    model = Model.from_module(GPU_LLAMA[0], settings={k: str(v) for k, v in
                                                      GPU_LLAMA[1].items()},
                              dtype=torch.float32, tensor_parallel=world, tp_rank=rank,
                              sequence_parallel=sp)
    model.params = shard_params(_gpu_model().params, model.source.program(planned=False),
                                rank)
    return model


def _denominator_scaling(step, window, packing, accumulation: int) -> dict:
    """Micro-batch 0's loss and gradients (eager, no update) by the step's own count of
    counted targets and by a given denominator (packed data parallel's, 1.5 x the count):
    the second must be the first times count / denominator. Returns the two losses, the
    ratio and the largest relative difference of a gradient from the scaled first."""
    from runtime.train.packing import split_batch

    tokens, labels, documents = split_batch(window, packing)
    tokens, labels = tokens.cuda(), labels.cuda()
    count = int((labels[:step.batch] != packing.ignore_index).sum())
    ratio = 1 / 1.5
    step.set_batch(tokens, labels, documents)
    mean, grads = step.loss_and_gradients()
    mean, grads = float(mean), {p: g.float().cpu() for p, g in grads.items()}
    step.set_batch(tokens, labels, documents, [1.5 * count] * accumulation)
    loss, scaled = step.loss_and_gradients()
    worst = max(float((scaled[p].float().cpu() - g * ratio).norm() /
                      (g * ratio).norm().clamp(min=1e-30)) for p, g in grads.items())
    return {"mean": mean, "loss": float(loss), "ratio": ratio, "worst": worst}


def gpu_packed_tp(rank: int, world: int, port: int, sp: bool, steps: int, rows: int,
                  seq: int, accumulation: int, out: str) -> None:
    """Tensor parallel over `world` GPUs (`sp`: with sequence parallel), packed through
    CUDATrainer as `modulec train --tp --doc-sep` runs it: every rank the same rows, its
    slices of the same weights. First `_denominator_scaling` on the first window (the
    vocab-parallel loss taking packed data parallel's denominator from the step's static
    buffer), then the steps (eager, captured, replayed). Each rank saves its losses, that
    check and its masters' slices."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing

    context = join(rank, world, port, "cuda", 120)
    parallel, packing = context.data_parallel(2, tp=world, sp=sp), Packing(SEP)
    trainer = CUDATrainer(_gpu_tp_model(world, rank, sp), rows, seq, AdamW(lr=1e-3),
                          accumulation=accumulation, dist=parallel, packing=packing)
    windows = packed_windows(steps, rows * accumulation, seq, GPU_LLAMA[1]["vocab_size"])
    scaling = _denominator_scaling(trainer.step, windows[0], packing, accumulation)
    losses = [trainer.train_step(window) for window in windows]
    step = trainer.step
    torch.save({"losses": losses, "scaling": scaling, "vocab_sharded": step.vocab_sharded,
                "masters": {p: step.masters[p].float().cpu() for p in step.names}},
               f"{out}.{rank}")
    context.close()
    context.exit_now()


def gpu_packed_tp_reference(steps: int, rows: int, seq: int, accumulation: int) -> dict:
    """One GPU, packed (CUDATrainer, bf16), on the rows `gpu_packed_tp` gives every rank:
    the losses, the masters and the initial weights."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing

    model = _gpu_model()
    initial = {p: t.detach().clone() for p, t in model.params.items()}
    trainer = CUDATrainer(model, rows, seq, AdamW(lr=1e-3), accumulation=accumulation,
                          packing=Packing(SEP))
    windows = packed_windows(steps, rows * accumulation, seq, GPU_LLAMA[1]["vocab_size"])
    losses = [trainer.train_step(window) for window in windows]
    step = trainer.step
    return {"losses": losses, "initial": initial,
            "masters": {p: step.masters[p].float().cpu() for p in step.names}}
