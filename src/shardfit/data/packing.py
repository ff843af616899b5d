"""Pack documents into fixed-length sequences and hand each rank its exact share of every step.

The token stream is every document followed by EOS, concatenated. Window i covers tokens
[i*S, i*S + S] (S + 1 tokens: inputs are the first S, labels the last S), so no token is lost between windows.

Order: sample k of the run (k = step * global_batch + j) is window perm_e[k mod n] with e = k // n and perm_e a
permutation seeded by (seed, e). The position in the data is therefore just the step number: resuming at step t
reproduces exactly the batches an uninterrupted run would have seen, on any world size.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardfit.config.loader import accumulation_steps
from shardfit.data.sources import is_sft_file, read_documents, resolve_files
from shardfit.data.token_shards import (
    check_token_ids,
    encode_batches,
    join_documents,
    open_token_shards,
    shard_dir_state,
)
from shardfit.data.tokenizer import build_tokenizer
from shardfit.errors import ShardfitError


def tokenize_documents(spec: str, fmt: str, field: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one uint32 token stream with EOS after each document, and the offset of each document's
    first token in it (int64, ascending): where document masking starts a new document. `shardfit tokenize` writes
    the same stream to disk (data/token_shards.py), through the same encode_batches."""
    texts = (text for text, _where in read_documents(spec, fmt, field))
    parts = [ids for batch in encode_batches(texts, tokenizer) for ids in batch]
    if not parts:
        raise ShardfitError("the dataset holds no text", where=spec or "embedded corpus",
                            fix="check data.path and data.text_field")
    return join_documents(parts, np.uint32)


def tokenize_corpus(spec: str, fmt: str, field: str, tokenizer) -> np.ndarray:
    """The token stream of tokenize_documents alone."""
    return tokenize_documents(spec, fmt, field, tokenizer)[0]


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
    notices: tuple[str, ...] = ()  # the training set's start-up lines about its data (set by build_datasets)
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


def build_dataset(data_cfg, vocab_size: int, token_budget: bool = False) -> tuple[ShuffledDataset, object]:
    """The training set alone (see build_datasets)."""
    train, _val, tokenizer = build_datasets(data_cfg, vocab_size, token_budget)
    return train, tokenizer


def build_datasets(data_cfg, vocab_size: int,
                   token_budget: bool = False) -> tuple[ShuffledDataset, ShuffledDataset | None, object]:
    """(training set, validation set or None, tokenizer).

    Fine-tuning items are examples: packed into rows (data.pack), one padded example per row, or, for token-budget
    micro-batches, unpadded examples that the batcher lays end to end. Pretraining items are windows of the token
    stream, with document starts when data.document_mask is on. Validation comes from data.val_path (read like
    data.path) or holds out data.val_fraction of the training items; it is visited in order. Token ids beyond
    vocab_size, and a validation set inside the training set, are refused; the training set's `notices` are the
    start-up lines about examples left out and validation items also in training (the trainer prints them)."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ShardfitError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}",
                            where="model.vocab_size", fix=f"set model.vocab_size >= {tokenizer.vocab_size}")
    if data_cfg.val_path and same_files(data_cfg.path, data_cfg.val_path):
        raise ShardfitError(f"names the same files as data.path ({data_cfg.path}): the validation loss would "
                            "measure the training data", where="data.val_path",
                            fix="give held-out files, or data.val_fraction to hold out part of data.path")
    if data_cfg.path and data_cfg.mode != "pretrain" and shard_dir_state(data_cfg.path) is None:
        from shardfit.data.sft import ExampleDataset, dropped_notice, read_examples
        from shardfit.data.sft_packed import PackedExamples

        files = resolve_files(data_cfg.path)
        if data_cfg.mode == "sft" or all(is_sft_file(f) for f in files):
            notices: list[str | None] = []

            def read(spec: str, spec_files: list[Path]):
                found = read_examples(spec_files, data_cfg, tokenizer, spec)
                check_token_ids(max((int(ids.max()) for ids, _ in found.examples), default=-1), vocab_size, spec)
                notices.append(dropped_notice(found.dropped, len(found.examples), data_cfg.seq_len, spec))
                return found

            got = read(data_cfg.path, files)
            cls = PackedExamples if data_cfg.pack and not token_budget else ExampleDataset
            make = lambda ex, trunc, where, ordered=False: cls(ex, data_cfg.seq_len, data_cfg.seed, got.pad,  # noqa
                                                               trunc, where, ordered)
            examples, val = got.examples, None
            if data_cfg.val_path:
                val_got = read(data_cfg.val_path, resolve_files(data_cfg.val_path))
                notices.append(overlap_notice([ids for ids, _ in examples], [ids for ids, _ in val_got.examples],
                                              "example"))
                val = make(val_got.examples, val_got.truncated, data_cfg.val_path, True)
            elif data_cfg.val_fraction > 0:
                examples, val_ex = ExampleDataset(examples, data_cfg.seq_len, data_cfg.seed, got.pad, 0,
                                                  str(files[0])).holdout(data_cfg.val_fraction)
                val = make(val_ex, 0, f"{files[0]} (held out)", True)
            train = make(examples, got.truncated, str(files[0]))
            train.notices = tuple(n for n in notices if n)
            return train, val, tokenizer

    def stream(path: str, where: str) -> tuple[PackedDataset, list[np.ndarray] | None]:
        """The dataset, and its documents when read from text (None for memory-mapped token shards)."""
        if shard_dir_state(path) is not None:  # `shardfit tokenize` output: memory-mapped, nothing read whole
            if data_cfg.mode == "sft":
                raise ShardfitError("token shards hold a pretraining token stream, not fine-tuning examples",
                                    where=path, fix="use data.mode=pretrain (or auto) with token shards")
            tokens, starts, _manifest = open_token_shards(path, data_cfg.tokenizer, tokenizer, vocab_size)
            docs = None
        else:
            tokens, starts = tokenize_documents(path, data_cfg.format, data_cfg.text_field, tokenizer)
            check_token_ids(int(tokens.max()), vocab_size, where)  # in memory already: one pass, no copy
            docs = np.split(tokens, starts[1:]) if data_cfg.val_path else None  # views, for the overlap check
        return PackedDataset(tokens, data_cfg.seq_len, data_cfg.seed, where=where,
                             doc_starts=starts if data_cfg.document_mask else None), docs

    train, train_docs = stream(data_cfg.path, data_cfg.path or "embedded corpus")
    val, notices = None, []
    if data_cfg.val_path:
        val, val_docs = stream(data_cfg.val_path, data_cfg.val_path)
        if train_docs is not None and val_docs is not None:  # shards: compared by path above, not read whole
            notices.append(overlap_notice(train_docs, val_docs, "document"))
    elif data_cfg.val_fraction > 0:
        train, val = train.holdout(data_cfg.val_fraction)
    if val is not None:
        val.ordered = True
    train.notices = tuple(n for n in notices if n)
    return train, val, tokenizer


def same_files(a: str, b: str) -> bool:
    """Whether two data specs name the same files (or the same shard directory), however they are spelled."""
    def files(spec: str) -> set[str]:
        if not spec or shard_dir_state(spec) is not None:
            return {os.path.realpath(spec)} if spec else set()
        try:
            return {os.path.realpath(f) for f in resolve_files(spec)}
        except ShardfitError:
            return set()  # reported with its reason when the data set is read
    return bool(a) and bool(b) and files(a) == files(b) != set()


def overlap_notice(train: list[np.ndarray], val: list[np.ndarray], unit: str) -> str | None:
    """Refuse a validation set whose every item is also a training item (by a hash of its tokens); a notice with
    the count when some are; None when none are."""
    def digest(ids: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()

    seen = {digest(ids) for ids in train}
    shared = sum(digest(ids) in seen for ids in val)
    if val and shared == len(val):
        raise ShardfitError(f"every one of the {len(val):,} validation {unit}s is also a training {unit}: the "
                            "validation loss would measure the training data", where="data.val_path",
                            fix="give held-out data, or data.val_fraction to hold out part of data.path")
    if shared:
        return (f"data.val_path: {shared:,} of {len(val):,} validation {unit}s are also in the training data "
                "(their loss is not held out)")
    return None
