"""Pack documents into fixed-length sequences and hand each rank its exact share of every step.

The token stream is every document followed by EOS, concatenated. Window i covers tokens
[i*S, i*S + S] (S + 1 tokens: inputs are the first S, labels the last S), so no token is lost between windows.

Order: sample k of the run (k = step * global_batch + j) is window perm_e[k mod n] with e = k // n and perm_e a
permutation seeded by (seed, e). The position in the data is therefore just the step number: resuming at step t
reproduces exactly the batches an uninterrupted run would have seen, on any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardfit.config.loader import accumulation_steps
from shardfit.data.sources import read_documents, resolve_files
from shardfit.data.token_shards import encode_batches, join_documents, open_token_shards, shard_dir_state
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
    data.path) or holds out data.val_fraction of the training items; it is visited in order."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ShardfitError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}",
                            where="model.vocab_size", fix=f"set model.vocab_size >= {tokenizer.vocab_size}")
    if data_cfg.path and data_cfg.mode != "pretrain" and shard_dir_state(data_cfg.path) is None:
        from shardfit.data.sft import ExampleDataset, is_sft_file, read_examples
        from shardfit.data.sft_packed import PackedExamples

        files = resolve_files(data_cfg.path)
        if data_cfg.mode == "sft" or all(is_sft_file(f) for f in files):
            examples, truncated, pad = read_examples(files, data_cfg, tokenizer)
            cls = PackedExamples if data_cfg.pack and not token_budget else ExampleDataset
            make = lambda ex, trunc, where, ordered=False: cls(ex, data_cfg.seq_len, data_cfg.seed, pad,  # noqa
                                                               trunc, where, ordered)
            val = None
            if data_cfg.val_path:
                val_ex, val_trunc, _ = read_examples(resolve_files(data_cfg.val_path), data_cfg, tokenizer)
                val = make(val_ex, val_trunc, data_cfg.val_path, True)
            elif data_cfg.val_fraction > 0:
                examples, val_ex = ExampleDataset(examples, data_cfg.seq_len, data_cfg.seed, pad, 0,
                                                  str(files[0])).holdout(data_cfg.val_fraction)
                val = make(val_ex, 0, f"{files[0]} (held out)", True)
            return make(examples, truncated, str(files[0])), val, tokenizer

    def stream(path: str, where: str) -> PackedDataset:
        if shard_dir_state(path) is not None:  # `shardfit tokenize` output: memory-mapped, nothing read whole
            if data_cfg.mode == "sft":
                raise ShardfitError("token shards hold a pretraining token stream, not fine-tuning examples",
                                    where=path, fix="use data.mode=pretrain (or auto) with token shards")
            tokens, starts, _manifest = open_token_shards(path, data_cfg.tokenizer, tokenizer)
        else:
            tokens, starts = tokenize_documents(path, data_cfg.format, data_cfg.text_field, tokenizer)
        return PackedDataset(tokens, data_cfg.seq_len, data_cfg.seed, where=where,
                             doc_starts=starts if data_cfg.document_mask else None)

    train = stream(data_cfg.path, data_cfg.path or "embedded corpus")
    val = None
    if data_cfg.val_path:
        val = stream(data_cfg.val_path, data_cfg.val_path)
    elif data_cfg.val_fraction > 0:
        train, val = train.holdout(data_cfg.val_fraction)
    if val is not None:
        val.ordered = True
    return train, val, tokenizer
