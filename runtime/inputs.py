"""The inputs a training step feeds a model: the token ids and, where the model declares
them, position ids 0 .. T-1 in every row (GPT-2's learned position embeddings). A model
that takes anything else cannot be trained from a token file; `unfed` names what."""

from __future__ import annotations

import torch
from torch import Tensor

FED = ("token_ids", "position_ids")


def unfed(names: list[str]) -> list[str]:
    """The inputs a training step has no values for (token_ids itself is required)."""
    return [n for n in names if n not in FED] + ([] if "token_ids" in names else ["token_ids"])


def positions_like(tokens: Tensor) -> Tensor:
    """0 .. T-1 in each row of a [B, T] token batch, int32, contiguous."""
    rows, seq = tokens.shape
    return torch.arange(seq, dtype=torch.int32, device=tokens.device).repeat(rows, 1)


def fed_inputs(names: list[str], tokens: Tensor, positions: Tensor | None = None) -> dict:
    """Each input by name: the tokens, and positions (made from the tokens if not given)."""
    if "position_ids" not in names:
        return {"token_ids": tokens}
    return {"token_ids": tokens,
            "position_ids": positions if positions is not None else positions_like(tokens)}


def sized_inputs(names: list[str], batch: int, seq: int) -> dict:
    """Stand-in inputs of a [batch, seq] step, to build the program at those sizes."""
    return fed_inputs(names, torch.zeros(batch, seq, dtype=torch.int32))
