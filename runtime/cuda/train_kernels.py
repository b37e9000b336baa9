"""`TRAIN_KERNELS`: the registry the GPU training step runs with, `CUDA_KERNELS` with
the entries that decide its speed replaced.

The reference calling convention casts every bf16 input to fp32 and back (base.py's dtype
policy). That is right for arithmetic but, on the GPU, a matmul run in fp32 is several
times slower than cuBLAS's bf16 GEMM (which accumulates in fp32 anyway), and a view or a
transpose cast to fp32 and back is two copies where none is needed. So:

- layout ops (view, transpose, split, concat, contiguous) and embedding's gather run on the
  tensors as they are, with no cast (they do no arithmetic);
- matmul runs as cuBLAS in the I/O dtype (bf16 operands, fp32 accumulation); transposes
  are strides, not copies;
- flash_attention runs through FlashAttention-2 (runtime/cuda/attention.py);
- the custom kernels (rmsnorm, fused_residual_rmsnorm, swiglu, rope, qk_norm) get
  contiguous inputs (the attention's q/k and the MLP's gate/up are strided views, which
  the custom kernels would otherwise hand to the fp32 reference);
- zeros are made on the GPU.

Everything else (embedding backward, cross_entropy, ...) is CUDA_KERNELS' entry.
"""

from __future__ import annotations

import torch

from runtime.cuda.attention import FlashAttention
from runtime.cuda.kernels import CUDA_KERNELS
from runtime.kernels import KERNELS
from runtime.kernels.base import ReferenceKernel
from runtime.kernels.utility import torch_dtype

NO_CAST = ("view", "transpose", "split", "concat", "contiguous", "matmul", "batched_matmul")
CONTIGUOUS = ("rmsnorm", "fused_residual_rmsnorm", "swiglu", "rope", "qk_norm")


class NoCast:
    """A reference kernel called on its inputs as they are (no dtype cast)."""

    def __init__(self, reference: ReferenceKernel):
        self.reference = reference

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        return list(self.reference.forward_fn(*inputs, **attrs))

    def backward(self, inputs: list, attrs: dict) -> list:
        return list(self.reference.backward_fn(*inputs, **attrs))


class Contiguous:
    """A kernel whose tensor inputs are made contiguous first (a copy only where needed)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        return self.kernel.forward(_contiguous(inputs), attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        return self.kernel.backward(_contiguous(inputs), attrs)


def _contiguous(inputs: list) -> list:
    return [x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs]


class Embedding(NoCast):
    """The gather without a cast; the backward (a scatter-add) keeps the fp32 reference."""

    def backward(self, inputs: list, attrs: dict) -> list:
        return self.reference.backward(inputs, attrs)


class Zeros(NoCast):
    """zeros on `device` (the reference makes them on the CPU)."""

    def __init__(self, reference: ReferenceKernel, device: str):
        super().__init__(reference)
        self.device = device

    def forward(self, inputs: list, attrs: dict) -> list:
        shape, dtype = list(attrs["shape"]), torch_dtype(attrs.get("dtype", "bf16"))
        return [torch.zeros(shape, dtype=dtype, device=self.device)]


def train_kernels(device: str = "cuda") -> dict:
    kernels = dict(CUDA_KERNELS)
    kernels.update({name: NoCast(KERNELS[name]) for name in NO_CAST})
    kernels.update({name: Contiguous(CUDA_KERNELS[name]) for name in CONTIGUOUS})
    kernels["embedding"] = Embedding(KERNELS["embedding"])
    kernels["zeros"] = Zeros(KERNELS["zeros"], device)
    kernels["flash_attention"] = FlashAttention()
    return kernels


TRAIN_KERNELS = train_kernels()
