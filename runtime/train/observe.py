"""What a training run reports beside its progress: the evaluation loss when it is due
(runtime/train/evaluate.py) and the metrics log (runtime/train/metrics.py). `Run` makes
one `Observer` per run and passes it each record (one per step, or per --log-every
window: runtime/train/log_window.py; the record holds the trainer's own numbers, e.g.
`grad_norm`, already); the observer adds `lr`, `time` and, when evaluated, `eval_loss`,
and writes the record to the log. An evaluation's step ends a window (--eval-every is a
multiple of --log-every), so its record carries the window's train loss beside it."""

from __future__ import annotations

import time

from runtime.train.evaluate import EvalData, due, evaluate


class Observer:
    def __init__(self, request, trainer, token_dtype: str, vocab_size: int | None,
                 start: int, lr_at=None, main: bool = True, parallel=None):
        """`parallel`: the run's runtime.dist.DataParallelRun (None: one process), over
        whose ranks the evaluation's batches are split."""
        from runtime.train.metrics import MetricsLog

        self.request, self.trainer, self.main = request, trainer, main
        self.parallel = parallel
        self.lr_at = lr_at or (lambda step: request.lr)
        self.began = time.perf_counter()
        self.last_eval: tuple[int, float] | None = None
        self.eval_data = None
        if getattr(request, "eval_data", None) is not None:
            self.eval_data = EvalData(request.eval_data, token_dtype, request.seq,
                                      request.batch, vocab_size, request.eval_batches)
        log_dir = getattr(request, "log_dir", None)
        self.log = MetricsLog(log_dir, start) if log_dir is not None and main else None

    def notes(self) -> list[str]:
        notes = []
        if self.eval_data is not None:
            d, r = self.eval_data, self.request
            dp, tp = (self.parallel.dp, self.parallel.tp) if self.parallel is not None \
                else (1, 1)
            split = f", split over the {dp} data-parallel ranks" if dp > 1 else ""
            if tp > 1:  # a TP group evaluates its batches together
                split += f", each batch on the {tp} ranks of a tensor-parallel group"
            mesh = getattr(self.trainer, "mesh", None)  # --pp: runtime.dist.mesh's
            if mesh is not None:
                split = pipeline_split(mesh)
            notes.append(f"eval: {d.batches} batches of {r.batch} x {r.seq} tokens from "
                         f"{d.path} every {r.eval_every} steps and after the last{split}")
        if self.log is not None:
            notes += self.log.notices
            notes.append(f"metrics: {self.log.path}")
        return notes

    def after_step(self, record: dict) -> dict:
        """The step's record with what the observer adds (written to the log)."""
        step = record["step"]
        record = dict(record, lr=self.lr_at(step), time=time.perf_counter() - self.began)
        if self.eval_data is not None and due(step, self.request.eval_every,
                                              self.request.steps):
            loss = evaluate(self.trainer, self.eval_data, self.parallel)  # every rank
            record["eval_loss"] = loss
            self.last_eval = (step, loss)
        if self.log is not None:
            self.log.write({k: v for k, v in record.items() if k != "steps"})
        return record

    def close(self) -> None:
        if self.log is not None:
            self.log.close()

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline_split(mesh) -> str:
    """How a pipeline run evaluates its batches (the eval note's end)."""
    split = f", each batch forward through the {mesh.pp} pipeline stages"
    if mesh.tp > 1:
        split += f" (each on {mesh.tp} tensor-parallel ranks)"
    if mesh.dp > 1:
        split += f", split over the {mesh.dp} data-parallel pipelines"
    return split
