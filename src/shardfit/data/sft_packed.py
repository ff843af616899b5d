"""Packed fine-tuning: examples laid end to end in rows of seq_len tokens, each a document of its own.

A 600-token chat padded to a 4096-token row spends 85% of the row on padding; packed, a row holds several
examples and padding only at its tail. With document masking (models/attention.py) each example attends only to
itself and its positions start at 0, so a packed row trains each example exactly as it would train alone (tested).

Rows are made per epoch: the epoch's examples in a permutation seeded by (data.seed, epoch), placed first-fit into
the open rows (at most OPEN_ROWS of them; the fullest is closed when one more would open). The packing therefore
depends only on (seed, epoch), and sample k of the run is row k of the concatenated epochs: resuming at step t
reproduces exactly the rows an uninterrupted run would have seen.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from shardfit.data.dataset import ShuffledDataset
from shardfit.data.sft import IGNORE, Truncation, example_tokens

OPEN_ROWS = 64  # first-fit over this many partly filled rows: rows nearly full on skewed lengths, O(1) numpy each


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Indices into `lengths` grouped into rows of at most `capacity` tokens, first-fit over the open rows, in the
    order given (each length <= capacity)."""
    rows: list[list[int]] = []
    open_rows: list[int] = []  # indices into rows
    fills = np.zeros(0, dtype=np.int64)  # fill of each open row
    for i, n in enumerate(lengths.tolist()):
        fits = np.flatnonzero(fills + n <= capacity)
        if len(fits):
            j = int(fits[0])
            rows[open_rows[j]].append(i)
            fills[j] += n
        else:
            if len(open_rows) == OPEN_ROWS:  # close the fullest: it has the least room left to fill
                j = int(np.argmax(fills))
                open_rows.pop(j)
                fills = np.delete(fills, j)
            rows.append([i])
            open_rows.append(len(rows) - 1)
            fills = np.append(fills, n)
            j = len(open_rows) - 1
        if fills[j] == capacity:
            open_rows.pop(j)
            fills = np.delete(fills, j)
    return rows


class PackedExamples(ShuffledDataset):
    """Rows of packed examples; `num_windows` and `fill` describe epoch 0 (the start-up report)."""

    def __init__(self, examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, seed: int, pad_id: int,
                 where: str, ordered: bool = False):
        from shardfit.errors import ShardfitError

        if not examples:
            raise ShardfitError("no fine-tuning examples", where=where, fix="check data.path")
        self.examples, self.seq_len, self.seed, self.pad_id = examples, seq_len, seed, pad_id
        self.where, self.ordered = where, ordered
        self.truncation = Truncation.of(examples, seq_len)
        self.truncated = self.truncation.examples
        self.lengths = np.array([min(len(ids) - 1, seq_len) for ids, _ in examples], dtype=np.int64)
        self.n_tokens = self.truncation.kept  # the start-up line's size: tokens after truncation
        # Rows (example indices) of the two epochs used last: packing depends only on (seed, epoch), so an epoch
        # is repacked when asked again instead of every epoch's rows being kept for the whole run.
        self._rows: dict[int, list[list[int]]] = {}
        self._ends: list[int] = []  # rows in epochs 0..e together
        self.num_windows = len(self._epoch_rows(0))
        self.fill = float(self.lengths.sum()) / (self.num_windows * seq_len)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        rows = self._rows.get(epoch)
        if rows is None:
            order = (np.arange(len(self.examples)) if self.ordered
                     else np.random.default_rng([self.seed, epoch]).permutation(len(self.examples)))
            rows = [[int(order[i]) for i in row] for row in pack_rows(self.lengths[order], self.seq_len)]
            self._rows[epoch] = rows
            while len(self._rows) > 2:
                self._rows.pop(next(iter(self._rows)))  # the oldest entry
        return rows

    def _count_epochs(self, n: int) -> None:
        """Row counts of epochs 0..n-1 in _ends (each epoch packed once more if not counted yet)."""
        while len(self._ends) < n:
            e = len(self._ends)
            self._ends.append((self._ends[-1] if self._ends else 0) + len(self._epoch_rows(e)))

    def items_in(self, epochs: float) -> int:
        """Rows in the first `epochs` passes: each pass packs its own permutation, so the passes' row counts differ
        a little; a fraction of the last pass is rounded up."""
        full = math.floor(round(epochs, 9))
        self._count_epochs(full + 1)
        before = self._ends[full - 1] if full else 0
        return before + math.ceil(round((epochs - full) * (self._ends[full] - before), 6))

    def _locate(self, k: int) -> list[int]:
        """Example indices of row k of the run."""
        while not self._ends or k >= self._ends[-1]:
            self._count_epochs(len(self._ends) + 1)
        epoch = bisect.bisect_right(self._ends, k)
        return self._epoch_rows(epoch)[k - (self._ends[epoch - 1] if epoch else 0)]

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        parts = [example_tokens(*self.examples[i], self.seq_len) for i in self._locate(k)]
        return concat_documents(parts, self.seq_len, self.pad_id)


def concat_documents(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], length: int,
                     pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Documents (inputs, labels, positions) end to end in one row of `length`: (inputs, labels, positions, real
    tokens). The padded tail is a document of its own (positions from 0, labels -100), so it never joins the last
    document's attention."""
    real = sum(len(p[0]) for p in parts)
    tail = length - real
    inputs = np.concatenate([p[0] for p in parts] + [np.full(tail, pad_id, dtype=np.int64)])
    labels = np.concatenate([p[1] for p in parts] + [np.full(tail, IGNORE, dtype=np.int64)])
    positions = np.concatenate([p[2] for p in parts] + [np.arange(tail)])
    return inputs.astype(np.int64), labels.astype(np.int64), positions.astype(np.int64), real
