"""Finite differences through `@gradient` ops (`--verify-backward`, runtime.verify).

`stop_gradient` and `scale_gradient` are identities forward; only their backward differs
from the forward's derivative, so plain finite differences cannot check a program that
has them. The check runs them as surrogates that have the same value at the point of
the check and the derivative the annotation asks for: y = x0 + f * (x - x0), x0 the value
x had in the unperturbed forward, f = 0 for a stop-gradient, `scale` for a scale, and for
a clip f = clamp(scale * d_y, -clip, clip) / d_y element by element (d_y the gradient
the backward brought there; 0 where d_y is 0), worked out here from the annotation, not
taken from the kernel. A wrong d_y at the op still shows: the finite difference
multiplies f by the true gradient, the backward used its own.

Installed as the model's hooks (the interpreter calls `apply` on every op's output); the
model's own hooks run as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MARKS = ("stop_gradient", "scale_gradient")


@dataclass
class GradientMarks:
    hooks: object  # the model's runtime.hooks.Hooks
    surrogate: bool = False  # False: record x0 and f; True: run the surrogates
    base: dict = field(default_factory=dict)  # (path, layers, node) -> x0
    factor: dict = field(default_factory=dict)  # (path, layers, node) -> f

    def begin(self, phase: str) -> None:
        self.hooks.begin(phase)

    def apply(self, node, frame, value: str, tensor):
        tensor = self.hooks.apply(node, frame, value, tensor)
        if node.kind != "op":
            return tensor
        if node.target in MARKS:
            return self._forward(node, frame, tensor)
        if node.target == "scale_gradient_backward" and not self.surrogate:
            key = (frame.path, frame.indices, node.attr("forward_node"))
            self.factor[key] = _factor(frame.env[node.inputs[0]], node.attr("scale", 1.0),
                                       node.attr("clip"))
        return tensor

    def _forward(self, node, frame, x):
        key = (frame.path, frame.indices, node.id)
        if not self.surrogate:
            self.base[key] = x.detach().clone()
            return x
        x0 = self.base[key]
        if node.target == "stop_gradient":
            return x0
        factor = self.factor.get(key, 0.0)  # no gradient reached it: any factor will do
        return x0 + factor * (x - x0)

    def __getattr__(self, name):  # probes, trace, ...: the model's hooks
        return getattr(self.__dict__["hooks"], name)


def _factor(d_y, scale: float, clip):
    if clip is None:
        return scale
    through = (d_y * scale).clamp(-clip, clip)
    nonzero = d_y != 0
    return torch.where(nonzero, through / torch.where(nonzero, d_y, 1), torch.zeros_like(d_y))
