"""Work for tests/test_pipeline_precision.py: a pipeline whose stages hold their weights as
the GPU does (bf16 compute copies of fp32 masters, the GPU step's kernel registry, fp32
gradient sums: runtime/train/pipeline_precision.py), on gloo processes, and one process
doing the same arithmetic."""

from __future__ import annotations

import torch

from tests.dist_workers import join, windows
from tests.pipeline_workers import tiny_model

LR, DECAY = 1e-2, 0.1


def mixed_pipelined(rank: int, world: int, port: int, runs: list, steps: int, micro: int,
                    rows: int, seq: int, out: str) -> None:
    """Each (name, clip) of `runs` in one gloo group of `world` ranks (one spawn for the
    models of tests/test_pipeline_precision.py): run i's stages save to `out`.i.r."""
    context = join(rank, world, port)
    for index, (name, clip) in enumerate(runs):
        _mixed_run(context, rank, world, name, steps, micro, rows, seq, clip,
                   f"{out}.{index}")
    context.close()


def _mixed_run(context, rank: int, world: int, name: str, steps: int, micro: int,
               rows: int, seq: int, clip: float | None, out: str) -> None:
    """`steps` steps of `name` on `world` mixed-precision stages; rank r saves its losses,
    its stage's state (fp32 masters) and its compute copies to `out`.r."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    trainer = PipelineTrainer(tiny_model(name), rows, seq,
                              AdamW(lr=LR, weight_decay=DECAY, clip_grad=clip), context,
                              world, micro, mixed=True)
    losses, frames, first = [], [], None
    for window in windows(steps, rows * micro, seq):
        losses.append(trainer.train_step(window))
        frames.append(live_frames())
        first = first or trainer.state()  # step 1's, loaded again below
    state = trainer.stage_state()
    copies = dict(trainer.model.params)
    torch.save({"losses": losses, "frames": frames, "state": state, "copies": copies,
                "held": held_bytes(trainer), "planned": planned_bytes(trainer),
                "whole": trainer.state()}, f"{out}.{rank}")
    torch.save(reloaded(trainer, first), f"{out}.{rank}.reloaded")


def reloaded(trainer, state: dict) -> dict:
    """`state` loaded into a trainer that has stepped: whether every moment and master
    is still the tensor it held (a captured step updates those), and what they hold."""
    held = [trainer.adamw.exp_avg, trainer.adamw.exp_avg_sq, trainer.precision.masters]
    before = [dict(part) for part in held]
    trainer.load_state(state)
    return {"same_tensors": all(part[p] is was[p] for part, was in zip(held, before)
                                for p in was),
            "state": {name: {p: t.detach().cpu().clone() for p, t in part.items()}
                      for name, part in zip(("exp_avg", "exp_avg_sq", "masters"), held)},
            "step": trainer.adamw.step, "device_step": float(trainer.device_adamw.count),
            "loaded": state}


def held_bytes(trainer) -> dict[str, int]:
    """What the stage holds between steps, by modulec.plan.pipeline_memory's parts: its
    trained parameters' compute copies, their masters and AdamW's moments."""
    trained = {p for p in trainer.names if p not in trainer.frozen}
    copies = {id(t): t for p, t in trainer.model.params.items() if p in trained}
    return {"weights": sum(t.nbytes for t in copies.values()),
            "masters": sum(t.nbytes for t in trainer.precision.masters.values()),
            "optimizer_state": sum(t.nbytes for part in (trainer.adamw.exp_avg,
                                                          trainer.adamw.exp_avg_sq)
                                   for t in part.values())}


def planned_bytes(trainer) -> dict[str, int]:
    """`modulec plan`'s prediction of the same parts for this rank's stage."""
    from modulec.plan.pipeline_memory import stage_memory

    rows = stage_memory(trainer.program.graph, trainer.program.document["schedule"], 0)
    parts = rows[trainer.stage]["fixed_parts"]
    return {k: parts[k] for k in ("weights", "masters", "optimizer_state")}


def live_frames() -> int:
    """The interpreter frames alive now (a step's must all be gone after it)."""
    import gc

    from runtime.interpreter import Frame

    gc.collect()
    return sum(isinstance(o, Frame) for o in gc.get_objects())


def mixed_reference(name: str, steps: int, micro: int, rows: int, seq: int,
                    clip: float | None) -> tuple[list[float], dict]:
    """One process, the same arithmetic: each micro-batch forward and backward through
    the GPU registry's kernels on bf16 copies, gradients summed in fp32 in micro-batch
    order (a tied path's added to its owner's), divided by their count, AdamW on the fp32
    masters (its rate and step count device scalars, as the GPU's); an auxiliary loss (MoE) joins the loss as the trainers add it. Returns the losses and the
    masters."""
    from runtime.inputs import fed_inputs, sized_inputs
    from runtime.dist.tp_norm import squares
    from runtime.interpreter import Interpreter
    from runtime.train.backends import owned_paths, tied_sums
    from runtime.train.optim import AdamW
    from runtime.train.param_groups import clip_coefficient, hyperparameters, lr_scale
    from runtime.train.packing import split_batch
    from runtime.train.pipeline import _loss
    from runtime.train.pipeline_precision import DeviceAdamW, StagePrecision

    model = tiny_model(name)
    names = model.source.program(planned=False).input_names()
    program = model.source.program_for(sized_inputs(names, rows, seq))
    params = dict(model.params)
    precision = StagePrecision.of("cpu", torch.float64, mixed=True)
    owned = owned_paths(model)
    precision.hold(params, owned)
    run = Interpreter(program.graph, params, precision.compute, check_finite=False,
                      kernels=precision.kernels(), keep_only_saved=True)
    adamw = AdamW(lr=LR, weight_decay=DECAY, clip_grad=clip)
    device_adamw = DeviceAdamW(adamw, "cpu")
    losses = []
    for window in windows(steps, rows * micro, seq):
        total, step_losses = {}, []
        for part in window.split(rows):
            tokens, labels, _ = split_batch(part, None)
            fed = fed_inputs(names, tokens)
            outputs, frame = run.forward([fed[n] for n in names])
            loss, seeds = _loss(outputs, labels)
            step_losses.append(loss)
            _, grads = run.backward(frame, seeds)
            grads = {p: g.to(torch.float32) for p, g in grads.items()}
            for path, grad in tied_sums(params, grads, owned).items():
                total[path] = total[path] + grad if path in total else grad
        total = {p: g / micro for p, g in total.items()}
        settings = {p: hyperparameters(program, p, adamw) for p in total}
        norm = squares(total.values(), torch.float64, "cpu").reshape(()).sqrt()
        scale = None if clip is None else clip_coefficient(norm, clip)
        device_adamw.update(precision.weights(params), total,
                            lambda p: (lr_scale(program, p), settings[p][1]), scale)
        precision.refresh(params, total)
        losses.append(sum(float(loss) for loss in step_losses) / micro)
    return losses, dict(precision.masters)


def graph_and_eager(rank: int, world: int, port: int, out: str) -> None:
    """On `world` GPUs (NCCL): the tiny Llama trained 5 steps (a falling learning rate,
    clipping) by a pipeline whose steps 3+ replay one captured CUDA graph, then by one
    that runs every step eagerly; rank r saves both runs' losses, masters, host step
    counts and whether a graph was captured to `out`.r."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port, "cuda")
    results = {}
    for graph in (True, False):
        trainer = PipelineTrainer(tiny_model("llama"), 2, 16,
                                  AdamW(lr=LR, weight_decay=DECAY, clip_grad=0.5), context,
                                  world, 4, device="cuda", graph=graph)
        losses = []
        for step, window in enumerate(windows(5, 8, 16)):
            trainer.set_lr(LR * (1 - 0.15 * step))  # a replay must read each step's rate
            losses.append(trainer.train_step(window))
        masters = trainer.stage_state()["masters"]
        results[graph] = {
            "losses": losses, "step": trainer.adamw.step,
            "masters": {p: t.detach().cpu() for p, t in masters.items()},
            "captured": trainer.graph is not None and trainer.graph.graph is not None,
            "eager_because": trainer.eager_because}
    torch.save(results, f"{out}.{rank}")
    context.close()


def graph_eval_reload(rank: int, world: int, port: int, out: str) -> None:
    """On `world` GPUs (NCCL): the tiny Llama's captured pipeline (as graph_and_eager's)
    trained 5 steps twice, the second evaluating after every step (eager forwards between
    replays); then the second loads its state after step 3 and takes steps 4 and 5 again
    (replays: the state copied into the tensors the graph updates). Rank r saves both
    runs' losses, the eval losses, the repeated steps' losses, masters and moments."""
    from types import SimpleNamespace

    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port, "cuda")
    steps, held_out = windows(5, 8, 16), windows(2, 2, 16)
    data = SimpleNamespace(batches=len(held_out), batch_at=held_out.__getitem__)
    results = {}
    for evaluating in (False, True):
        trainer = PipelineTrainer(tiny_model("llama"), 2, 16,
                                  AdamW(lr=LR, weight_decay=DECAY, clip_grad=0.5), context,
                                  world, 4, device="cuda")
        run, kept = {"losses": [], "evals": []}, None
        for step, window in enumerate(steps):
            trainer.set_lr(LR * (1 - 0.15 * step))
            run["losses"].append(trainer.train_step(window))
            if evaluating:
                run["evals"].append(trainer.evaluate(data))
            if step == 2:  # a replay's state (step 3 is the first captured one)
                kept = trainer.state()
        run |= {"captured": trainer.graph is not None and trainer.graph.graph is not None,
                "masters": _on_host(trainer.stage_state()["masters"])}
        if evaluating:
            trainer.load_state(kept)
            run["loaded"] = _on_host(trainer.adamw.exp_avg)
            run["again"] = []
            for step in (3, 4):
                trainer.set_lr(LR * (1 - 0.15 * step))
                run["again"].append(trainer.train_step(steps[step]))
            run |= {"again_masters": _on_host(trainer.stage_state()["masters"]),
                    "moments": _on_host(trainer.adamw.exp_avg), "step": trainer.adamw.step}
        results[evaluating] = run
    torch.save(results, f"{out}.{rank}")
    context.close()


def _on_host(tensors: dict) -> dict:
    return {p: t.detach().cpu().clone() for p, t in tensors.items()}


def mixed_zero1(rank: int, world: int, port: int, out: str) -> None:
    """Two data-parallel pipelines of two mixed stages on four gloo processes, trained
    two steps at ZeRO-0 and at the pipelines' ZeRO-1 (each bucket's moments on one replica,
    its fp32 masters broadcast from there); rank r saves both runs' losses, masters and
    compute copies to `out`.r."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port)
    rows, micro, seq = 1, 2, 8
    replica, own = rank // 2, rows * micro
    batches = [w[replica * own:(replica + 1) * own]
               for w in windows(2, own * world // 2, seq)]
    results = {}
    for zero in (0, 1):
        trainer = PipelineTrainer(tiny_model("llama"), rows, seq,
                                  AdamW(lr=LR, weight_decay=DECAY), context, 2, micro,
                                  zero=zero, mixed=True)
        losses = [trainer.train_step(batch) for batch in batches]
        results[zero] = {"losses": losses, "owned": trainer.owned,
                         "masters": dict(trainer.precision.masters),
                         "copies": dict(trainer.model.params)}
    torch.save(results, f"{out}.{rank}")
    context.close()
