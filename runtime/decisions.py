"""Executing the planner's keep / recompute / swap decisions (issue 5 item 1).

The activation layout of a build (`schedule.layout`, modulec.lower.layout) says, per saved
value and run of instances, what the memory planner decided. When a forward function run
ends, a value decided `recompute` is dropped and one decided `swap` moves to a host copy;
the backward that reads it first gets it back: a recomputed value by replaying the forward
op that made it (its inputs recursively, the way the Schedule IR's recompute segments
replay them), a swapped one by copying it in. In arena mode the dropped bytes are
overwritten (NaN for floats) so that a backward reading them without the replay shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.errors import RuntimeUserError

RECOMPUTE, SWAP = "recompute", "swap"
APPLY_SAVED = "apply_saved"


@dataclass
class Decisions:
    table: dict[tuple[str, str], list] = field(default_factory=dict)  # (function, value)
    replays: dict[tuple[str, str], list] = field(default_factory=dict)  # (function, node)
    counts: dict[str, int] = field(default_factory=lambda: {
        "dropped": 0, "recomputed": 0, "swapped_out": 0, "swapped_in": 0})

    @classmethod
    def from_schedule(cls, schedule: dict) -> "Decisions | None":
        """The decisions of a build's `schedule` (its layout and recompute ops)."""
        layout = schedule.get("layout", {})
        table = {(f["function"], v["value"]): v["decisions"]
                 for f in layout.get("functions", []) for v in f.get("values", [])
                 if any(d[0] != "keep" for d in v["decisions"])}
        replays: dict = {}
        for ops in schedule.get("functions", {}).values():
            for op in ops:
                if op.get("kind") == "recompute":
                    replays.setdefault((op["function"], op["node"]), []).append(
                        (op.get("replay", "op"), op.get("instances")))
        return cls(table, replays) if table else None

    def replay_mode(self, function: str, node: str, instance: int) -> str:
        for mode, runs in self.replays.get((function, node), ()):
            if runs is None or any(a <= instance <= b for a, b in runs):
                return mode
        return "op"

    def of(self, function: str, value: str, instance: int) -> str:
        for kind, first, last in self.table.get((function, value), ()):
            if first <= instance <= last:
                return kind
        return "keep"

    # ------------------------------------------------------------------ forward end
    def release(self, root, sinks: dict, arena=None) -> None:
        """After the forward: drop or swap out every value decided so in every run of the
        frame tree under `root`, and forget the same tensor where a callee (or the next
        repetition) received it as an input (`sinks`), so the backward must restore it."""
        released = []
        given = _arguments(root, sinks)
        for frame in _frames(root):
            for value in list(frame.env):
                kind = self.of(frame.function.name, value, frame.instance)
                if kind in (RECOMPUTE, SWAP):
                    released.append((frame, value, self._release(frame, value, kind, sinks)))
                elif arena is not None and (arena.is_transient(frame, value)
                                            or arena.in_transient(frame.env[value])):
                    # the backward reuses these bytes: a read replays the value instead
                    # (an argument in them: its caller's, asked for again)
                    tensor = frame.env.pop(value)
                    if (id(frame), value) in given:
                        frame.forgotten[value] = given[(id(frame), value)]
                    else:
                        frame.dropped.add(value)
                    _forget(frame, value, tensor, sinks)
        if arena is not None and arena.poison:
            kept = _kept_ranges(root)
            for _, _, tensor in released:
                _poison(tensor, kept)
            arena.poison_transient()

    def _release(self, frame, value: str, kind: str, sinks: dict):
        tensor = frame.env.pop(value)
        if kind == SWAP:
            frame.host[value] = tensor.to("cpu", copy=True)
            self.counts["swapped_out"] += 1
        else:
            frame.dropped.add(value)
            self.counts["dropped"] += 1
        _forget(frame, value, tensor, sinks)
        return tensor

    # ------------------------------------------------------------------ backward reads
    def restore(self, interpreter, frame, value: str) -> bool:
        """Bring `value` of forward run `frame` back; False when it was never released."""
        if value in frame.host:
            tensor = frame.host.pop(value).to(frame_device(frame))
            frame.env[value] = interpreter.place(frame, None, value, tensor)
            self.counts["swapped_in"] += 1
            return True
        if value in frame.dropped:
            self._replay(interpreter, frame, value)
            return True
        if value in frame.forgotten:  # an argument its caller released: ask the caller
            owner, source = frame.forgotten.pop(value)
            frame.env[value] = interpreter.read_forward(owner, source)
            return True
        return False

    def _replay(self, interpreter, frame, value: str) -> None:
        node = next((n for n in frame.function.nodes if value in n.outputs), None)
        if node is not None and node.kind == "call":
            self._from_callee(interpreter, frame, node, value)
            return
        if node is None or node.kind != "op":
            raise RuntimeUserError(f"`{value}` of `{frame.function.name}` was dropped to be "
                                   "recomputed, but no op of the forward makes it")
        if self.replay_mode(frame.function.name, node.id, frame.instance) == APPLY_SAVED:
            _apply_saved(interpreter, frame, node)
            frame.dropped.discard(value)
        else:
            interpreter.replay(node, frame)
            frame.dropped.difference_update(node.outputs)
        self.counts["recomputed"] += 1


    def _from_callee(self, interpreter, frame, node, value: str) -> None:
        """A call's result: the callee's output (replayed there if it was dropped too)."""
        child = frame.children[(node.id, int(node.repeat) - 1)]
        inner = child.function.outputs[list(node.outputs).index(value)]
        tensor = interpreter.read_forward(child, inner)
        frame.env[value] = interpreter.place(frame, node, value, tensor)
        frame.dropped.discard(value)
        self.counts["recomputed"] += 1


def frame_device(frame) -> torch.device:
    for tensor in frame.env.values():
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def _frames(root):
    """Every forward run under `root`, callees first."""
    for child in root.children.values():
        yield from _frames(child)
    yield root


def _forget(frame, value: str, tensor, sinks: dict) -> None:
    """Where `value` of `frame` went in as an argument (the same tensor), drop it there
    too, remembering where to get it back."""
    for sink, argument in sinks.get((id(frame), value), ()):
        if sink.env.get(argument) is tensor:
            del sink.env[argument]
            sink.forgotten[argument] = (frame, value)
            _forget(sink, argument, tensor, sinks)


def _arguments(root, sinks: dict) -> dict:
    """(id(run), argument) -> (the run it came from, its value there), for the runs under
    `root` (`sinks` maps the other way)."""
    runs = {id(frame): frame for frame in _frames(root)}
    return {(id(sink), argument): (runs[owner], value)
            for (owner, value), places in sinks.items() if owner in runs
            for sink, argument in places}


def _kept_ranges(root) -> list[tuple[int, int]]:
    return [_range(t) for frame in _frames(root) for t in frame.env.values()
            if isinstance(t, torch.Tensor)]


def _range(tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.nbytes


def _poison(tensor, kept: list) -> None:
    """Overwrite released bytes (NaN for floats) unless a kept value shares them."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        return
    low, high = _range(tensor)
    if any(a < high and low < b for a, b in kept):
        return
    with torch.no_grad():
        tensor.reshape(-1).view(torch.uint8).fill_(255)  # 1-d first: a 0-d tensor has no byte view


def _apply_saved(interpreter, frame, node) -> None:
    """A norm's output from its saved statistics (the planner's `apply_saved` replay,
    modulec.plan.replay.APPLY_SAVED): y = x_hat * weight (+ bias), x_hat from the saved
    (residual) input and rstd (and mean), without the norm's other inputs (an RMSNorm's
    scale is offset + weight, its `offset` attr: Gemma's `1 + w`). A kernel in
    the interpreter's `apply_saved_kernels` (by op; the GPU step's: one fused launch)
    goes first; None from it means it does not cover the tensors."""
    from modulec.plan.replay import APPLY_SAVED as RULES

    replayed, sources = RULES[node.target]
    read = [interpreter.read_forward(frame, node.outputs[i] if kind == "out" else node.inputs[i])
            for kind, i in sources]
    weight = interpreter.read_forward(frame, node.inputs[1 if node.target != "fused_residual_rmsnorm" else 2])
    value = node.outputs[replayed]
    kernel = getattr(interpreter, "apply_saved_kernels", {}).get(node.target)
    offset = float(node.attr("offset") or 0.0)
    y = kernel(read[0], read[1:], weight, offset) if kernel is not None else None
    if y is None:
        y = _apply_saved_reference(interpreter, frame, node, read[0], read[1:], weight)
    frame.env[value] = interpreter.place(frame, node, value, y)


def _apply_saved_reference(interpreter, frame, node, x, stats, weight):
    from runtime.kernels.base import compute_dtype

    io, work = x.dtype, compute_dtype(x.dtype)
    x, weight = x.to(work), weight.to(work)
    if node.target == "layernorm":
        mean, rstd = (t.to(work)[..., None] for t in stats)
        y = (x - mean) * rstd * weight
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        y = y + interpreter.read_forward(frame, bias).to(work) if bias else y
    else:
        y = x * stats[0].to(work)[..., None] * (weight + float(node.attr("offset") or 0.0))
    return y.to(io)
