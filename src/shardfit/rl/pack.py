"""Datums -> this rank's token-budget micro-batches, and every rank's per-token outputs -> per-datum arrays.

Every rank holds the same datum list and derives the same plan with no collective: data/batching.py's assign_bins
places the datums (longest first, balanced) into dp x M bins of at most T tokens, T = train.micro_batch_tokens (or
data.seq_len x train.micro_batch), bin b going to data-parallel rank b % dp. Each bin is one [1, T] row: its datums
end to end as documents (positions restart at 0, document mask), padding at the end with coefficient 0. Under
sequence parallelism the sp ranks of a data-parallel rank share its rows and take T/sp columns each.

Datums that begin with the same tokens (a preference pair's prompt, an RL group's rollouts of one prompt) may be
planned as one prefix tree (`trees`, rl/prefix_trees.py; models/attention.py "Branches"): the trunk's tokens once,
then each datum's remainder with its RoPE positions continuing the trunk's; a datum's outputs are then read from the
trunk's columns and its branch's. A trunk token carries no loss for any of its datums (shared_prefix ends it at the
first counted token), so computing it once changes no gradient: each datum sees the same keys it sees alone.

Each row becomes the Engine's PackedBatch (engine/batch.py: the document mask built from the whole row, then the
sequence-parallel cut). Outputs come back in one all-gather of [M x T/sp] values per rank (in the Engine's one
collective of the pass): rank r =
dp_r x sp + sp_r holds columns sp_r x T/sp .. of row m of bin (m, dp_r), so datum d at (dp_r, m, start) is read
from the gathered [world, M x T/sp] as rows[dp_r][m][start:start + L].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardfit.data.batching import assign_bins
from shardfit.engine.batch import LazyBatches, PackedBatch, pack_local
from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum


@dataclass
class Placement:
    dp: int  # data-parallel rank
    m: int  # micro-batch
    start: int  # first column in the [1, T] row of the datum's first token not in a trunk
    trunk: int = 0  # its first `trunk` tokens are the shared ones at columns trunk_start ..
    trunk_start: int = 0
    branch: int = 0  # with a trunk: 1 for the tree's first datum, 2 for its second, ... (models/attention.py's ids)

    def columns(self, length: int) -> np.ndarray:
        """[length]: the row's column of each of the datum's tokens."""
        return np.concatenate([np.arange(self.trunk_start, self.trunk_start + self.trunk),
                               np.arange(self.start, self.start + length - self.trunk)])


@dataclass
class DatumPlan:
    budget: int  # T
    micro_batches: int  # M, the same on every rank
    dp: int
    sp: int
    bins: list[list[list[int]]]  # [dp][M][datum indices]
    where: list[Placement]  # per datum
    branched: bool = False  # planned with `trees`: every row carries branch ids (all 0 where it holds no tree)


def plan_datums(datums: list[Datum], budget: int, dp: int, sp: int, pairs: bool = False,
                trees: list[tuple[int, int]] | None = None) -> DatumPlan:
    """pairs: datums 2k and 2k + 1 are one item of the packer (a preference pair, engine/preference.py): the same
    row, end to end, never split across rows or ranks. trees: the datums as consecutive groups (count, trunk), in
    order, each one item of the packer; a group with trunk t > 0 is one prefix tree whose datums share their first t
    tokens, laid once (rl/prefix_trees.py decides them; given, even without a trunk, the rows carry branch ids, so
    that every micro-batch of a pass that may share builds the same kind of mask). None: pairs of (2, 0), or every
    datum alone."""
    lengths = [len(d) for d in datums]
    shared = trees is not None
    if trees is None:
        g = 2 if pairs else 1
        trees = [(g, 0)] * (len(lengths) // g)
    firsts = np.cumsum([0] + [c for c, _ in trees])[:-1].tolist()  # each group's first datum
    items = [sum(lengths[f:f + c]) - (c - 1) * t for (c, t), f in zip(trees, firsts)]
    longest = max(items)
    if longest > budget:
        k = items.index(longest)
        i, c = firsts[k], trees[k][0]
        what = f"pair {i // 2} (datums {i} and {i + 1})" if pairs else f"datum {i}" if c == 1 else \
            f"datums {i}-{i + c - 1} (sharing their first {trees[k][1]} tokens)"
        raise ShardfitError(f"{what} has {longest:,} tokens, more than the engine's micro-batch of {budget:,}",
                            where=f"data[{i}]", fix=f"raise train.micro_batch_tokens to at least {longest} "
                            "(a multiple of parallel.sequence_parallel) or send shorter datums")
    bins = [[[firsts[k] + j for k in b for j in range(trees[k][0])] for b in rank_bins]
            for rank_bins in assign_bins(items, dp, budget)]
    group = [k for k, (c, _) in enumerate(trees) for _ in range(c)]  # each datum's group
    where: list[Placement | None] = [None] * len(datums)
    for r, rank_bins in enumerate(bins):
        for m, items in enumerate(rank_bins):
            start = 0
            for i in items:
                k = group[i]
                t, j = trees[k][1], i - firsts[k]  # j: the datum's branch in its tree, from 0
                if t and j == 0:  # the tree's first datum lays the trunk, the others share it
                    where[i] = Placement(r, m, start + t, t, start, 1)
                    start += lengths[i]
                elif t:
                    where[i] = Placement(r, m, start, t, where[firsts[k]].trunk_start, j + 1)
                    start += lengths[i] - t
                else:
                    where[i] = Placement(r, m, start)
                    start += lengths[i]
    return DatumPlan(budget, len(bins[0]), dp, sp, bins, where, branched=shared)


def plan_shared(datums: list[Datum], budget: int, dp: int, sp: int, pairs: bool = False,
                trees: list[tuple[int, int]] | None = None) -> DatumPlan:
    """plan_datums with the prefix trees where they save rows, else apart (trees None: apart). A row is a whole
    [1, T] whatever it holds, so a tree's saved tokens save work only where the pass then needs fewer micro-batches;
    with as many, the trees would only add their cost (the branch-aware mask over blocks of mixed branches: measured
    in benchmarks/README.md#dpo-s26). Every rank holds the same datums: the same choice everywhere, no collective."""
    shared = plan_datums(datums, budget, dp, sp, pairs=pairs, trees=trees)
    if trees is None:
        return shared
    apart = plan_datums(datums, budget, dp, sp, pairs=pairs)
    return shared if shared.micro_batches < apart.micro_batches else apart


def datum_batches(plan: DatumPlan, datums: list[Datum], coefs: list[np.ndarray] | None,
                  scored: list[np.ndarray] | None, dp_rank: int, sp_rank: int, kernel: str,
                  device: torch.device, models: list[int] | None = None) -> LazyBatches:
    """This rank's micro-batches: the [1, T] rows of its bins, cut for sequence parallelism, each made when it is
    read (LazyBatches; list() makes them all). coefs ([L] float32 per
    datum, rl/losses.py) for a per-token loss; None for the mean cross-entropy, whose labels are then -100 where
    the weight is 0. scored ([L] bool per datum, or None for every token): the tokens the output head scores.
    models (per datum, a pass of several models: its model's index in the pass's list): each token's slot, -1 in
    the tail (PackedBatch.slots)."""
    names = set().union(*(d.inputs for d in datums)) - {"target_tokens"} if coefs is not None else set()
    names = {k for k in names if all(k in d.inputs for d in datums)}  # the inputs every datum has
    bins = plan.bins[dp_rank]

    def make(m: int) -> PackedBatch:
        items = bins[m]
        ids, labels, pos, branch, inputs, coef, score, real = pack_row(plan, datums, items, coefs, names, scored)
        slots = None
        if models is not None:  # [1, T]: each token's model, -1 in the tail
            slots = torch.full((1, plan.budget), -1, dtype=torch.long)
            for i in items:
                slots[0, plan.where[i].columns(len(datums[i]))] = models[i]
        return pack_local(ids, labels, pos, real, kernel, device, sp_rank, plan.sp, coef, inputs, score, slots,
                          branch)

    # made as the Engine's loop reaches each (engine/batch.py LazyBatches: the masks' host time under the GPU's work);
    # each [1, T] row's capacity is T / sp, as pack_local counts it
    return LazyBatches(len(bins), make, len(bins) * (plan.budget // plan.sp))


def pack_row(plan: DatumPlan, datums: list[Datum], items: list[int], coefs: list[np.ndarray] | None,
             names: set[str], scored: list[np.ndarray] | None):
    """The [1, T] row of the datums `items`: ids (pad 0), labels (-100 in the tail), positions (restarting at 0 at
    each datum and at the tail; a branch's continuing its trunk's), branch ids (None unless plan.branched), the loss
    inputs (0 in the tail; "datum": each token's datum index, -1 in the tail), the coefficients (0 in the tail), the
    scored tokens, and the real tokens. A trunk is written by every datum of its tree with the same tokens and
    targets, and no coefficient (shared_prefix): the later writers change nothing read."""
    T = plan.budget
    ids = np.zeros(T, dtype=np.int64)
    labels = np.full(T, -100, dtype=np.int64)
    targets = np.full(T, -100, dtype=np.int64)  # every datum token's target, in the loss or not (the mean's outputs)
    pos = np.zeros(T, dtype=np.int64)
    coef = np.zeros(T, dtype=np.float32)
    inputs = {k: np.zeros(T, dtype=np.float32) for k in names}
    index = np.full(T, -1, dtype=np.float32)
    score = np.zeros(T, dtype=bool) if scored is not None else None
    branch = np.zeros(T, dtype=np.int64)
    s = 0
    for i in items:
        d, L, w = datums[i], len(datums[i]), plan.where[i]
        c = w.columns(L)  # [L]: contiguous from s without a trunk
        ids[c] = d.tokens
        labels[c] = targets[c] = d.inputs["target_tokens"]
        if coefs is None and "weights" in d.inputs:  # the mean cross-entropy: weight 0 is no label
            labels[c[d.inputs["weights"] == 0]] = -100
        pos[c] = np.arange(L)
        branch[c[w.trunk:]] = w.branch
        if coefs is not None:
            coef[c] = coefs[i]
        index[c] = i
        if score is not None:
            score[c] = scored[i]
        for k in names:
            inputs[k][c] = d.inputs[k]
        s = max(s, int(c[-1]) + 1)
    pos[s:] = np.arange(T - s)  # the padded tail is a document of its own
    t = lambda x: torch.from_numpy(x)[None]  # noqa: E731  [1, T]
    per_token = {k: t(v) for k, v in inputs.items()}
    if coefs is not None:
        per_token["datum"] = t(index)
    else:  # the mean cross-entropy reports each target's log-prob, weight 0 included (engine/losses.py)
        per_token["target_tokens"] = t(targets)
    return (t(ids), t(labels), t(pos), t(branch) if plan.branched else None, per_token,
            t(coef) if coefs is not None else None, t(score) if score is not None else None, s)


def unpack(plan: DatumPlan, datums: list[Datum], gathered: torch.Tensor) -> list[np.ndarray]:
    """gathered [world, M x T/sp] (each rank's local outputs, micro-batch after micro-batch) -> per datum [L]."""
    T, M, sp = plan.budget, plan.micro_batches, plan.sp
    local = T // sp
    g = gathered.float().numpy().reshape(plan.dp, sp, M, local)
    rows = g.transpose(0, 2, 1, 3).reshape(plan.dp, M, T)  # [dp, M, T]: the sp slices side by side
    return [rows[w.dp, w.m, w.columns(len(d))] for d, w in zip(datums, plan.where)]
