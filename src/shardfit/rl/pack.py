"""Datums -> this rank's token-budget micro-batches, and every rank's per-token outputs -> per-datum arrays.

Every rank holds the same datum list and derives the same plan with no collective: data/batching.py's assign_bins
places the datums (longest first, balanced) into dp x M bins of at most T tokens, T = train.micro_batch_tokens (or
data.seq_len x train.micro_batch), bin b going to data-parallel rank b % dp. Each bin is one [1, T] row: its datums
end to end as documents (positions restart at 0, document mask), padding at the end with coefficient 0. Under
sequence parallelism the sp ranks of a data-parallel rank share its rows and take T/sp columns each.

Outputs come back in one all-gather of [M x T/sp] values per rank (in the engine's one collective): rank r =
dp_r x sp + sp_r holds columns sp_r x T/sp .. of row m of bin (m, dp_r), so datum d at (dp_r, m, start) is read
from the gathered [world, M x T/sp] as rows[dp_r][m][start:start + L].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardfit.data.batching import assign_bins
from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum


@dataclass
class Placement:
    dp: int  # data-parallel rank
    m: int  # micro-batch
    start: int  # first column in the [1, T] row


@dataclass
class DatumPlan:
    budget: int  # T
    micro_batches: int  # M, the same on every rank
    dp: int
    sp: int
    bins: list[list[list[int]]]  # [dp][M][datum indices]
    where: list[Placement]  # per datum


def plan_datums(datums: list[Datum], budget: int, dp: int, sp: int) -> DatumPlan:
    lengths = [len(d) for d in datums]
    longest = max(lengths)
    if longest > budget:
        i = lengths.index(longest)
        raise ShardfitError(f"datum {i} has {longest:,} tokens, more than the engine's micro-batch of {budget:,}",
                            where=f"data[{i}]", fix=f"raise train.micro_batch_tokens to at least {longest} "
                            "(a multiple of parallel.sequence_parallel) or send shorter datums")
    bins = assign_bins(lengths, dp, budget)
    where: list[Placement | None] = [None] * len(datums)
    for r, rank_bins in enumerate(bins):
        for m, items in enumerate(rank_bins):
            start = 0
            for i in items:
                where[i] = Placement(r, m, start)
                start += lengths[i]
    return DatumPlan(budget, len(bins[0]), dp, sp, bins, where)


@dataclass
class DatumRow:
    """One [1, T] micro-batch of a data-parallel rank, whole (the engine cuts it for sequence parallelism)."""

    input_ids: torch.Tensor  # [1, T] int64, pad id 0 in the tail
    labels: torch.Tensor  # [1, T] int64: target tokens, -100 in the tail
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 at each datum and at the tail
    inputs: dict[str, torch.Tensor]  # [1, T] float32 per loss input (0 in the tail); "datum": index, -1 in the tail
    coef: torch.Tensor  # [1, T] float32: the loss coefficient of each token (rl/losses.py)
    real_tokens: int
    scored: torch.Tensor | None = None  # [1, T] bool: the tokens the head scores (None: all; logprobs_at=counted)


def build_row(plan: DatumPlan, datums: list[Datum], items: list[int], coefs: list[np.ndarray],
              names: set[str], scored: list[np.ndarray] | None = None) -> DatumRow:
    """The [1, T] row of the datums `items`; `scored` ([L] bool per datum, or None for every token) marks the
    tokens the output head scores."""
    T = plan.budget
    ids = np.zeros(T, dtype=np.int64)
    labels = np.full(T, -100, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    coef = np.zeros(T, dtype=np.float32)
    inputs = {k: np.zeros(T, dtype=np.float32) for k in names}
    index = np.full(T, -1, dtype=np.float32)
    score = np.zeros(T, dtype=bool) if scored is not None else None
    s = 0
    for i in items:
        d, L = datums[i], len(datums[i])
        ids[s:s + L] = d.tokens
        labels[s:s + L] = d.inputs["target_tokens"]
        pos[s:s + L] = np.arange(L)
        coef[s:s + L] = coefs[i]
        index[s:s + L] = i
        if score is not None:
            score[s:s + L] = scored[i]
        for k in names:
            inputs[k][s:s + L] = d.inputs[k]
        s += L
    pos[s:] = np.arange(T - s)  # the padded tail is a document of its own
    inputs["datum"] = index
    t = torch.from_numpy
    return DatumRow(t(ids)[None], t(labels)[None], t(pos)[None], {k: t(v)[None] for k, v in inputs.items()},
                    t(coef)[None], s, t(score)[None] if score is not None else None)


def unpack(plan: DatumPlan, datums: list[Datum], gathered: torch.Tensor) -> list[np.ndarray]:
    """gathered [world, M x T/sp] (each rank's local outputs, micro-batch after micro-batch) -> per datum [L]."""
    T, M, sp = plan.budget, plan.micro_batches, plan.sp
    local = T // sp
    g = gathered.float().numpy().reshape(plan.dp, sp, M, local)
    rows = g.transpose(0, 2, 1, 3).reshape(plan.dp, M, T)  # [dp, M, T]: the sp slices side by side
    return [rows[w.dp, w.m, w.start:w.start + len(d)].copy() for d, w in zip(datums, plan.where)]
