"""What a pass and an optimizer step return (engine/engine.py): the stats rows of the pass's one collective, read
the same way on every rank, and the step's record."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardfit.errors import ShardfitError

# the stats columns of a pass's collective (float64), then MEMORY_FIELDS, the expert load [L*E], the outputs;
# _INPUT: the caller's fingerprint of what it passed (rl/step.py: every rank must pass the same datums), or -1
_SQNORM, _LOSS, _TOKENS, _NONFINITE, _REAL, _STOP, _INPUT, _MEM = 0, 1, 2, 3, 4, 5, 6, 7


class OutOfMemory(ShardfitError):
    """A CUDA OOM on this rank in a pass: the snapshot is dumped (a caller set `recorder`) and the doctor's verdict
    is in the message."""

    exit_code = 4


@dataclass
class StepStats:
    """One pass's result, the same on every rank (from its one collective)."""

    rows: torch.Tensor  # [world, k] float64 on the host: each rank's stats, memory and expert load
    capacity: int  # C: this rank's tokens of the pass, padding included
    mean_over_tokens: bool  # the loss's normalisation (engine/losses.py)
    outputs: torch.Tensor | None = None  # [world, n_outputs, M x local] fp32: every rank's per-token outputs
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (train.timing), rank 0's view

    @property
    def loss_sum(self) -> float:
        return float(self.rows[:, _LOSS].sum())

    @property
    def loss_tokens(self) -> float:
        return float(self.rows[:, _TOKENS].sum())

    @property
    def non_finite_ranks(self) -> list[int]:
        return [r for r in range(self.rows.shape[0]) if self.rows[r, _NONFINITE] > 0]


def fold_first_mean(pending: list[StepStats], grads: list[torch.Tensor]) -> None:
    """The first pending pass a mean over tokens (its N known now): its factor C / N multiplied into `grads` (the
    local gradients it left), so that every pending gradient is a coefficient loss's (engine/engine.py)."""
    first = pending[0]
    if first.mean_over_tokens:
        n = first.loss_tokens
        factor = first.capacity / n if n > 0 else 0.0
        if grads:
            torch._foreach_mul_(grads, factor)
        first.mean_over_tokens, first.capacity = False, 1


@dataclass
class StepRecord:
    """What one optimizer step did (optim_step's result): the figures a log line or a caller needs."""

    step: int
    loss: float  # mean token loss over the global batch (a mean_over_tokens loss), else the summed loss
    grad_norm: float
    lr: float
    skipped: bool
    bad_ranks: list[int]  # ranks whose loss was not finite
    no_tokens: bool
    capacity: int
    loss_tokens: float  # of the world
    real_tokens: float  # of the world, padding excluded
    memory: torch.Tensor  # [world, len(MEMORY_FIELDS)]
    moe: dict
    phases: dict[str, float]
    time_s: float = 0.0
    stop: int = 0  # a signal any rank received before this step's stats collective (0: none): every rank stops
    stop_ranks: list[int] = field(default_factory=list)  # the ranks that received it
    # functions torch.compile gave up on (ran eager past recompile_limit) in this rank's process so far; a benchmark
    # asserts 0 (parallel/compile_watch.py)
    compile_fallbacks: int = 0
