"""Dropout on the GPU step (LoRA's `dropout=p` on the adapters' input): masks drawn from a
seed held on the device, so a captured CUDA graph draws new masks on every replay.

The reference kernel (runtime/kernels/elementwise.py) seeds a torch.Generator with a
Python int per op and step; a captured graph would replay the first step's mask forever.
Here a mask is a counter-based hash of (the step's device counter, the op's key, the
element's index): `TrainStep` adds one to its counter (`rng_step`, an int64 device scalar)
at the start of each step, inside the graph, and the interpreter gives each dropout op a
`DeviceSeed` whose key is fixed per op run (the micro-batch, the data-parallel rank, the
frame's path and layer indices, the node: runtime/cuda/step_interpreter.py). The same op
run again in the same step (a planned recompute) draws the same mask; another step,
layer, micro-batch or rank another one. Tensor-parallel ranks of one slice share their
masks (the adapters' input is replicated over them).

The hash is murmur3's 32-bit finalizer applied twice, in int64 torch ops with no overflow
(a 32 x 32-bit product is taken in 16-bit halves), so it runs and is tested on the CPU
too. Semantics are the reference's: an element is kept with probability 1 - p and scaled
by 1 / (1 - p); the saved mask is 0 or 1 / (1 - p) in the input's dtype. Cost: about 20
elementwise int64 passes over the input's element count (no fused kernel yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
MIX1, MIX2 = 0x85EBCA6B, 0xC2B2AE35


@dataclass(frozen=True)
class DeviceSeed:
    """The seed of one dropout op run: the step's device counter and the op's key."""

    counter: torch.Tensor  # int64 0-d, on the device
    key: int


def mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 in place, for int64 h in [0, 2^32) and c < 2^32: h * c's low
    16-bit half of c and high half separately (products below 2^48)."""
    high = (h * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return h.mul_(c & 0xFFFF).add_(high).bitwise_and_(M32)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer in place on int64 h in [0, 2^32): a bijection of 32-bit words
    in which every input bit changes each output bit with probability about 1/2."""
    h.bitwise_xor_(h >> 16)
    mul32(h, MIX1)
    h.bitwise_xor_(h >> 13)
    mul32(h, MIX2)
    return h.bitwise_xor_(h >> 16)


def uniform(shape, seed: DeviceSeed) -> torch.Tensor:
    """fp32 values in [0, 1) (24 random bits each) of `shape`, a function of the seed's
    counter (read on the device), its key and each element's flat index."""
    n = 1
    for d in shape:
        n *= int(d)
    word = fmix32(mul32(seed.counter.to(torch.int64) & M32, GOLDEN)
                  .bitwise_xor_(seed.key & M32))
    second = fmix32(word ^ GOLDEN)
    index = torch.arange(n, device=seed.counter.device, dtype=torch.int64)
    h = fmix32((index & M32).bitwise_xor_(word))
    if n > M32:  # indices past 2^32: their high bits too
        h.bitwise_xor_(index >> 32)
    del index
    h = fmix32(h.bitwise_xor_(second))
    return (h >> 8).to(torch.float32).mul_(2.0 ** -24).view(tuple(int(d) for d in shape))


class DeviceDropout:
    """The `dropout` primitive with a `DeviceSeed` (the GPU step's training runs); any other
    seed goes to the reference kernel as it is (an int: a torch.Generator seeded with it,
    eager runs only; None: no dropout), as does the backward (d_x = d_y * mask)."""

    def __init__(self, reference):
        self.reference = reference

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        seed, p = attrs.get("seed"), float(attrs.get("p", 0.0))
        if not isinstance(seed, DeviceSeed) or p == 0:
            return self.reference.forward(inputs, attrs)
        x = inputs[0]
        keep = uniform(x.shape, seed) >= p
        scale = 1.0 / (1.0 - p)
        return [x.mul(scale).mul_(keep), keep.to(x.dtype).mul_(scale)]

    def backward(self, inputs: list, attrs: dict) -> list:
        return self.reference.backward(inputs, attrs)
