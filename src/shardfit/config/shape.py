"""StepShape: the one answer to "rows or a token budget" for everything that shapes a step's micro-batches.

Two ways to fill a step (data/batching.py):
  rows     train.micro_batch rows of data.seq_len tokens per micro-batch, train.global_batch rows per step
           (train.micro_batch 0: chosen at launch, train/trainer.py);
  budget   train.micro_batch_tokens = T: train.global_batch items per step laid into [1, T] rows, as many
           micro-batches as the step's lengths need (the same count on every rank).
The batch source, the schedule's header, the run's banner, the RL API's datum rows (rl/pack.py), the launcher's
checks and the planner ask this object instead of reading the two keys themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    budget: int  # T of a token-budget micro-batch [1, T]; 0: rows
    micro_batch: int  # rows per micro-batch (1 under a budget; 0: not chosen yet)
    seq_len: int  # data.seq_len
    global_batch: int  # rows (rows) or items (budget) per step

    @classmethod
    def of(cls, cfg) -> StepShape:
        t = cfg.train
        return cls(t.micro_batch_tokens, 1 if t.micro_batch_tokens else t.micro_batch, cfg.data.seq_len,
                   t.global_batch)

    @property
    def by_tokens(self) -> bool:
        return self.budget > 0

    @property
    def row_len(self) -> int:
        """Tokens of one row of a micro-batch: the budget, or data.seq_len."""
        return self.budget or self.seq_len

    @property
    def datum_budget(self) -> int:
        """T of the RL API's [1, T] rows of datums: the budget, else one micro-batch's tokens (seq_len x rows)."""
        return self.budget or self.seq_len * max(self.micro_batch, 1)

    def rows_per_round(self, data_ranks: int) -> int:
        """Rows one forward of every data-parallel rank reads: the unit the schedule counts passes in."""
        return data_ranks * self.micro_batch if not self.by_tokens else data_ranks

    def describe(self, accumulation: int | None) -> str:
        """The banner's words for the global batch."""
        if self.by_tokens:
            return f"global batch {self.global_batch} items in micro-batches of {self.budget:,} tokens"
        return (f"global batch {self.global_batch} x {self.seq_len} = {self.global_batch * self.seq_len:,} tokens "
                f"(micro-batch {self.micro_batch}, accumulation {accumulation})")
