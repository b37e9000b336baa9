"""Learning-rate schedules of `modulec train` (`--lr-schedule`, docs/training.md).

`Schedule.lr(t)` is the learning rate of optimizer step t = 1 .. steps (the step being
taken; step t of a resumed run is the same t). With peak `lr`, floor `min_lr`, `warmup`
steps W and `steps` N:

- warmup, every kind: t <= W: lr * t / W (step 1 takes lr / W, step W the peak);
- after it, p = (t - W) / (N - W) in (0, 1]:
  `constant` lr; `linear` min_lr + (lr - min_lr) (1 - p);
  `cosine` min_lr + (lr - min_lr) (1 + cos(pi p)) / 2;
- `wsd` (warmup-stable-decay): lr until the last D = `decay_steps` steps, then
  q = (t - (N - D)) / D in (0, 1] and min_lr + (lr - min_lr) shape(q), shape one of
  `linear` 1 - q, `cosine` (1 + cos(pi q)) / 2, `1-sqrt` 1 - sqrt(q).

These are transformers' schedule functions evaluated at t (its Trainer's step t takes
their value at t - 1, so its first warmup step has lr 0): `get_linear_schedule_with_warmup`
and `get_cosine_with_min_lr_schedule_with_warmup` (min_lr 0 for linear), and
`get_wsd_schedule` with `num_decay_steps` D (whose warmup starts at min_lr instead of 0).
torchtitan's WSD (`lr_decay_ratio`) takes D = round(N * ratio) as `decay_fraction` does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runtime.errors import RuntimeUserError

KINDS = ("constant", "linear", "cosine", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass(frozen=True)
class Schedule:
    lr: float
    steps: int
    kind: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    decay_steps: int = 0  # wsd: the last steps, decaying
    decay_shape: str = "linear"  # wsd

    def lr_at(self, t: int) -> float:
        """The learning rate of optimizer step t (1-based)."""
        if self.warmup and t <= self.warmup:
            return self.lr * t / self.warmup
        if self.kind == "constant" or self.steps <= self.warmup:
            return self.lr
        if self.kind == "wsd":
            start = self.steps - self.decay_steps
            if t <= start:
                return self.lr
            return self._between(_shape(self.decay_shape, (t - start) / self.decay_steps))
        p = min(1.0, (t - self.warmup) / (self.steps - self.warmup))
        return self._between(1.0 - p if self.kind == "linear" else
                             0.5 * (1.0 + math.cos(math.pi * p)))

    def _between(self, factor: float) -> float:
        return self.min_lr + (self.lr - self.min_lr) * factor

    def as_json(self) -> dict:
        return asdict(self)

    def first_difference(self, other: "Schedule", last: int) -> int | None:
        """The first step in 1 .. last where the two schedules' rates differ (None)."""
        return next((t for t in range(1, last + 1) if self.lr_at(t) != other.lr_at(t)),
                    None)


def _shape(shape: str, q: float) -> float:
    if shape == "linear":
        return 1.0 - q
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * q))
    return 1.0 - math.sqrt(q)


def schedule_of(kind: str, lr: float, steps: int, warmup: int = 0, min_lr: float = 0.0,
                decay_steps: int | None = None, decay_fraction: float | None = None,
                decay_shape: str | None = None) -> Schedule:
    """The run's schedule from its options, each checked (a RuntimeUserError names the
    option). `wsd`: D is `decay_steps`, else round(steps * decay_fraction) (default
    0.1), at least 1."""
    if kind not in KINDS:
        raise RuntimeUserError(f"--lr-schedule {kind}: not one of {', '.join(KINDS)}")
    if warmup < 0 or warmup > steps:
        raise RuntimeUserError(f"--warmup {warmup} must be between 0 and --steps {steps}")
    if not math.isfinite(min_lr) or not 0 <= min_lr <= lr:
        raise RuntimeUserError(f"--min-lr {min_lr} must be between 0 and --lr {lr}")
    if kind != "wsd" and (decay_steps is not None or decay_fraction is not None or
                          decay_shape is not None):
        raise RuntimeUserError("--decay-steps / --decay-fraction / --decay-shape are for "
                               "--lr-schedule wsd")
    decay_shape = decay_shape or "linear"
    if kind in ("constant",) and min_lr:
        raise RuntimeUserError("--min-lr is the floor of a decaying schedule; "
                               "--lr-schedule constant has none",
                               help=["use --lr-schedule linear, cosine or wsd"])
    if decay_shape not in DECAY_SHAPES:
        raise RuntimeUserError(f"--decay-shape {decay_shape}: not one of "
                               f"{', '.join(DECAY_SHAPES)}")
    decay = _decay_steps(kind, steps, warmup, decay_steps, decay_fraction)
    return Schedule(lr=lr, steps=steps, kind=kind, warmup=warmup, min_lr=min_lr,
                    decay_steps=decay, decay_shape=decay_shape)


def _decay_steps(kind: str, steps: int, warmup: int, decay_steps, fraction) -> int:
    if kind != "wsd":
        return 0
    if decay_steps is not None and fraction is not None:
        raise RuntimeUserError("give --decay-steps or --decay-fraction, not both")
    if fraction is not None and not 0 < fraction <= 1:
        raise RuntimeUserError(f"--decay-fraction {fraction} must be in (0, 1]")
    decay = decay_steps if decay_steps is not None else \
        max(1, round(steps * (0.1 if fraction is None else fraction)))
    if not 1 <= decay <= steps - warmup:
        raise RuntimeUserError(f"the WSD decay of {decay} steps does not fit after "
                               f"--warmup {warmup} in --steps {steps}",
                               help=[f"give --decay-steps between 1 and {steps - warmup}"])
    return decay


def from_json(data: dict | None, lr: float, steps: int) -> Schedule:
    """A checkpoint's saved schedule; checkpoints saved before schedules existed ran a
    constant `lr` (their `adamw.lr`)."""
    if not data:
        return Schedule(lr=lr, steps=steps)
    return Schedule(**data)
