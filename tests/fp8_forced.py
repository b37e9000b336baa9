"""The GPU step's FP8 GEMMs checked node by node against the CPU emulation, in a way
that FP8's rounding does not defeat (tests/test_fp8_gemm.py).

On a tiny model an FP8 step is chaotic: one element rounded to the next E5M2 step (25%)
moves every value downstream enough to flip other roundings, so a step in bf16 and the
float32 emulation, given the same weights, end as far apart as an unquantized step is
from either (measured on the CPU: the emulation itself in bf16 is 14% to 60% away from
the float32 emulation in every gradient, its weights perturbed by 1e-5 10% to 25%). An
end-to-end bound cannot tell a wrong GEMM from that. So the step is recorded (each
covered node's inputs and outputs as it ran them) and replayed by the emulating
interpreter with every covered node *forced*: the emulation quantizes the step's own
inputs (bit for bit what the step quantized) and computes the product in float32, which
the step's output must match within its output rounding; the emulation's own inputs of
the node (computed from the forced values upstream, in float32) must match the step's
within bf16 rounding (a value read too early, overwritten or misread is far off); then the
step's outputs replace the emulation's and the replay goes on. At the end the loss, every
gradient and every amax history follow the step's within bf16 rounding."""

from __future__ import annotations

from collections import defaultdict

import torch

from runtime.interpreter import Interpreter


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _key(node, frame) -> tuple:
    return frame.function.name, node.id, frame.path, tuple(frame.indices)


def record(fp8_run) -> dict:
    """Wrap `fp8_run.run_op` (a StepFp8): each covered node's inputs as the FP8 GEMMs read
    them and its outputs, float32 on the CPU, by (function, node, path, indices)."""
    records, run_op = defaultdict(list), fp8_run.run_op

    def recorded(node, frame, forward, inputs, attrs):
        seen = [None if x is None else x.detach().float().cpu().clone() for x in inputs]
        outputs = run_op(node, frame, forward, inputs, attrs)
        records[_key(node, frame)].append(
            (seen, [None if y is None else y.detach().float().cpu().clone() for y in outputs]))
        return outputs
    fp8_run.run_op = recorded
    return records


class Forced(Interpreter):
    """The emulating interpreter (float32, `fp8=` an Fp8State) with each covered node's
    inputs and outputs taken from `records`; `worst` collects the largest errors."""

    def __init__(self, *args, records: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = {k: list(v) for k, v in records.items()}
        self.worst = {"inputs": (0.0, None), "outputs": (0.0, None)}
        self.checked = 0
        self._forced = None

    def _inputs(self, node, frame, forward):
        if self._forced is not None:
            return list(self._forced)
        return super()._inputs(node, frame, forward)

    def _note(self, what: str, error: float, where) -> None:
        if error > self.worst[what][0]:
            self.worst[what] = (error, where)

    def _op(self, node, frame, forward) -> None:
        covered = self.fp8 is not None and node.target in ("matmul", "matmul_backward") \
            and self.fp8.site(frame.function.name, node.id) is not None and any(node.outputs)
        if not covered:
            return super()._op(node, frame, forward)
        key = _key(node, frame)
        assert self.records.get(key), f"the step did not run covered node {key}"
        seen, made = self.records[key].pop(0)
        own = super()._inputs(node, frame, forward)
        for i, (ours, theirs) in enumerate(zip(own, seen)):
            if ours is not None and theirs is not None:
                self._note("inputs", rel(theirs, ours), (key, i))
        self._forced = [None if x is None else x.to(self.dtype) for x in seen]
        try:
            super()._op(node, frame, forward)  # the emulation on the step's own inputs
        finally:
            self._forced = None
        for value, tensor in zip(node.outputs, made):
            if value and tensor is not None:
                self._note("outputs", rel(tensor, frame.env[value]), (key, value))
                frame.env[value] = tensor.to(self.dtype)  # forced: the step's value on
        self.checked += 1
