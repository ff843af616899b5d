"""The base of every data set: items, the seeded order of a run, and a step's rows for each rank.

ShuffledDataset is what the batcher and the trainer see: a number of items (packed windows, fine-tuning examples),
a permutation per epoch seeded by (seed, epoch), and each step's micro-batches for one data-parallel rank. The
position in the data is the step number alone, so a resumed run sees what an uninterrupted one would have.
The pretraining stream (packing.py) and the fine-tuning sets (sft.py, sft_packed.py) derive from it; build.py picks
one from the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shardfit.config.loader import accumulation_steps


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, S] int64
    labels: torch.Tensor  # [b, S] int64, -100 where no loss is taken
    position_ids: torch.Tensor | None = None  # [b, S] int64, 0 where a document starts; None: 0..S-1 in every row
    real_tokens: int = 0  # tokens that are not padding (host count)


def stack_rows(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, int]]) -> MicroBatch:
    """Rows (inputs [S], labels [S], positions [S] or None, real tokens) of one length into a MicroBatch. Position
    ids are kept when any row has them (rows without get 0..S-1); whether a mask is needed at all is decided by
    DocumentMask.build (a micro-batch whose rows are each one document needs none)."""
    S = len(rows[0][0])
    pos = None
    if any(r[2] is not None for r in rows):
        pos = torch.from_numpy(np.stack([r[2] if r[2] is not None else np.arange(S) for r in rows]).astype(np.int64))
    return MicroBatch(torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64)),
                      torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.int64)), pos,
                      sum(r[3] for r in rows))


class ShuffledDataset:
    """A fixed number of items, visited in a seeded permutation per epoch (or in order, for validation). Subclasses
    give each item as a padded row (`row`) and unpadded (`item`, for token-budget micro-batches)."""

    num_windows: int
    seed: int
    seq_len: int
    ordered: bool = False  # validation: items in their own order, every epoch
    pad_id: int = 0  # the input id of padding (labels -100 there)
    header: tuple[str, ...] = ()  # the training set's start-up lines: format, chat template, truncation (build.py)
    notices: tuple[str, ...] = ()  # and about examples left out, validation items in training (build_datasets)
    info: dict | None = None  # the training set's record format and the chat template applied (build_datasets)
    _perm_epoch: int = -1
    _perm: np.ndarray | None = None

    def _item(self, k: int) -> int:
        """Item index of sample k of the run (k counts across epochs)."""
        epoch, pos = divmod(k, self.num_windows)
        if self.ordered:
            return pos
        if epoch != self._perm_epoch:
            # Generator.permutation(n) is arange(n) shuffled; shuffling an int32 arange in place draws the same
            # swaps (they depend on the length only), so the order is unchanged and the array is half the size:
            # 33 MB instead of 66 MB per rank for 8.2M windows (2B tokens at seq_len 256).
            perm = np.arange(self.num_windows, dtype=np.int32 if self.num_windows < 2**31 else np.int64)
            np.random.default_rng([self.seed, epoch]).shuffle(perm)
            self._perm = perm
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def items_in(self, epochs: float) -> int:
        """Items in the first `epochs` passes over the data (a fraction of the last pass rounded up)."""
        return math.ceil(round(epochs * self.num_windows, 6))

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """Sample k as one row of seq_len: (inputs, labels, position ids or None, real tokens)."""
        raise NotImplementedError

    def pair(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.row(k)[:2]

    def item(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample k unpadded: (inputs [L], labels [L], positions [L]) with L = item_length(k)."""
        inputs, labels, pos, real = self.row(k)
        return inputs[:real], labels[:real], (pos if pos is not None else np.arange(len(inputs)))[:real]

    def item_length(self, k: int) -> int:
        return self.row(k)[3]

    def step_batches(self, step: int, global_batch: int, micro_batch: int, rank: int, world: int) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step `step` (0-based).

        Micro-batch m of rank r holds samples step*G + m*(world*b) + r*b + [0, b): every rank takes one slice
        of each accumulation round, and the union over ranks and rounds is exactly the step's global batch.
        """
        per_round = world * micro_batch
        out = []
        for m in range(accumulation_steps(global_batch, micro_batch, world)):
            first = step * global_batch + m * per_round + rank * micro_batch
            out.append(stack_rows([self.row(k) for k in range(first, first + micro_batch)]))
        return out
