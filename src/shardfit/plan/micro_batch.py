"""The largest micro-batch that fits: `shardfit plan`'s per-mode rows and `train.micro_batch=0` at start-up.

The predicted peak (estimate.py) grows with the micro-batch, so the edge is found by walking up (largest_micro_batch:
1, 2, 3, ... as far as the plan's table goes) or by a binary search over the divisors of a rank's share of the
global batch (choose_micro_batch: train needs a micro-batch that divides it; a few estimates however many divisors
there are). auto_micro_batch is what the trainer calls when train.micro_batch=0, with the device's memory: the
choice, and the line it prints, saying what freeing the gradients between steps (memory.keep_grads=false) would
allow instead when that is more. Every rank computes the same choice from the same config and world size, with no
collective: the inputs agree, and the plan is deterministic. Nothing fitting is one ShardfitError naming
train.micro_batch=0 and the settings that shrink the peak.
"""

from __future__ import annotations

import dataclasses
import math

from shardfit.config.schema import Config
from shardfit.errors import ShardfitError
from shardfit.plan.checks import check_model_sizes
from shardfit.plan.estimate import Estimate, GiB, allocation_budget, estimate, fits


def largest_micro_batch(cfg: Config, world: int, budget_bytes: float, limit: int = 64,
                        device_bytes: float | None = None, accept=None) -> Estimate | None:
    """The largest micro-batch (1, 2, 3, ...) whose predicted peak fits the budget; None if even 1 does not.
    accept(mb): whether train takes that micro-batch (table.py: it must split the global batch); others skipped."""
    best = None
    for mb in range(1, limit + 1):
        if accept is not None and not accept(mb):
            continue
        e = estimate(cfg, world, mb)
        if not fits(e, budget_bytes, device_bytes):
            break
        best = e
    return best


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt(n)) steps (a global batch of 2^40 must not mean 2^40 of them)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def choose_micro_batch(cfg: Config, world: int, budget_bytes: float, per_rank: int,
                       device_bytes: float | None = None) -> Estimate:
    """The largest divisor of the per-rank batch whose predicted peak fits (train.micro_batch=0). The peak grows with
    the micro-batch: a binary search over the divisors, a few estimates however many there are."""
    check_model_sizes(cfg)
    cands = divisors(per_rank)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        e = estimate(cfg, world, cands[mid])
        if fits(e, budget_bytes, device_bytes):
            best, lo = e, mid + 1
        else:
            hi = mid - 1
    if best is not None:
        return best
    e = estimate(cfg, world, 1)
    raise ShardfitError(f"even micro-batch 1 is predicted to need {e.peak / GiB:.1f} GiB per GPU, more than the "
                        f"{budget_bytes / GiB:.1f} GiB budget", where="train.micro_batch=0",
                        fix="set compute.activation_checkpoint=selective or full, shorten data.seq_len, or add GPUs")


def auto_micro_batch(cfg: Config, world: int, device_bytes: float, per_rank: int) -> tuple[Estimate, str]:
    """choose_micro_batch on a GPU of device_bytes, and the line the trainer prints: the choice, and what freeing the
    gradients between steps (memory.keep_grads=false) would allow instead, when that is more."""
    budget = allocation_budget(device_bytes)
    e = choose_micro_batch(cfg, world, budget, per_rank, device_bytes)
    line = (f"train.micro_batch=0: chose {e.micro_batch}, predicted peak {e.peak / GiB:.1f} GiB of a "
            f"{budget / GiB:.1f} GiB budget per GPU (shardfit plan)")
    if cfg.memory.keep_grads:
        freed = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, keep_grads=False))
        alt = choose_micro_batch(freed, world, budget, per_rank, device_bytes)
        if alt.micro_batch > e.micro_batch:
            line += (f"; with --memory.keep_grads=false {alt.micro_batch} would fit ({alt.peak / GiB:.1f} GiB), "
                     f"reserved memory then running ~1.15x allocated")
    return e, line
