"""`modulec train --log-every K`: one metrics record every K optimizer steps, as HF
Trainer's `logging_steps` (docs/training.md "Logs and curves").

A window's steps are added one by one (`LogWindow.add`); the window ends at a step that is
a multiple of K (global step numbers: a resumed run logs at the same steps), at the run's
last step, and at a step a checkpoint is saved after (so the records up to a checkpoint
cover its steps: a run resumed from it logs the rest). The record of a window: `loss`
and the trainer's numbers (`grad_norm`) the means of its steps', `seconds` the mean step
time, `tokens_per_s` its tokens over its seconds, and `window`, its number of steps
(left out with K = 1: one record per step, as without the option). A window cut by a
resume holds the steps this run made only. The run's other numbers (`lr`, `peak_bytes`)
are the record step's, added by the caller.
"""

from __future__ import annotations

import math

from runtime.errors import RuntimeUserError


def check_log_every(request) -> None:
    """K >= 1, and an evaluation's step ends a window (its record carries the window's
    train loss): --eval-every a multiple of K."""
    every = request.log_every
    if every < 1:
        raise RuntimeUserError(f"--log-every must be at least 1, not {every}",
                               help=["for example --log-every 10: a record every 10 "
                                     "steps, their mean loss"])
    eval_every = getattr(request, "eval_every", None)
    if eval_every is not None and eval_every >= 1 and eval_every % every:
        raise RuntimeUserError(f"--eval-every {eval_every} is not a multiple of "
                               f"--log-every {every}: an evaluation's record carries the "
                               "train loss of the window it ends",
                               help=[f"give --eval-every a multiple of {every} (e.g. "
                                     f"{every * max(1, eval_every // every)}), or a "
                                     "--log-every that divides it"])


class LogWindow:
    def __init__(self, every: int, last: int, save_every: int | None = None):
        self.every, self.last, self.save_every = every, last, save_every
        self._start()

    def _start(self) -> None:
        """An empty window."""
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.tokens = 0
        self.metrics: dict[str, list[float]] = {}

    def ends(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based, global) ends a window."""
        return step % self.every == 0 or step == self.last or bool(
            self.save_every and step % self.save_every == 0)

    def add(self, step: int, loss: float, seconds: float, tokens: int,
            metrics: dict) -> dict | None:
        """Step `step`'s numbers; at a window's end, the window's averaged fields (and
        the window starts afresh), else None."""
        self.losses.append(loss)
        self.seconds.append(seconds)
        self.tokens += tokens
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)
        if not self.ends(step):
            return None
        record = self._averaged()
        self._start()
        return record

    def _averaged(self) -> dict:
        n, seconds = len(self.losses), math.fsum(self.seconds)
        record = {"loss": _mean(self.losses)}
        record |= {key: _mean(values) for key, values in self.metrics.items()}
        record |= {"seconds": seconds / n, "tokens_per_s": self.tokens / seconds}
        if self.every > 1:
            record["window"] = n
        return record


def _mean(values: list) -> float:
    """The mean of a window's values (one value: itself, exactly)."""
    if len(values) == 1:
        return values[0]
    return math.fsum(float(v) for v in values) / len(values)
