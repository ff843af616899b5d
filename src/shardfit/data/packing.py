"""The pretraining stream: documents packed into fixed-length windows (the order of a run: data/dataset.py).

The token stream is every document followed by EOS, concatenated. Window i covers tokens
[i*S, i*S + S] (S + 1 tokens: inputs are the first S, labels the last S), so no token is lost between windows.

Order: sample k of the run (k = step * global_batch + j) is window perm_e[k mod n] with e = k // n and perm_e a
permutation seeded by (seed, e). The position in the data is therefore just the step number: resuming at step t
reproduces exactly the batches an uninterrupted run would have seen, on any world size.
"""

from __future__ import annotations

import numpy as np

from shardfit.data.dataset import ShuffledDataset
from shardfit.data.sources import read_documents
from shardfit.data.token_shards import (
    encode_batches,
    join_documents,
)
from shardfit.errors import ShardfitError


def tokenize_documents(spec: str, fmt: str, field: str, tokenizer,
                       unknown: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one uint32 token stream with EOS after each document, and the offset of each document's
    first token in it (int64, ascending): where document masking starts a new document. `shardfit tokenize` writes
    the same stream to disk (data/token_shards.py), through the same encode_batches. fmt: the file format; unknown:
    that of files with other extensions (sources.read_documents)."""
    texts = (text for text, _where in read_documents(spec, fmt, field, unknown))
    parts = [ids for batch in encode_batches(texts, tokenizer) for ids in batch]
    if not parts:
        raise ShardfitError("the dataset holds no text", where=spec or "embedded corpus",
                            fix="check data.path and data.text_field")
    return join_documents(parts, np.uint32)


def tokenize_corpus(spec: str, fmt: str, field: str, tokenizer) -> np.ndarray:
    """The token stream of tokenize_documents alone."""
    return tokenize_documents(spec, fmt, field, tokenizer)[0]


class PackedDataset(ShuffledDataset):
    """Windows of seq_len + 1 tokens cut from the token stream. With doc_starts (document masking) each window also
    carries position ids that restart at every document start inside it (and at the window's first token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, where: str = "dataset",
                 doc_starts: np.ndarray | None = None, windows: np.ndarray | None = None):
        self.tokens, self.seq_len, self.seed, self.doc_starts = tokens, seq_len, seed, doc_starts
        total = (len(tokens) - 1) // seq_len
        if total < 1:
            raise ShardfitError(f"the dataset has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}",
                                where=where, fix="add data or lower data.seq_len")
        # The windows this dataset visits. A range, not an array: at 2B tokens and seq_len 256 an arange would be
        # 7.8M int64 = 62 MB per rank for nothing; a range slices (holdout) and indexes like one.
        self.windows = range(total) if windows is None else windows
        self.n_tokens = len(tokens)  # the start-up line's size
        self.num_windows = len(self.windows)
        self.where = where

    def _window(self, k: int) -> tuple[int, np.ndarray]:
        start = int(self.windows[self._item(k)]) * self.seq_len
        return start, self.tokens[start:start + self.seq_len + 1]

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        start, w = self._window(k)
        return w[:-1], w[1:], self._positions(start), self.seq_len

    def _positions(self, start: int) -> np.ndarray | None:
        """Position of each of the window's tokens in its document (the window's first token counts as a start)."""
        if self.doc_starts is None:
            return None
        t = start + np.arange(self.seq_len)
        last = np.searchsorted(self.doc_starts, t, side="right") - 1  # the document each token belongs to
        return t - np.maximum(self.doc_starts[np.maximum(last, 0)], start)

    def samples(self, first: int, count: int) -> np.ndarray:
        """Windows first..first+count-1 of the run's sample order: [count, S + 1]."""
        return np.stack([self._window(k)[1] for k in range(first, first + count)]).astype(np.int64)

    def holdout(self, fraction: float) -> tuple[PackedDataset, PackedDataset]:
        """(training, validation): the last `fraction` of the windows (the end of the corpus) are held out."""
        n_val = max(1, int(round(self.num_windows * fraction)))
        if n_val >= self.num_windows:
            raise ShardfitError(f"data.val_fraction={fraction} leaves no training window of {self.num_windows}",
                                where="data.val_fraction", fix="use a smaller fraction")
        make = lambda w: PackedDataset(self.tokens, self.seq_len, self.seed, self.where, self.doc_starts, w)  # noqa
        return make(self.windows[:-n_val]), make(self.windows[-n_val:])
