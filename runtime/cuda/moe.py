"""moe_permute and moe_unpermute on the GPU: the routing's row movement as gathers
(csrc/kernels/moe.cu), deterministic (no atomics: each output row sums its sources in a
fixed order). The reference's index_add scatter-adds become reads through the inverse
permutation `pos` (the permuted row of each assignment), which an index_put with unique
indices builds on the device.

The GPU forward of moe_permute does not re-check `expert_offsets` against the indices,
as the reference does: that comparison would sync with the host inside the captured step
(moe_compute_offsets makes them from the same indices).

moe_router and moe_compute_offsets count the assignments per expert without a host read
(`expert_counts`: a comparison with each expert id, summed; the reference's
torch.bincount reads the largest index back to size its output). moe_compute_offsets on
the GPU does not re-check that every index is below num_experts (the router's top-k
makes them so). grouped_gemm is runtime/cuda/grouped_gemm.py. So the whole MoE path
(route, count, permute, experts, unpermute) runs with fixed sizes (N * top_k rows) and
no host read, and a step with MoE layers is captured in one CUDA graph.

Calls the kernels do not cover (tensors not on CUDA or not contiguous, dtypes other than
bf16/fp32, indices not int32) go to the reference kernels.
"""

from __future__ import annotations

import torch

from runtime.cuda.grouped_gemm import GroupedGemm
from runtime.kernels import KERNELS
from runtime.kernels.base import _call
from runtime.kernels.moe import _router_probs, router_d_logits, router_probs

IO_DTYPES = (torch.bfloat16, torch.float32)


def _ok(rows, *indices) -> bool:
    tensors = (rows, *indices)
    return (all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() for t in tensors)
            and rows.dtype in IO_DTYPES and rows.dim() == 2
            and all(i.dtype == torch.int32 for i in indices))


def inverse(scatter: torch.Tensor) -> torch.Tensor:
    """pos[scatter[j]] = j."""
    pos = torch.empty_like(scatter)
    pos[scatter.long()] = torch.arange(scatter.numel(), dtype=scatter.dtype,
                                       device=scatter.device)
    return pos


class _Reference:
    def __init__(self, name: str):
        self.reference = KERNELS[name]

    def __getattr__(self, attr):
        return getattr(self.reference, attr)


class MoePermute(_Reference):
    allocates_outputs = True  # the gathers make their outputs (runtime/arena.py own_saved)

    def __init__(self):
        super().__init__("moe_permute")

    def forward(self, inputs: list, attrs: dict) -> list:
        x, indices, offsets = inputs
        if not _ok(x, indices):
            return self.reference.forward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        top_k = indices.shape[1]
        scatter = torch.argsort(indices.reshape(-1), stable=True).to(torch.int32)
        return [_extension().moe_gather_rows(x, scatter, top_k), scatter]

    def backward(self, inputs: list, attrs: dict) -> list:
        d_permuted, scatter = inputs
        if not _ok(d_permuted, scatter):
            return self.reference.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension
        from runtime.kernels.base import input_shape

        top_k = scatter.numel() // input_shape(attrs, "moe_permute", "x")[0]
        return [_extension().moe_combine(d_permuted, None, inverse(scatter), top_k)]


class MoeUnpermute(_Reference):
    allocates_outputs = True  # the backward's d_rows (transient) stays where it is made

    def __init__(self):
        super().__init__("moe_unpermute")

    def forward(self, inputs: list, attrs: dict) -> list:
        rows, weights, scatter = inputs
        if not _ok(rows, scatter) or not _weights_ok(weights, rows):
            return self.reference.forward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        w = weights.reshape(-1).float().contiguous()
        return [_extension().moe_combine(rows, w, inverse(scatter), weights.shape[1])]

    def backward(self, inputs: list, attrs: dict) -> list:
        d_combined, rows, weights, scatter = inputs
        if not _ok(rows, scatter) or not _weights_ok(weights, rows) \
                or not _ok(d_combined) or d_combined.dtype != rows.dtype:
            return self.reference.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension

        w = weights.reshape(-1).float().contiguous()
        d_rows, d_w = _extension().moe_combine_backward(d_combined, rows, w, scatter,
                                                        weights.shape[1])
        return [d_rows, d_w.reshape(weights.shape).to(weights.dtype)]


def _weights_ok(weights, rows) -> bool:
    return (isinstance(weights, torch.Tensor) and weights.is_cuda and weights.dim() == 2
            and weights.dtype in IO_DTYPES and weights.device == rows.device)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64 [num_experts]) with fixed sizes and no host read;
    an index outside 0 .. num_experts-1 is counted nowhere."""
    experts = torch.arange(num_experts, device=indices.device)
    return (indices.reshape(-1, 1).long() == experts).sum(0)


def _router_forward(x, gate, *, top_k, normalize=True, use_sigmoid=False, **_):
    """runtime/kernels/moe.py's moe_router forward with `expert_counts` for bincount."""
    return _route(_router_probs(x, gate, use_sigmoid), gate.shape[0], top_k, normalize)


def _route(probs, E: int, top_k: int, normalize: bool) -> list:
    p, indices = torch.topk(probs, top_k, dim=-1)
    weights = p / p.sum(-1, keepdim=True) if normalize else p
    fraction = expert_counts(indices, E).to(probs.dtype) / indices.shape[0]
    return [weights, indices.to(torch.int32), torch.stack([fraction, probs.mean(0)])]


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 operands in fp32: the exact products summed in fp32, written out in
    fp32 (torch.mm's out_dtype, cuBLAS's fp32 accumulation; CUDA only, so on the CPU the
    same arithmetic through fp32 copies)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def two_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 [.., E] as [.., 2E] bf16: hi then lo, hi + lo = t to about 2^-17 |t| (a bf16
    GEMM over both halves sums t's products to nearly fp32 accuracy)."""
    hi = t.to(torch.bfloat16)
    return torch.cat([hi, (t - hi.float()).to(torch.bfloat16)], -1)


def router_forward_bf16(x, gate, *, top_k, normalize=True, use_sigmoid=False, **_):
    """moe_router's forward with bf16 x and gate (no fp32 copy of x): the logits are the
    fp32 ones of the reference (mm32), the rest its arithmetic on them."""
    probs = router_probs(mm32(x, gate.t()), use_sigmoid)
    weights, indices, stats = _route(probs, gate.shape[0], top_k, normalize)
    return [weights.to(x.dtype), indices, stats]


def router_backward_bf16(d_weights, d_stats, x, gate, indices, *, top_k, normalize=True,
                         use_sigmoid=False, **_):
    """moe_router's backward with bf16 x and gate: the reference's fp32 d_logits
    (router_d_logits), split in two bf16 halves (two_bf16) for the products with gate and
    x, bf16 GEMMs that read x once and write d_x once in bf16 (the reference reads an fp32
    copy of x twice and writes d_x in fp32, then casts it)."""
    probs = router_probs(mm32(x, gate.t()), use_sigmoid)
    d_weights = d_weights.float() if d_weights is not None else None
    d_stats = d_stats.float() if d_stats is not None else None
    parts = two_bf16(router_d_logits(d_weights, d_stats, probs, indices, normalize,
                                     use_sigmoid))
    E = gate.shape[0]
    d_x = torch.mm(parts, torch.cat([gate, gate]))               # [N, d] in bf16
    d_gate = mm32(parts.t(), x)                                  # [2E, d] in fp32
    return [d_x, (d_gate[:E] + d_gate[E:]).to(gate.dtype)]


def _router_bf16(x, gate) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(gate, torch.Tensor) and x.is_cuda
            and x.dtype == gate.dtype == torch.bfloat16 and x.dim() == gate.dim() == 2
            and x.device == gate.device)


def _offsets_forward(indices, *, num_experts, **_):
    counts = expert_counts(indices, num_experts)
    return [torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)]


class _SyncFree(_Reference):
    """A reference kernel whose forward runs `fn` (the same arithmetic without a host
    read) on CUDA tensors, through the reference's dtype policy; its backward is the
    reference's."""

    def __init__(self, name: str, fn):
        super().__init__(name)
        self.fn = fn

    def forward(self, inputs: list, attrs: dict) -> list:
        if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self.reference.forward(inputs, attrs)
        r = self.reference
        return _call(r, self.fn, r.forward_inputs, r.forward_outputs, inputs, attrs)


class MoeRouter(_SyncFree):
    """moe_router on the GPU: bf16 x and gate without fp32 copies (router_forward_bf16,
    router_backward_bf16), other CUDA calls through `_SyncFree`, the rest the reference."""

    def __init__(self):
        super().__init__("moe_router", _router_forward)

    def forward(self, inputs: list, attrs: dict) -> list:
        if _router_bf16(*inputs):
            return router_forward_bf16(*inputs, **attrs)
        return super().forward(inputs, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        if _router_bf16(*inputs[2:4]):
            return router_backward_bf16(*inputs, **attrs)
        return self.reference.backward(inputs, attrs)


MOE_KERNELS = {"moe_permute": MoePermute(), "moe_unpermute": MoeUnpermute(),
               "moe_router": MoeRouter(),
               "moe_compute_offsets": _SyncFree("moe_compute_offsets", _offsets_forward),
               "grouped_gemm": GroupedGemm()}
