"""Training batches from a flat token file: the tokens of a corpus, concatenated, as
little-endian uint16 or uint32 (what `numpy.ndarray.tofile` writes).

The file is cut into contiguous windows of T+1 tokens that overlap by one (window i
starts at token i*T): a sample's inputs are its first T tokens, its labels the last T.
The order of the windows is a permutation per epoch drawn from the seed, so batch k is a
function of (seed, k) alone: resuming needs only the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.errors import RuntimeUserError

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def default_token_dtype(vocab_size: int | None) -> str:
    return "uint16" if vocab_size is None or vocab_size <= 65536 else "uint32"


@dataclass
class TokenData:
    path: Path
    dtype: str
    seq: int
    batch: int
    seed: int = 0
    vocab_size: int | None = None
    repeat_batch: bool = False
    tokens: np.ndarray = field(init=False, repr=False)
    _orders: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.tokens = _open(Path(self.path), self.dtype)
        need = self.batch * self.seq + 1
        if self.windows < self.batch:
            raise RuntimeUserError(
                f"{self.path} holds {len(self.tokens):,} tokens: too few for one batch of "
                f"{self.batch} x {self.seq} (+1) tokens",
                help=[f"a batch needs at least {need:,} tokens; lower --batch or --seq, or "
                      f"check --dtype-tokens (read as {self.dtype})"])
        self._check_all_ids()

    def _check_all_ids(self) -> None:
        # One vectorized pass before step 1: a bad id found lazily at batch 11 came
        # after 10 checkpoints had been saved. Unsigned storage: no id is negative.
        if self.vocab_size is None:
            return
        top = int(self.tokens.max())
        if top >= self.vocab_size:
            at = int(np.argmax(self.tokens >= self.vocab_size))
            raise RuntimeUserError(
                f"{self.path} has token id {top} (first bad id at token {at:,}), but the "
                f"model's vocab_size is {self.vocab_size}",
                help=["the file was tokenized for another vocabulary, or is read with the "
                      f"wrong --dtype-tokens (read as {self.dtype})"])

    @property
    def windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.windows, generator=generator)}
        return self._orders[epoch]

    def batch_at(self, step: int) -> torch.Tensor:
        """The windows of batch `step` (0-based): [batch, seq + 1] int64."""
        first = 0 if self.repeat_batch else step * self.batch
        rows = []
        for sample in range(first, first + self.batch):
            window = int(self.order(sample // self.windows)[sample % self.windows])
            start = window * self.seq
            rows.append(np.asarray(self.tokens[start:start + self.seq + 1], dtype=np.int64))
        out = torch.from_numpy(np.stack(rows))
        self._check_ids(out, step)
        return out

    def _check_ids(self, batch: torch.Tensor, step: int) -> None:
        if self.vocab_size is None:
            return
        top = int(batch.max())
        if top >= self.vocab_size:
            raise RuntimeUserError(
                f"batch {step + 1} of {self.path} has token id {top}, but the model's "
                f"vocab_size is {self.vocab_size}",
                help=["the file was tokenized for another vocabulary, or is read with the "
                      f"wrong --dtype-tokens (read as {self.dtype})"])


def check_batch_fits(path, dtype: str | None, seq: int, batch: int) -> None:
    """Before the model is built (its buffers are sized by batch x seq: --batch 10**12
    tried to allocate 32 TB): the file must hold `batch` windows even at the smallest
    dtype. Only batch counts here, so a too-long --seq still meets the max_seq check
    (which needs the model); TokenData checks the whole batch x seq later."""
    path = Path(path)
    have = len(_open(path, dtype or "uint16"))  # a memmap: nothing read yet
    need = batch * seq + 1
    if have < batch + 1:
        raise RuntimeUserError(
            f"{path} holds at most {have:,} tokens: too few for one batch of {batch} x "
            f"{seq} (+1) tokens", help=[f"a batch needs at least {need:,} tokens; lower "
                                        "--batch or --seq"])


def _open(path: Path, dtype: str) -> np.ndarray:
    if not path.is_file():
        where = _not_a_file(path)
        raise RuntimeUserError(f"data file {path} {where}",
                               help=["--data takes a flat file of uint16 or uint32 token ids"])
    itemsize = TOKEN_DTYPES[dtype].itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise RuntimeUserError(f"{path} is {size:,} bytes, not a whole number of {dtype} "
                               "tokens", help=["--dtype-tokens uint16|uint32 says how ids "
                                               "are stored"])
    if size == 0:
        raise RuntimeUserError(f"data file {path} is empty")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def _not_a_file(path: Path) -> str:
    """Say what a non-regular --data path is: /dev/zero or a FIFO is not "missing"."""
    if path.is_dir():
        return "is a directory"
    if not path.exists():
        return "does not exist"
    return "is not a regular file (a device, FIFO or socket)"
