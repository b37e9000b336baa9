"""Work run in each process of the pipeline tests (torch.multiprocessing starts them)."""

from __future__ import annotations

import torch

from tests.dist_workers import join, windows
from tests.runtime_models import TINY

# stages from @partition, cut between two calls; with dropout on both stages
MODELS = TINY | {"pipelined": ("tests/data/pipeline_llama_dropout.module", {})}


def tiny_model(name: str, settings: dict | None = None):
    from runtime.model import Model

    if name.endswith(".ir"):  # a document built with its pipeline section
        model = Model.from_ir(name, dtype=torch.float64)
        model.check_finite = False
        return model.init_random(seed=0)
    path, defaults = MODELS[name]
    merged = {k: str(v) for k, v in (defaults | (settings or {})).items()}
    model = Model.from_module(path, settings=merged, dtype=torch.float64)
    model.check_finite = False
    return model.init_random(seed=0)


def train_reference(name: str, steps: int, micro: int, rows: int, seq: int,
                    settings: dict | None = None, clip: float | None = None):
    """One process, `micro` micro-batches of `rows` accumulated (`clip`: the global
    gradient-norm clipping's largest norm): losses, state."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(tiny_model(name, settings), rows, seq,
                         AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip),
                         accumulation=micro)
    losses = [trainer.train_step(w) for w in windows(steps, rows * micro, seq)]
    return losses, trainer.state()


def train_pipelined(rank: int, world: int, port: int, runs: list, out: str,
                    cli: tuple | None = None) -> None:
    """Each of `runs` ((name, settings, steps, micro, rows, seq)) on `world` stages in one
    process group; rank r saves its losses, its stage's state, its stage's parameters
    and the whole state (state(), rank 0's joined) to `out`.r. Then `cli` ((ports,
    train_model's arguments), tests.tp_lora_workers.train_runs) in the same processes."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port)
    results = []
    for name, settings, steps, micro, rows, seq in runs:
        trainer = PipelineTrainer(tiny_model(name, settings), rows, seq,
                                  AdamW(lr=1e-2, weight_decay=0.1), context, world, micro)
        losses = [trainer.train_step(w) for w in windows(steps, rows * micro, seq)]
        results.append({"losses": losses, "state": trainer.stage_state(),
                        "params": dict(trainer.model.params), "whole": trainer.state()})
    torch.save(results, f"{out}.{rank}")
    torch.save(mixed_shard(context, world, *runs[1]), f"{out}.mixed.{rank}")
    context.close()
    if cli is not None:  # `modulec train --pp` (its entry, as under torchrun)
        from tests.tp_lora_workers import train_runs

        train_runs(rank, world, *cli, out)


def mixed_shard(context, world: int, name: str, settings: dict, steps: int, micro: int,
                rows: int, seq: int) -> dict:
    """Stages held as the GPU holds them (bf16 copies of fp32 masters, mixed=True on the
    CPU): this rank's shard after step 1 (runtime.train.shards.rank_tensors) loaded into a
    fresh trainer (load_rank_tensors) that takes step 2, and into the first trainer after
    its step 2 (whether its masters, moments and compute copies stay the same tensors, as
    a captured step needs). Returns both runs' step-2 losses and states, the first's
    state and compute copies after the load, the shard, the loaded trainer's host and
    device step counts."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer
    from runtime.train.shards import load_rank_tensors, rank_tensors

    def trainer():
        return PipelineTrainer(tiny_model(name, settings), rows, seq,
                               AdamW(lr=1e-2, weight_decay=0.1), context, world, micro,
                               mixed=True)

    first, (one, two) = trainer(), windows(2, rows * micro, seq)
    first.train_step(one)
    shard = rank_tensors(first)
    loss = first.train_step(two)
    after = trainer_state(first)
    second = trainer()
    load_rank_tensors(second, shard, 1)
    counts = (second.adamw.step, float(second.device_adamw.count))
    again = second.train_step(two)
    held = [first.adamw.exp_avg, first.adamw.exp_avg_sq, first.precision.masters,
            first.model.params]
    before = [dict(part) for part in held]
    load_rank_tensors(first, shard, 1)
    return {"losses": [loss, again], "counts": counts,
            "dtypes": {k: t.dtype for k, t in shard.items() if not k.startswith("rng.")},
            "states": [after, trainer_state(second), trainer_state(first)],
            "shard": {k: t for k, t in shard.items() if not k.startswith("rng.")},
            "copies": {p: t.detach().clone() for p, t in first.model.params.items()},
            "same_tensors": all(part[p] is was[p] for part, was in zip(held, before)
                                for p in was)}


def trainer_state(trainer) -> dict:
    return {part: {p: t.detach().clone() for p, t in values.items()}
            for part, values in trainer.stage_state().items() if part != "step"}


def train_data_parallel(rank: int, world: int, port: int, runs: list, out: str) -> None:
    """Each of `runs` ((IR document, steps, micro, rows, seq)) on world / 2 pipelines of two
    stages (DP x PP), each its rows of the same windows; then a resume: the state after
    step 1 (gathered by the first pipeline, sent to every rank) loaded into a fresh
    trainer that runs the steps after it. Rank r saves per run its losses, its stage's
    state, the whole state after the last step (rank 0's) and the resumed run's to
    `out`.r."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port)
    results = []
    for name, steps, micro, rows, seq in runs:
        replica, own = rank // 2, rows * micro

        def trainer():
            return PipelineTrainer(tiny_model(name), rows, seq,
                                   AdamW(lr=1e-2, weight_decay=0.1), context, 2, micro)

        batches = [w[replica * own:(replica + 1) * own]
                   for w in windows(steps, own * world // 2, seq)]
        first, resumed, run = train_and_resume(trainer, batches, lambda state, _: state)
        results.append(dict(run, state=first.stage_state(),
                            resumed_state=resumed.stage_state(), owned=first.owned))
    torch.save(results, f"{out}.{rank}")
    context.close()


def train_and_resume(trainer, batches: list, to_rank) -> tuple:
    """Train a fresh `trainer()` on this rank's `batches`; the whole state after the first
    step (state(), rank 0's, sent to every rank) made this rank's by `to_rank(state,
    model)` and loaded into a second trainer, which runs the steps after it; and this
    rank's shard after the first step (runtime.train.shards.rank_tensors, as a --save
    writes it) loaded into a third (load_rank_tensors, as a resume on the same layout).
    Returns the first two trainers and {losses, whole (the state after the last step),
    resumed (its losses), from_shards (the third's losses), shard_state (its stage's
    state after the last step)}."""
    import torch.distributed as dist

    from runtime.train.shards import load_rank_tensors, rank_tensors

    first, losses, saved, shard = trainer(), [], None, None
    for step, batch in enumerate(batches):
        losses.append(first.train_step(batch))
        if step == 0:
            saved = [first.state()]
            dist.broadcast_object_list(saved, src=0)
            shard = rank_tensors(first)
    whole = first.state()
    resumed = trainer()
    resumed.load_state(to_rank(saved[0], resumed.model))
    again = [resumed.train_step(batch) for batch in batches[1:]]
    third = trainer()
    load_rank_tensors(third, shard, 1)
    from_shards = [third.train_step(batch) for batch in batches[1:]]
    return first, resumed, {"losses": losses, "whole": whole, "resumed": again,
                            "from_shards": from_shards, "shard_state": third.stage_state()}


def train_tp_pipelined(rank: int, world: int, port: int, runs: list, out: str,
                       extra: dict | None = None) -> None:
    """Each of `runs` ((sp, clip, steps, micro, rows, seq[, zero])) on the tiny Llama, two stages
    of --tp 2 (TP x PP, 4 ranks; 8: two pipelines), this rank's slices of the reference's
    random weights; then the whole state after step 1 (state(): the slices and stages
    joined on rank 0, sent to every rank, cut into each rank's slices) loaded into a fresh
    trainer that runs the steps after it. Rank r saves per run its losses, the whole state
    after the last step and the resumed run's losses to `out`.r."""
    from runtime.train.data_parallel import rank_state
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer
    from tests.tp_workers import tiny_model as tp_model

    context = join(rank, world, port)
    results = []
    for sp, clip, steps, micro, rows, seq, *zero in runs:
        replica, own = rank // 4, rows * micro

        def trainer():
            model = tp_model("llama", 2, rank % 2, sequence_parallel=sp)
            model.check_finite = False
            return PipelineTrainer(model, rows, seq,
                                   AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip),
                                   context, 2, micro, zero=zero[0] if zero else None)

        batches = [w[replica * own:(replica + 1) * own]
                   for w in windows(steps, own * world // 4, seq)]
        first, _, run = train_and_resume(
            trainer, batches, lambda state, model: rank_state(state, model, rank % 2))
        results.append(dict(run, state=first.stage_state()))
    torch.save(results, f"{out}.{rank}")
    if extra is not None:  # more work for the same four processes (their start is slow)
        from tests.tp_workers import clipped_runs

        torch.save(steps_from_ir(context, rank, extra["document"], extra["clip"]),
                   f"{out}.ir.{rank}")
        torch.save(clipped_runs(context, rank, world, extra["dp_tp"]), f"{out}.dptp.{rank}")
        if "packed_eval" in extra:  # tests/test_pipeline_packed_eval.py
            torch.save(packed_and_evaluated(context, rank, world, *extra["packed_eval"]),
                       f"{out}.pe.{rank}")
        if "lora" in extra:  # PP 2 x TP 2 with LoRA (tests/test_pipeline_tp.py)
            torch.save(lora_tp_pipelined(context, rank, *extra["lora"]),
                       f"{out}.lora.{rank}")
    context.close()


def steps_from_ir(context, rank: int, document: str, clip: float) -> list[dict]:
    """PP 2 x TP 2 (4 ranks): one step of the tiny Llama (float64, clipping at `clip`)
    from the module built with --pp 2 --tp 2, then one from `document` (`modulec build
    --pp 2 --tp 2 -o`), each rank's slices of the same random weights: both losses, norms
    and states (rank 0's: the whole, joined)."""
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer
    from tests.tp_workers import tiny_model as tp_model

    whole = tp_model("llama").params
    results = []
    for source in ("module", document):
        if source == "module":
            model = tp_model("llama", 2, rank % 2)
        else:
            model = Model.from_ir(document, dtype=torch.float64, tp_rank=rank % 2)
            model.params = shard_params(dict(whole), model.source.program(planned=False),
                                        rank % 2)
        model.check_finite = False
        trainer = PipelineTrainer(model, 1, 8, AdamW(lr=1e-2, weight_decay=0.1,
                                                     clip_grad=clip), context, 2, 2)
        loss = trainer.train_step(windows(1, 2, 8)[0])
        results.append({"loss": loss, "state": trainer.state(),
                        "norm": trainer.step_metrics()["grad_norm"]})
    return results



def packed_and_evaluated(context, rank: int, world: int, runs: list,
                         eval_path: str) -> list[dict]:
    """Each of `runs` ((name, tp, packed, steps, micro, rows, seq)) on the `world` gloo
    ranks of `context`: two stages of `tp` ranks each (world / (2 x tp) data-parallel
    pipelines; "llama" with tp 2: this rank's slices of the reference weights), float64;
    packed (--doc-sep dist_workers.SEP) or not, each pipeline its rows of the same windows
    (packed, with the denominators `modulec train` gives), the evaluation
    (runtime.train.evaluate.evaluate, as the run's Observer calls it) after each step.
    Per run: this rank's losses, its eval losses, the forward frames its stage holds after
    each evaluation and the whole state after the last step."""
    from pathlib import Path

    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing, denominators
    from runtime.train.pipeline import PipelineTrainer
    from tests.dist_workers import SEP, packed_windows
    from tests.tp_workers import tiny_model as tp_model

    results = []
    for name, tp, packed, steps, micro, rows, seq in runs:
        model = tp_model(name, 2, rank % 2) if tp > 1 else tiny_model(name)
        model.check_finite = False
        packing = Packing(SEP) if packed else None
        trainer = PipelineTrainer(model, rows, seq, AdamW(lr=1e-2, weight_decay=0.1),
                                  context, 2, micro, packing=packing)
        data = EvalData(Path(eval_path), "uint16", seq, rows, 64)
        dp, own = world // (2 * tp), rows * micro
        replica = rank // (2 * tp)
        losses, evals, kept = [], [], []
        for window in (packed_windows if packed else windows)(steps, own * dp, seq):
            shared = {"denominators": denominators(window, packing, rows, dp)} \
                if packed and dp > 1 else {}
            losses.append(trainer.train_step(window[replica * own:(replica + 1) * own],
                                             **shared))
            evals.append(evaluate(trainer, data))
            kept.append(len(trainer.runner.frames))  # forward frames held after it
        results.append({"losses": losses, "evals": evals, "kept": kept,
                        "whole": trainer.state()})
    return results


def lora_tp_pipelined(context, rank: int, document: str, whole: dict, steps: int,
                      micro: int, rows: int, seq: int) -> dict:
    """PP 2 x TP 2 (4 ranks) with LoRA: `document` (`modulec build --pp 2 --tp 2 --lora`)
    with this rank's slices of `whole` (tests/tp_lora_workers.whole_params: random base
    and adapters, B != 0), float64: the losses, the whole state after the last step
    (state(): slices and stages joined, rank 0's) and the rank's parameters."""
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    model = Model.from_ir(document, dtype=torch.float64, tp_rank=rank % 2)
    mine = shard_params(dict(whole), model.source.program(planned=False), rank % 2)
    model.params = {p: t.clone() for p, t in mine.items()}  # trained in place
    model.check_finite = False
    trainer = PipelineTrainer(model, rows, seq, AdamW(lr=1e-2, weight_decay=0.1), context,
                              2, micro)
    losses = [trainer.train_step(w) for w in windows(steps, rows * micro, seq)]
    return {"losses": losses, "whole": trainer.state(), "params": dict(model.params)}
