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
from shardfit.data.tokenizer import build_tokenizer
from shardfit.errors import ShardfitError


def tokenize_corpus(spec: str, fmt: str, field: str, tokenizer) -> np.ndarray:
    """All documents as one uint32 token stream with EOS after each document."""
    eos = tokenizer.eos_id
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush():
        for ids in tokenizer.encode_batch(batch):
            if eos is not None:
                ids = [*ids, eos]
            parts.append(np.asarray(ids, dtype=np.uint32))
        batch.clear()

    for text, _where in read_documents(spec, fmt, field):
        if text:
            batch.append(text)
        if len(batch) >= 1024:
            flush()
    flush()
    if not parts:
        raise ShardfitError("the dataset holds no text", where=spec or "embedded corpus",
                            fix="check data.path and data.text_field")
    return np.concatenate(parts)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, S] int64
    labels: torch.Tensor  # [b, S] int64, -100 where no loss is taken


class ShuffledDataset:
    """A fixed number of items, visited in a seeded permutation per epoch. Subclasses give (inputs, labels)."""

    num_windows: int
    seed: int
    _perm_epoch: int = -1
    _perm: np.ndarray | None = None

    def _item(self, k: int) -> int:
        """Item index of sample k of the run (k counts across epochs)."""
        epoch, pos = divmod(k, self.num_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def pair(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def step_batches(self, step: int, global_batch: int, micro_batch: int, rank: int, world: int) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step `step` (0-based).

        Micro-batch m of rank r holds samples step*G + m*(world*b) + r*b + [0, b): every rank takes one slice
        of each accumulation round, and the union over ranks and rounds is exactly the step's global batch.
        """
        per_round = world * micro_batch
        out = []
        for m in range(accumulation_steps(global_batch, micro_batch, world)):
            first = step * global_batch + m * per_round + rank * micro_batch
            pairs = [self.pair(k) for k in range(first, first + micro_batch)]
            out.append(MicroBatch(torch.from_numpy(np.stack([p[0] for p in pairs]).astype(np.int64)),
                                  torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.int64))))
        return out


class PackedDataset(ShuffledDataset):
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, where: str = "dataset"):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ShardfitError(f"the dataset has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}",
                                where=where, fix="add data or lower data.seq_len")

    def _window(self, k: int) -> np.ndarray:
        start = self._item(k) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def pair(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        w = self._window(k)
        return w[:-1], w[1:]

    def samples(self, first: int, count: int) -> np.ndarray:
        """Windows first..first+count-1 of the run's sample order: [count, S + 1]."""
        return np.stack([self._window(k) for k in range(first, first + count)]).astype(np.int64)


def build_dataset(data_cfg, vocab_size: int) -> tuple[ShuffledDataset, object]:
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ShardfitError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}",
                            where="model.vocab_size", fix=f"set model.vocab_size >= {tokenizer.vocab_size}")
    if data_cfg.path and data_cfg.mode != "pretrain":
        from shardfit.data.sft import build_sft_dataset, is_sft_file

        files = resolve_files(data_cfg.path)
        if data_cfg.mode == "sft" or all(is_sft_file(f) for f in files):
            return build_sft_dataset(files, data_cfg, tokenizer), tokenizer
    tokens = tokenize_corpus(data_cfg.path, data_cfg.format, data_cfg.text_field, tokenizer)
    return PackedDataset(tokens, data_cfg.seq_len, data_cfg.seed, where=data_cfg.path or "embedded corpus"), tokenizer
