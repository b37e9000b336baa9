"""Work run in each process of tests/test_pipeline_aux.py (torch.multiprocessing starts
them): MoE models with an auxiliary load-balancing loss trained on two pipeline stages,
and their one-process references (float64)."""

from __future__ import annotations

import torch

from tests.dist_workers import join, windows
from tests.runtime_models import DENSE, GPU_ONLY

ON = {"output_router_logits": "true", "aux_loss_coef": 0.5}  # the loss on, weighed high
MOE = {
    # std Mixtral: the balanced split cuts its stack of two layers, so the router
    # statistics cross as the stack's carried tensor
    "mixtral": ("std/models/mixtral.module", DENSE | {"num_experts": 4, "top_k": 2} | ON),
    # std Qwen3-MoE: a nested stack (a dense and a sparse layer per block)
    "qwen3_moe": GPU_ONLY["qwen3_moe"],
    # `@partition`: the loss made on stage 0, carried to the last stage as an output
    "aux_early": ("tests/data/pipeline_mixtral_aux.module", {}),
}


def moe_model(name: str, settings: dict | None = None):
    from runtime.model import Model

    path, defaults = MOE[name]
    merged = {k: str(v) for k, v in (defaults | (settings or {})).items()}
    model = Model.from_module(path, settings=merged, dtype=torch.float64)
    model.check_finite = False
    return model.init_random(seed=0)


def reference(name: str, steps: int, micro: int, rows: int, seq: int, eval_path: str,
              settings: dict | None = None) -> dict:
    """One process with --grad-accum `micro`: the step losses, the eval loss after the
    last step and the state."""
    from pathlib import Path

    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(moe_model(name, settings), rows, seq,
                         AdamW(lr=1e-2, weight_decay=0.1), accumulation=micro)
    losses = [trainer.train_step(w) for w in windows(steps, rows * micro, seq)]
    data = EvalData(Path(eval_path), "uint16", seq, rows, 64)
    return {"losses": losses, "eval": evaluate(trainer, data), "state": trainer.state()}


def train_pipelined(rank: int, world: int, port: int, runs: list, eval_path: str,
                    out: str, device: str = "cpu") -> None:
    """Each of `runs` ((name, steps, micro, rows, seq)) on `world` stages (gloo on the
    CPU, NCCL on "cuda": GPU `rank`): rank r saves per run the step losses it reports,
    the eval loss after the last step and its stage's state (on the CPU) to `out`.r."""
    from pathlib import Path

    from runtime.train.evaluate import EvalData, evaluate
    from runtime.train.optim import AdamW
    from runtime.train.pipeline import PipelineTrainer

    context = join(rank, world, port, device)
    results = []
    for name, steps, micro, rows, seq in runs:
        trainer = PipelineTrainer(moe_model(name), rows, seq,
                                  AdamW(lr=1e-2, weight_decay=0.1), context, world, micro,
                                  device=device, mixed=False)  # float64 on NCCL too
        losses = [trainer.train_step(w) for w in windows(steps, rows * micro, seq)]
        data = EvalData(Path(eval_path), "uint16", seq, rows, 64)
        state = {part: {p: t.detach().cpu() for p, t in values.items()}
                 for part, values in trainer.stage_state().items() if part != "step"}
        results.append({"losses": losses, "eval": evaluate(trainer, data), "state": state})
    torch.save(results, f"{out}.{rank}")
    context.close()
