"""Work run in each process of the evaluation tests under tensor parallel
(tests/test_tp_eval.py, tests/test_cuda_tp_eval.py; torch.multiprocessing starts them:
the functions must be importable)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tp_workers import windows

STATE_PARTS = ("masters", "exp_avg", "exp_avg_sq")


def rank_model(whole: dict, rank: int):
    """The tiny Llama (float64, untied) built with --tp 2: rank `rank`'s slices of
    `whole` (the one-process model's parameters, given by the test: the whole model is
    not built again in each process), copies of its own."""
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params
    from tests.runtime_models import TINY

    path, settings = TINY["llama"]
    model = Model.from_module(path, settings={k: str(v) for k, v in settings.items()},
                              dtype=torch.float64, tensor_parallel=2, tp_rank=rank)
    sliced = shard_params(whole, model.source.program(planned=False), rank)
    model.params = {p: t.clone() for p, t in sliced.items()}  # trained in place
    model.check_finite = False
    return model


def eval_rank(rank: int, world: int, port: int, whole: dict, zero: int | None, steps: int,
              rows: int, seq: int, eval_path: str, batches: int, out: str,
              again: bool = True) -> None:
    """TP 2 over `world` gloo ranks (4: DP 2 x TP 2, ZeRO stage `zero` across the
    slices; 2: the CPU trainer on one TP pair), the tiny Llama in float64 (its slices of
    `whole`), each data-parallel rank its rows of the same windows, as `modulec train
    --tp 2` runs: the run evaluated before the first step and after each (`batches` eval batches of its
    rows, split over the data-parallel ranks) and, with `again`, the same run without
    evaluation. Rank r saves to `out`.r by evaluated or not: the losses, the eval losses,
    the entry-buffer elements held after each evaluation (ZeRO-3) and the whole state
    (the slices joined)."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.data_parallel import CPUDataParallelTrainer, whole_state
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from tests.dist_workers import join

    context = join(rank, world, port)
    parallel = context.data_parallel(zero or 0, tp=2)
    own = rows // parallel.dp
    data = EvalData(Path(eval_path), "uint16", seq, own, 64, batches)
    got = {}
    for evaluating in (True, False) if again else (True,):
        model = rank_model(whole, rank % 2)
        adamw = AdamW(lr=1e-2, weight_decay=0.1)
        if parallel.dp == 1:  # as runtime.train.run.Run._trainer: the TP pair's group
            parallel.use_tensor_parallel_group()
            trainer = CPUTrainer(model, own, seq, adamw)
        else:
            trainer = CPUDataParallelTrainer(model, own, seq, adamw, parallel)
        got[evaluating] = _run(trainer, data, parallel, steps, rows, seq, evaluating)
        joined = whole_state(trainer.state(), model, parallel)
        got[evaluating]["whole"] = {k: dict(joined[k]) for k in STATE_PARTS}
        if evaluating and parallel.dp == 1:
            got["gpu_pass"] = _forward_only_pass(trainer, data.batch_at(0), own, seq)
    torch.save(got, f"{out}.{rank}")
    context.close()


def _run(trainer, data, parallel, steps: int, rows: int, seq: int,
         evaluating: bool) -> dict:
    """The steps on this data-parallel rank's rows, evaluated before the first and after
    each when `evaluating`: the losses, the eval losses, the ZeRO-3 entry-buffer
    elements held after each evaluation."""
    from runtime.train.evaluate import evaluate

    zero = getattr(trainer, "zero", None)
    losses, evals, held = [], [], []

    def evaluated() -> None:
        if evaluating:
            evals.append(evaluate(trainer, data, parallel))
            held.append(zero.buffer_numel() if zero is not None else 0)
    evaluated()
    own = rows // parallel.dp
    part = parallel.dp_rank * own
    for window in windows(steps, rows, seq):
        losses.append(trainer.train_step(window[part:part + own]))
        evaluated()
    return {"losses": losses, "evals": evals, "held": held}


def _forward_only_pass(trainer, window, rows: int, seq: int) -> tuple[float, float]:
    """runtime/cuda/evaluate.py's pass over a TP rank's slices (the step's kernels on
    the CPU, no fused head split off: the vocab-parallel loss `logits_loss` gives the
    TrainStep), the group's collectives in its forward: (its loss, cpu_loss's)."""
    from types import SimpleNamespace

    from runtime.cuda.evaluate import eval_loss
    from runtime.cuda.train_kernels import train_kernels
    from runtime.tensor_parallel import logits_loss, vocab_outputs
    from runtime.train.data_parallel import program_of
    from runtime.train.evaluate import cpu_loss
    from runtime.train.packing import split_batch

    program = program_of(trainer.model, rows, seq)
    assert trainer.output in vocab_outputs(program)  # the step would not split the head
    step = SimpleNamespace(graph=program.graph, compute=trainer.model.params,
                           dtype=torch.float64, kernels=train_kernels("cpu", ("flash",)),
                           input_names=program.input_names(), split=None,
                           logits_loss=logits_loss(program, trainer.output),
                           chunk_rows=2048, ignore_index=-100, zero=None)
    tokens, labels, _ = split_batch(window, None)
    return float(eval_loss(step, tokens, labels)), cpu_loss(trainer, window)


# ---------------------------------------------------------------------- on GPUs (NCCL)
def gpu_eval_rank(rank: int, world: int, port: int, sp: bool, steps: int, rows: int,
                  seq: int, eval_path: str, out: str) -> None:
    """TP over `world` GPUs (`sp`: with sequence parallel) through CUDATrainer, as
    `modulec train --tp --eval-data` runs it: every rank the same rows and eval batches,
    its slices of the same weights (tests/dist_workers.py `_gpu_tp_model`). The run
    evaluated before the first step and after each (eager, captured, replayed: each
    evaluation between two graph replays), then the same run without evaluation. Rank r
    saves to `out`.r by evaluated or not: the losses, the eval losses and its masters'
    slices."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from tests.dist_workers import GPU_LLAMA, _gpu_tp_model, join

    context = join(rank, world, port, "cuda", 120)
    parallel = context.data_parallel(2, tp=world, sp=sp)
    vocab = GPU_LLAMA[1]["vocab_size"]
    data = EvalData(Path(eval_path), "uint16", seq, rows, vocab)
    got = {}
    for evaluating in (True, False):
        trainer = CUDATrainer(_gpu_tp_model(world, rank, sp), rows, seq, AdamW(lr=1e-3),
                              dist=parallel)
        evals = [evaluate(trainer, data, parallel)] if evaluating else []
        losses = []
        for window in windows(steps, rows, seq, vocab):
            losses.append(trainer.train_step(window))
            if evaluating:
                evals.append(evaluate(trainer, data, parallel))
        step = trainer.step
        got[evaluating] = {"losses": losses, "evals": evals,
                           "vocab_sharded": step.vocab_sharded,
                           "captured": step.cuda_graph is not None,
                           "masters": {p: step.masters[p].float().cpu() for p in step.names}}
        del trainer, step
        torch.cuda.synchronize()
    torch.save(got, f"{out}.{rank}")
    context.close()
    context.exit_now()


def gpu_eval_reference(steps: int, rows: int, seq: int, eval_path: str) -> dict:
    """One GPU (CUDATrainer, bf16) on the whole model and the same rows: the eval loss
    before the first step and after each, and the steps' losses."""
    from runtime.train.backends import CUDATrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from tests.dist_workers import GPU_LLAMA, _gpu_model

    vocab = GPU_LLAMA[1]["vocab_size"]
    trainer = CUDATrainer(_gpu_model(), rows, seq, AdamW(lr=1e-3))
    data = EvalData(Path(eval_path), "uint16", seq, rows, vocab)
    evals, losses = [evaluate(trainer, data)], []
    for window in windows(steps, rows, seq, vocab):
        losses.append(trainer.train_step(window))
        evals.append(evaluate(trainer, data))
    return {"evals": evals, "losses": losses}
