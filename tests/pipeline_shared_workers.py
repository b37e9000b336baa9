"""Work run in each process of tests/test_pipeline_shared.py (torch.multiprocessing starts
them): pipelines whose stages share a parameter (a tied LM head)."""

from __future__ import annotations

import torch

from tests.dist_workers import join, windows
from tests.pipeline_workers import tiny_model


def tied_model(name: str):
    """tests.pipeline_workers.tiny_model's float64 model, a tied parameter (`tied_to`)
    sharing its target's tensor as a loaded or `--init random` model's does
    (Model.init_random draws each path its own)."""
    from runtime.hf_weights.schema import tied_targets

    model = tiny_model(name)
    ties = tied_targets(model.source.program(planned=False).weight_schema)
    model.params.update({p: model.params[t] for p, t in ties.items()})
    return model


def train_shared(rank: int, world: int, port: int, runs: list, out: str,
                 cli: tuple | None = None, device: str = "cpu") -> None:
    """Each of `runs` ((name, clip, steps, micro, rows, seq)) on `world` stages, float64
    (on `device`: gloo on the CPU, NCCL on "cuda"): rank r saves per run
    its losses, gradient norms, its stage's parameters (every path it holds, on the
    CPU), the whole state after the first step and after the last (state(), rank 0's
    joined) to `out`.r. Then `cli` ((ports, train_model's arguments),
    tests.tp_lora_workers.train_runs) in the same processes."""
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port, device)
    results = []
    for name, clip, steps, micro, rows, seq in runs:
        trainer = PipelineTrainer(tied_model(name), rows, seq,
                                  AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip), context,
                                  world, micro, device=device, **_reference_arithmetic())
        losses, norms, first = [], [], None
        for window in windows(steps, rows * micro, seq):
            losses.append(trainer.train_step(window))
            norms.append(trainer.step_metrics()["grad_norm"])
            first = first or trainer.state()
        results.append({"losses": losses, "norms": norms, "first": first,
                        "params": on_cpu(trainer.model.params),
                        "names": list(trainer.names), "whole": trainer.state()})
    torch.save(results, f"{out}.{rank}")
    context.close()
    if cli is not None:  # `modulec train --pp` (its entry, as under torchrun)
        from tests.tp_lora_workers import train_runs

        train_runs(rank, world, *cli, out)


def on_cpu(params: dict) -> dict:
    """The parameters on the CPU, a tensor two paths share still shared."""
    moved: dict = {}
    return {p: moved.setdefault(id(t), t.detach().cpu()) for p, t in params.items()}


def _reference_arithmetic() -> dict:
    """The trainer's options that keep the model's dtype on every device (float64 on
    NCCL too, not the GPU's bf16 stages: runtime/train/pipeline_precision.py)."""
    return {"mixed": False}
