"""The optimizer options of `modulec train` (docs/training.md, "Optimizer"): AdamW's
settings, the learning-rate schedule and global gradient-norm clipping, checked, turned
into the run's `AdamW` and `Schedule`, written into each checkpoint, and compared on
resume so that a resumed run continues the same learning-rate curve."""

from __future__ import annotations

import math

from runtime.errors import RuntimeUserError
from runtime.train.optim import AdamW
from runtime.train.schedule import Schedule, from_json, schedule_of


def check_optimizer_options(request) -> None:
    """Each option in its range, named in the error (checked before the model loads)."""
    for flag, value in (("--beta1", request.beta1), ("--beta2", request.beta2)):
        if not (math.isfinite(value) and 0 <= value < 1):
            raise RuntimeUserError(f"{flag} is {value}: it must be in [0, 1)",
                                   help=["AdamW's defaults here: --beta1 0.9 --beta2 0.95"])
    if not (math.isfinite(request.eps) and request.eps > 0):
        raise RuntimeUserError(f"--eps is {request.eps}: it must be a finite number > 0",
                               help=["for example --eps 1e-8"])
    clip = request.clip_grad
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise RuntimeUserError(f"--clip-grad is {clip}: it must be a finite number > 0",
                               help=["for example --clip-grad 1.0"])
    schedule_for(request)  # its own checks


def schedule_for(request) -> Schedule:
    return schedule_of(request.lr_schedule, request.lr, request.steps, request.warmup,
                       request.min_lr, request.decay_steps, request.decay_fraction,
                       request.decay_shape)


def adamw_of(request) -> AdamW:
    return AdamW(lr=request.lr, betas=(request.beta1, request.beta2), eps=request.eps,
                 weight_decay=request.weight_decay, decay_all=request.decay_all,
                 clip_grad=request.clip_grad)


def saved_optimizer(request, schedule: Schedule) -> dict:
    """What a checkpoint's trainer_state.json records of the optimizer."""
    return {"adamw": {"lr": request.lr, "weight_decay": request.weight_decay,
                      "betas": [request.beta1, request.beta2], "eps": request.eps,
                      "decay_all": request.decay_all, "clip_grad": request.clip_grad},
            "schedule": schedule.as_json()}


def check_resume_schedule(trainer: dict, schedule: Schedule, folder) -> None:
    """A resume continues the saved run's learning-rate curve: the steps already taken
    (1 .. its step) must have the rates this run's schedule gives them, else the curve
    would jump (a cosine over another --steps, another --warmup). Two constant schedules
    with the same warmup may differ in --lr (a new rate for what is left, as before
    schedules existed). A WSD run still in its stable phase may be extended (--steps
    larger): its past is the same."""
    step = int(trainer["step"])
    saved = from_json(trainer.get("schedule"), trainer.get("adamw", {}).get("lr", schedule.lr),
                      step)
    if saved.kind == schedule.kind == "constant" and saved.warmup == schedule.warmup:
        return
    differs = saved.first_difference(schedule, step)
    if differs is None:
        return
    raise RuntimeUserError(
        f"{folder} was trained with the learning-rate schedule {_describe(saved)}; this "
        f"run's ({_describe(schedule)}) gives step {differs} another rate "
        f"({schedule.lr_at(differs):.6g}, not {saved.lr_at(differs):.6g})",
        help=["resume with the schedule options (--lr, --lr-schedule, --warmup, --min-lr, "
              "--decay-steps, and --steps for a decaying schedule) of the run that saved it"])


def _describe(s: Schedule) -> str:
    text = f"{s.kind}, --lr {s.lr:g}, --warmup {s.warmup}, --steps {s.steps}"
    if s.kind != "constant":
        text += f", --min-lr {s.min_lr:g}"
    if s.kind == "wsd":
        text += f", --decay-steps {s.decay_steps} {s.decay_shape}"
    return text
