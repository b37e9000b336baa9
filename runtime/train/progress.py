"""Progress of a training run: a rich progress bar when stderr is a terminal, otherwise a
plain line per step on stderr; `--format json`: one JSON object per step on stdout (with
--log-every K, per record: every K steps, runtime/train/log_window.py)."""

from __future__ import annotations

import json
import sys


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def line(record: dict) -> str:
    text = (f"step {record['step']}/{record['steps']}  loss {record['loss']:.4f}"
            f"{_window(record)}  tokens/s {record['tokens_per_s']:,.0f}  "
            f"peak {gib(record['peak_bytes'])}")
    if record.get("lr") is not None:  # the schedule's rate and the gradient norm
        text += f"  lr {record['lr']:.3g}"
    if record.get("grad_norm") is not None:
        text += f"  grad norm {record['grad_norm']:.3g}"
    if record.get("eval_loss") is not None:  # --eval-data, on the steps evaluated
        text += f"  eval loss {record['eval_loss']:.4f}"
    return text


class Progress:
    def __init__(self, fmt: str, first: int, steps: int):
        self.fmt, self.first, self.steps = fmt, first, steps
        self.rich = None
        if fmt == "human" and sys.stderr.isatty():
            self.rich = _rich_bar(first, steps)

    def __enter__(self) -> "Progress":
        if self.rich is not None:
            self.rich[0].start()
        return self

    def __exit__(self, *exc) -> None:
        if self.rich is not None:
            self.rich[0].stop()

    def step(self, record: dict) -> None:
        if self.fmt == "none":  # a data-parallel rank other than 0
            return
        if self.fmt == "json":
            print(json.dumps({"event": "step"} | record), flush=True)
        elif self.rich is not None:
            bar, task = self.rich
            bar.update(task, completed=record["step"] - self.first,
                       info=f"loss {record['loss']:.4f}{_window(record)} · "
                            f"{record['tokens_per_s']:,.0f} tok/s"
                            f" · {gib(record['peak_bytes'])}{_optimizer_info(record)}")
            if record.get("eval_loss") is not None:
                self.rich[0].console.print(f"step {record['step']}: eval loss "
                                           f"{record['eval_loss']:.4f}", highlight=False)
        else:
            print(line(record), file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.fmt == "none":
            return
        if self.fmt == "json":
            print(json.dumps({"event": "note", "text": text}), flush=True)
        elif self.rich is not None:
            self.rich[0].console.print(text, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)


def _window(record: dict) -> str:
    """--log-every K: the loss (and norm, tokens/s) are the means of `window` steps."""
    n = record.get("window")
    return f" (mean of {n} steps)" if n is not None and n > 1 else ""


def _optimizer_info(record: dict) -> str:
    """The bar's tail: the step's learning rate and gradient norm, where recorded."""
    text = f" · lr {record['lr']:.3g}" if record.get("lr") is not None else ""
    if record.get("grad_norm") is not None:
        text += f" · norm {record['grad_norm']:.3g}"
    return text


def _rich_bar(first: int, steps: int):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                               TimeRemainingColumn)

    bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
              TextColumn("{task.fields[info]}"), console=Console(stderr=True))
    task = bar.add_task("train", total=steps - first, info="")
    return bar, task
