"""cross_entropy (not in spec §6; decisions.md "Primitives not in spec §6").

lse[t] = log sum_v exp(logits[t, v]); loss[t] = lse[t] - logits[t, labels[t]], 0 where
labels[t] == ignore_index. loss and lse are statistics (fp32; float64 under float64
logits). d_logits = d_loss * (softmax(logits) - onehot(labels)), 0 on ignored rows.
"""

from __future__ import annotations

import torch

from runtime.kernels.base import register


def _cross_entropy_backward(d_loss, logits, labels, lse, *, ignore_index=-100, **_):
    keep = labels != ignore_index
    target = torch.where(keep, labels, 0).long()
    onehot = torch.zeros_like(logits).scatter(-1, target[..., None], 1.0)
    d_logits = d_loss[..., None] * (torch.exp(logits - lse[..., None]) - onehot)
    return [d_logits * keep[..., None].to(logits.dtype)]


@register("cross_entropy", ("logits", "labels"), ("loss", "lse"),
          ("d_loss", "logits", "labels", "lse"), ("d_logits",),
          backward=_cross_entropy_backward, stats=("loss", "lse", "d_loss"))
def _cross_entropy_forward(logits, labels, *, ignore_index=-100, **_):
    m = logits.amax(-1, keepdim=True)
    lse = (m + torch.log(torch.exp(logits - m).sum(-1, keepdim=True))).squeeze(-1)
    keep = labels != ignore_index
    target = torch.where(keep, labels, 0).long()
    picked = torch.gather(logits, -1, target[..., None]).squeeze(-1)
    return [torch.where(keep, lse - picked, torch.zeros_like(lse)), lse]
