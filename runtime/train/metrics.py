"""`modulec train --log-dir RUN_DIR`: the run's metrics, one JSON object per optimizer step
(with --log-every K, per window of K steps: runtime/train/log_window.py) in
`RUN_DIR/metrics.jsonl`, and TensorBoard scalars in `RUN_DIR/tensorboard/` when the
`tensorboard` package can be imported (an optional dependency: without it, one notice).

A record holds `step`, `loss`, `lr`, `tokens_per_s`, `seconds`, `peak_bytes`, `time`
(seconds since the run started) and, where the trainer has them, `grad_norm` and other
numbers; `eval_loss` on the steps evaluated (runtime/train/evaluate.py); with K > 1,
`window` (the steps its loss, norm and times average). Every numeric field is also a
TensorBoard scalar, `train/<field>` (`eval/loss` for the eval loss).

Resuming with the same RUN_DIR continues the file: records of steps after the resumed
checkpoint (written by the run that was interrupted after its last save) are dropped
first, so the file holds one record per logged step, as one uninterrupted run would
have written it (a window cut by the resume: the resumed run's steps of it only). `modulec report RUN_DIR` draws it (runtime/train/report.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from modulec.files import atomic_text

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
EVAL_FIELDS = {"eval_loss": "eval/loss"}


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl (flushed per record) and mirrors them to
    TensorBoard when it is importable; `notices` says what the log could not do."""

    def __init__(self, folder, start: int = 0, tensorboard: bool = True):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path = self.folder / METRICS
            _keep_until(self.path, start)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            from runtime.errors import RuntimeUserError

            raise RuntimeUserError(f"--log-dir {folder}: cannot write {METRICS}: {exc}") \
                from None
        self.notices: list[str] = []
        self.writer = _tensorboard_writer(self.folder / TENSORBOARD, self.notices) \
            if tensorboard else None

    def write(self, record: dict) -> None:
        clean = {k: _number(v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = int(record["step"])
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(EVAL_FIELDS.get(key, f"train/{key}"), value, step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _number(value):
    """JSON has no NaN or Infinity: those are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _tensorboard_writer(folder: Path, notices: list):
    """TensorBoard's SummaryWriter (torch.utils.tensorboard needs the `tensorboard`
    package), or None with a one-line notice."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        notices.append("tensorboard is not installed: metrics go to "
                       f"{folder.parent / METRICS} only (pip install tensorboard for "
                       "TensorBoard scalars)")
        return None
    return SummaryWriter(log_dir=str(folder))


def read_metrics(path) -> list[dict]:
    """The records of a metrics file (or a RUN_DIR holding one), in file order; a line
    that is not a JSON object (a run killed mid-write) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _keep_until(path: Path, start: int) -> None:
    """Drop the records of steps after `start` (0: a new run starts a new file)."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= start] if start else []
    atomic_text(path, "".join(json.dumps(r) + "\n" for r in kept))
