"""LM head + cross-entropy, fused and in chunks of rows: never the full fp32 logits.

A language model's graph ends in `xF -> matmul(W, transpose=NT) -> logits` (W the LM head,
or the embedding when tied). For training, `split_head` cuts that node off: the entry
function returns xF instead, and the backward function starts from d_xF (its first node,
the matmul's backward, goes too, with the head's parameter gradient). Then
`lm_head_cross_entropy` computes, chunk by chunk of rows, the logits (bf16 GEMM), their
fp32 log-sum-exp, the loss and at once the gradient (softmax - onehot) / n, and from it
d_xF and d_W, so only one chunk of fp32 logits ever exists (chunk_rows x vocab).

The loss is the mean token cross-entropy over labels != ignore_index (next-token labels
are the caller's: labels[t] = token_ids[t + 1]). Nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from modulec.ir.graph import Function, Graph, ValueInfo


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
    if any(first.outputs[1] in node.inputs for node in backward.nodes[1:]):
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
                          ignore_index: int = -100, head_grad: bool = True):
    """(loss [] fp32, d_x like x, d_weight fp32 like weight) of mean cross-entropy of
    logits = x @ weight^T against labels, in chunks of `chunk_rows` rows. `head_grad=False`
    (a frozen head, LoRA): d_weight is None, neither computed nor allocated."""
    d = x.shape[-1]
    rows, flat_labels = x.reshape(-1, d), labels.reshape(-1)
    keep = flat_labels != ignore_index
    inv_n = 1.0 / keep.sum().clamp(min=1).to(torch.float32)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    d_rows = torch.empty_like(rows)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) \
        if head_grad else None
    for start in range(0, rows.shape[0], chunk_rows):
        stop = min(start + chunk_rows, rows.shape[0])
        part = slice(start, stop)
        logits = (rows[part] @ weight.t()).float()
        grad = _chunk(logits, flat_labels[part], keep[part], inv_n, loss).to(x.dtype)
        torch.mm(grad, weight, out=d_rows[part])
        if head_grad:
            d_weight.add_(grad.t() @ rows[part])
    return loss * inv_n, d_rows.reshape(x.shape), d_weight


def logits_cross_entropy(logits: Tensor, labels: Tensor, chunk_rows: int = 2048,
                         ignore_index: int = -100):
    """(loss [] fp32, d_logits like logits): the unfused path, for graphs that do not end
    in a head matmul; fp32 only one chunk at a time."""
    V = logits.shape[-1]
    rows, flat_labels = logits.reshape(-1, V), labels.reshape(-1)
    keep = flat_labels != ignore_index
    inv_n = 1.0 / keep.sum().clamp(min=1).to(torch.float32)
    loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    d_rows = torch.empty_like(rows)
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, min(start + chunk_rows, rows.shape[0]))
        d_rows[part] = _chunk(rows[part].to(torch.float32, copy=True), flat_labels[part], keep[part], inv_n, loss)
    return loss * inv_n, d_rows.reshape(logits.shape)


def _chunk(logits: Tensor, labels: Tensor, keep: Tensor, inv_n: Tensor, loss: Tensor) -> Tensor:
    """Adds this chunk's summed loss to `loss`; returns its d_logits (fp32, in place of
    `logits`, which must be a fresh fp32 tensor)."""
    lse = torch.logsumexp(logits, dim=-1)
    target = torch.where(keep, labels, 0).long()[:, None]
    picked = logits.gather(1, target)[:, 0]
    keep_f = keep.to(torch.float32)
    loss.add_(((lse - picked) * keep_f).sum())
    probs = logits.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, target, -keep_f[:, None])
    return probs.mul_((keep_f * inv_n)[:, None])


def reference_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean token cross-entropy of full logits (fp32), for tests and the unfused path."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1).long(), ignore_index=ignore_index)
