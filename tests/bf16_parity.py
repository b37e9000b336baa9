"""Comparing a bf16 GPU step's gradients with transformers: against transformers' own fp32
run of the same weights and batch, not against its bf16 run alone. A gradient passes when
its cosine with the fp32 one is >= 0.999, or, where transformers' bf16 run is itself
further off (a gradient that is zero in exact arithmetic, as a key bias's: the softmax
does not see a constant added to every key's score; a router whose top-k picks flip
under rounding), when ours is no further from the fp32 gradient than `SLACK` x
transformers' bf16 one. Comparing the two bf16 runs with each other (the tests' first
form) failed on exactly those: two roundings of a zero have a cosine of 0.13."""

from __future__ import annotations

import copy

import torch

COSINE, SLACK = 0.999, 2.0


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def fp32_and_bf16(model):
    """(an fp32 copy on the GPU, the model itself in bf16 on the GPU)."""
    reference = copy.deepcopy(model).to("cuda", torch.float32)
    return reference, model.to("cuda", torch.bfloat16)


def far_gradients(ours: dict, bf16: dict, fp32: dict, slack: float = SLACK) -> list:
    """(name, cosine with fp32, our error / transformers' bf16 error) of each gradient that
    fails both tests; empty when all pass."""
    bad = []
    for name, truth in fp32.items():
        truth = truth.double()
        near = cosine(ours[name], truth)
        if near >= COSINE:
            continue
        mine = float((ours[name].double() - truth).norm())
        theirs = float((bf16[name].double() - truth).norm())
        if mine <= slack * theirs:
            continue
        bad.append((name, round(near, 5), round(mine / max(theirs, 1e-30), 2)))
    return bad
