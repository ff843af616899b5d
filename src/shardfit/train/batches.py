"""The data side of a step: this rank's micro-batches from the training data, as the Engine's PackedBatch (the
document mask and the sequence-parallel cut: engine/batch.py pack_local, on the host, outside any checkpointed or
compiled region).

Two ways to fill a step (config/shape.py StepShape; both give every rank the same number of micro-batches, see
data/batching.py): rows of data.seq_len (packed pretraining windows, packed or padded fine-tuning examples), or
items laid into [1, T] token-budget rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shardfit.config import Config
from shardfit.config.shape import StepShape
from shardfit.data.batching import budget_batches, eval_row_batches
from shardfit.data.dataset import MicroBatch, ShuffledDataset
from shardfit.engine.batch import PackedBatch, pack_local
from shardfit.models.attention import choose_doc_kernel


class BatchSource:
    def __init__(self, cfg: Config, train: ShuffledDataset, val: ShuffledDataset | None, dp_rank: int,
                 dp_size: int, sp_rank: int, sp: int, device: torch.device):
        self.cfg, self.train, self.val = cfg, train, val
        self.dp_rank, self.dp_size, self.sp_rank, self.sp = dp_rank, dp_size, sp_rank, sp
        self.device = device
        self.budget = StepShape.of(cfg).budget
        self.masked = cfg.data.document_mask
        fp32 = cfg.compute.param_dtype == "float32"  # "auto" computes in bf16 on CUDA (parallel.mixed_precision)
        self.kernel = choose_doc_kernel(cfg.compute.doc_attention, device, self.budget or cfg.data.seq_len,
                                        torch.float32 if fp32 else torch.bfloat16)

    def step(self, step: int) -> list[PackedBatch]:
        t = self.cfg.train
        if self.budget:
            mbs = list(budget_batches(self.train, step * t.global_batch, t.global_batch, self.budget, self.dp_rank,
                                      self.dp_size))
        else:
            mbs = self.train.step_batches(step, t.global_batch, t.micro_batch, self.dp_rank, self.dp_size)
        return [self._local(mb) for mb in mbs]

    def validation(self) -> Iterator[PackedBatch]:
        """The whole validation set (or train.eval_batches micro-batches of it), the same count on every rank, one
        micro-batch (and its document mask) at a time as evaluate() iterates."""
        limit = self.cfg.train.eval_batches
        if self.budget:
            mbs = budget_batches(self.val, 0, self.val.num_windows, self.budget, self.dp_rank, self.dp_size, limit)
        else:
            mbs = eval_row_batches(self.val, self.cfg.train.micro_batch, self.dp_rank, self.dp_size, limit)
        return (self._local(mb) for mb in mbs)

    def _local(self, mb: MicroBatch) -> PackedBatch:
        # Token-budget rows are always masked: their examples are unrelated (data.document_mask governs packed
        # pretraining windows, where attention across documents was shardfit 0.1's behaviour).
        positions = mb.position_ids if self.masked or self.budget else None
        return pack_local(mb.input_ids, mb.labels, positions, mb.real_tokens, self.kernel, self.device, self.sp_rank,
                          self.sp)

    def describe(self) -> str | None:
        """The start-up line about how examples became rows (fine-tuning), or None; truncation has its own line
        (data/build.py)."""
        ds = self.train
        if not hasattr(ds, "examples"):
            return None
        n = len(ds.examples)
        if self.budget:
            return (f"fine-tuning: {n:,} examples in token-budget micro-batches of {self.budget:,} tokens, "
                    f"{self.cfg.train.global_batch} examples per step")
        if hasattr(ds, "fill"):
            return (f"fine-tuning: {n:,} examples packed into {ds.num_windows:,} rows of {ds.seq_len} tokens "
                    f"(epoch 0), fill {ds.fill:.1%}, document-masked: {self.masked}")
        mean_fill = sum(ds.item_length(k) for k in range(min(n, 4096))) / (min(n, 4096) * ds.seq_len)
        return f"fine-tuning: {n:,} examples, one padded example per row, fill {mean_fill:.1%}"
