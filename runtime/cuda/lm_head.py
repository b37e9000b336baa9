"""LM head + cross-entropy, fused and in chunks of rows: never the full logits.

A language model's graph ends in `xF -> matmul(W, transpose=NT) -> logits` (W the LM head,
or the embedding when tied). For training, `split_head` cuts that node off: the entry
function returns xF instead, and the backward function starts from d_xF (its first node,
the matmul's backward, goes too, with the head's parameter gradient). Then
`lm_head_cross_entropy` computes, chunk by chunk of rows, the logits (one GEMM in the
model's dtype), the loss and at once the gradient (softmax - onehot) / n, and from it d_xF
and d_W, so only one chunk of logits ever exists (chunk_rows x vocab).

On CUDA the loss and gradient of a chunk are one custom kernel (csrc/kernels/
cross_entropy.cu, `_kernel_for`): per row it reads the logits, computes their log-sum-exp
in fp32, writes the row's loss to a [rows] fp32 buffer and overwrites the logits, in place
and in their dtype (bf16), with the gradient, so no fp32 copy of the chunk exists. The
chunk's loss is the torch sum of that buffer (deterministic: no atomics). Elsewhere (CPU,
fp64, the extension not built) `_chunk` does the same with torch ops on a fp32 copy of the
chunk; it is also the kernel's reference in the tests.

The loss is the mean token cross-entropy over labels != ignore_index (next-token labels
are the caller's: labels[t] = token_ids[t + 1]). 1 / n stays a device scalar, which the
kernel reads: nothing syncs with the host, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from modulec.ir.graph import Function, Graph, ValueInfo
from modulec.plan.memory.model import round_up
from runtime.cuda.gemm import mm_into


@dataclass(frozen=True)
class HeadSplit:
    graph: Graph  # the program without the head matmul
    head_param: str  # the LM head's parameter path (`lm_head`, or `embedding` when tied)


def split_head(graph: Graph) -> HeadSplit | None:
    """The graph with its final `matmul(W, NT) -> logits` cut off, or None when the entry
    does not end that way (or has no backward)."""
    entry = graph.function(graph.entry)
    if not graph.backward or not entry.nodes or len(entry.outputs) != 1:
        return None
    head = entry.nodes[-1]
    if (head.kind != "op" or head.target != "matmul" or head.outputs != entry.outputs
            or head.attr("transpose") != "NT" or not head.inputs[1].startswith("param:")
            or head.attr("alpha", 1.0) != 1.0):
        return None
    backward = graph.function(graph.backward)
    first = backward.nodes[0] if backward.nodes else None
    if first is None or first.target != "matmul_backward" or first.attr("forward_node") != head.id:
        return None
    d_w = first.outputs[1]  # "" for a frozen head (LoRA): no gradient, nothing to feed
    if d_w and any(d_w in node.inputs for node in backward.nodes[1:]):
        return None  # the head's gradient feeds another node (a tied head's sum)
    new_entry = replace(entry, nodes=entry.nodes[:-1], outputs=(head.inputs[0],))
    new_backward = _backward_from(backward, entry, head.inputs[0], first)
    functions = tuple(new_entry if f.name == entry.name else
                      new_backward if f.name == backward.name else f for f in graph.functions)
    return HeadSplit(replace(graph, functions=functions), head.inputs[1][len("param:"):])


def _backward_from(backward: Function, entry: Function, x_id: str, first) -> Function:
    d_x, d_w = first.outputs
    info = entry.value(x_id)
    seed = ValueInfo(d_x, info.shape if info else (), info.dtype if info else "bf16", "d_xF")
    grads = tuple((p, g) for p, g in backward.param_grads if g != d_w)
    return replace(backward, inputs=(seed,), nodes=backward.nodes[1:], param_grads=grads)


def lm_head_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int = 2048,
                          ignore_index: int = -100, head_grad: bool = True,
                          scratch: Tensor | None = None, denominator: Tensor | None = None):
    """(loss [] fp32, d_x like x, d_weight fp32 like weight) of mean cross-entropy of
    logits = x @ weight^T against labels, in chunks of `chunk_rows` rows. `head_grad=False`
    (a frozen head, LoRA): d_weight is None, neither computed nor allocated. `scratch`
    (uint8 bytes free until the caller is done with d_weight: the arena's transient region
    between forward and backward) holds d_weight and the chunk's logits where they fit.
    `denominator` (a [] tensor on x's device): the summed loss is divided by it instead of
    the count of labels != ignore_index (packed data parallel: runtime/train/packing.py)."""
    d = x.shape[-1]
    rows, flat_labels = x.reshape(-1, d), labels.reshape(-1)
    keep = flat_labels != ignore_index
    inv_n = inverse_count(keep, torch.float32, denominator)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    d_rows = torch.empty_like(rows)
    room = _Scratch(scratch)
    d_weight = room.zeros(weight.shape, torch.float32, x.device) if head_grad else None
    chunk = min(chunk_rows, rows.shape[0])
    logits = room.empty((chunk, weight.shape[0]), x.dtype, x.device)
    for start in range(0, rows.shape[0], chunk_rows):
        stop = min(start + chunk_rows, rows.shape[0])
        part = slice(start, stop)
        grad = _logits_grad(mm_into(rows[part], weight.t(), logits[:stop - start])
                            if logits is not None else rows[part] @ weight.t(),
                            flat_labels[part], keep[part], inv_n, loss, ignore_index)
        mm_into(grad, weight, d_rows[part])
        if head_grad:
            _add_head_grad(d_weight, grad, rows[part])
        del grad  # else the next chunk's logits are allocated while this chunk is still held
    return loss * inv_n, d_rows.reshape(x.shape), d_weight


class _Scratch:
    """Tensors carved one after another from given bytes (uint8), or made as usual where
    none are given; None for a tensor that would not fit (`empty`)."""

    def __init__(self, raw: Tensor | None):
        self.raw, self.used = raw, 0

    def zeros(self, shape, dtype, device) -> Tensor:
        carved = self.empty(shape, dtype, device)
        return carved.zero_() if carved is not None else \
            torch.zeros(shape, dtype=dtype, device=device)

    def empty(self, shape, dtype, device) -> Tensor | None:
        if self.raw is None:
            return torch.empty(shape, dtype=dtype, device=device)
        n, start = dtype.itemsize * math.prod(shape), round_up(self.used, 256)
        if start + n > self.raw.numel() or self.raw.device != torch.device(device):
            return None
        self.used = start + n
        return self.raw[start:start + n].view(dtype).view(tuple(shape))


def inverse_count(keep: Tensor, dtype: torch.dtype, denominator=None) -> Tensor:
    """1 / what the summed loss is divided by, a device scalar (no host sync): the count
    of the kept targets (at least 1), or `denominator` (a number or a [] tensor)."""
    if denominator is None:
        return 1.0 / keep.sum().clamp(min=1).to(dtype)
    if not isinstance(denominator, Tensor):
        denominator = torch.tensor(float(denominator), dtype=dtype, device=keep.device)
    return 1.0 / denominator.to(dtype)


def logits_cross_entropy(logits: Tensor, labels: Tensor, chunk_rows: int = 2048,
                         ignore_index: int = -100, denominator=None):
    """(loss [] fp32 (float64 for float64 logits), d_logits like logits): the unfused
    path, for graphs that do not end in a head matmul. On CUDA the kernel runs once over a
    copy of all the logits, which becomes d_logits (the output's own memory: nothing else
    is allocated but the [rows] losses); elsewhere the torch path holds fp32 (float64)
    only one chunk of `chunk_rows` at a time. `denominator`: as lm_head_cross_entropy's
    (here also a number, on the CPU)."""
    V = logits.shape[-1]
    rows, flat_labels = logits.reshape(-1, V), labels.reshape(-1)
    keep = flat_labels != ignore_index
    # float64 logits (the reference runs) keep float64, as the cross_entropy kernel's
    # statistics do (and the vocab-parallel loss, runtime.kernels.vocab_parallel)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    inv_n = inverse_count(keep, compute, denominator)
    ext = _kernel_for(rows)
    if ext is not None:
        d_rows = rows.clone(memory_format=torch.contiguous_format)
        losses = ext.cross_entropy_(d_rows, flat_labels.long(), inv_n, ignore_index)
        return losses.sum() * inv_n, d_rows.reshape(logits.shape)
    loss = torch.zeros((), dtype=compute, device=logits.device)
    d_rows = torch.empty_like(rows)
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, min(start + chunk_rows, rows.shape[0]))
        d_rows[part] = _chunk(rows[part].to(compute, copy=True), flat_labels[part],
                              keep[part], inv_n, loss)
    return loss * inv_n, d_rows.reshape(logits.shape)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernel_for(logits: Tensor):
    """The CUDA extension when its cross-entropy kernel takes these logits (CUDA,
    contiguous, bf16/fp16/fp32, the extension built), else None (the torch path)."""
    if not (logits.is_cuda and logits.dtype in KERNEL_DTYPES and logits.is_contiguous()):
        return None
    return _extension()


@functools.cache
def _extension():
    try:
        from runtime.cuda.kernels import _extension as load

        return load()
    except Exception as err:  # no compiler, a failed build: the torch path still works
        warnings.warn(f"cross-entropy runs on torch ops: the CUDA extension is unavailable ({err})")
        return None


def _logits_grad(logits: Tensor, labels: Tensor, keep: Tensor, inv_n: Tensor, loss: Tensor,
                 ignore_index: int) -> Tensor:
    """This chunk's d_logits in the logits' dtype; adds its summed loss to `loss`. The
    kernel overwrites `logits` (a fresh GEMM output) with it; the torch path works on a
    fp32 copy (or in place, for fp32 logits) and casts back."""
    ext = _kernel_for(logits)
    if ext is None:
        return _chunk(logits.float(), labels, keep, inv_n, loss).to(logits.dtype)
    loss.add_(ext.cross_entropy_(logits, labels.long(), inv_n, ignore_index).sum())
    return logits


def _chunk(logits: Tensor, labels: Tensor, keep: Tensor, inv_n: Tensor, loss: Tensor) -> Tensor:
    """Adds this chunk's summed loss to `loss`; returns its d_logits (fp32, in place of
    `logits`, which must be a fresh fp32 tensor)."""
    lse = torch.logsumexp(logits, dim=-1)
    target = torch.where(keep, labels, 0).long()[:, None]
    picked = logits.gather(1, target)[:, 0]
    keep_f = keep.to(logits.dtype)
    loss.add_(((lse - picked) * keep_f).sum())
    probs = logits.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, target, -keep_f[:, None])
    return probs.mul_((keep_f * inv_n)[:, None])


_fp32_addmm = True  # False once this torch refused addmm(out_dtype=fp32) on a fp32 self


def _add_head_grad(d_weight: Tensor, grad: Tensor, rows: Tensor) -> None:
    """d_weight += grad^T @ rows, without the [V, d] product as a temporary where torch
    can: addmm in place when the dtypes match; for bf16/fp16 operands and a fp32 d_weight,
    CUDA's addmm with out_dtype=fp32 (the GEMM accumulates into d_weight in fp32), which
    torch versions before it took a fp32 `self` refuse (checked before any launch): then,
    and on CPU, the product in the operands' dtype, added."""
    global _fp32_addmm
    if grad.dtype == d_weight.dtype:
        d_weight.addmm_(grad.t(), rows)
        return
    if (_fp32_addmm and grad.is_cuda and d_weight.dtype == torch.float32
            and grad.dtype in (torch.bfloat16, torch.float16)):
        try:
            torch.addmm(d_weight, grad.t(), rows, out_dtype=torch.float32, out=d_weight)
            return
        except (RuntimeError, TypeError):
            _fp32_addmm = False
    d_weight.add_(grad.t() @ rows)


def reference_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean token cross-entropy of full logits (fp32), for tests and the unfused path."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1).long(), ignore_index=ignore_index)
