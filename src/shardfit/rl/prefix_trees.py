"""Which datums of a pass share their first tokens, computed once as one prefix tree (rl/pack.py lays the trees out,
models/attention.py masks them: a datum's tokens see the trunk and their own branch, never another datum's).

Two callers, two groupings:
  pairs   a preference pair's chosen and rejected (rl/preference.py): their common prompt;
  groups  consecutive datums of an RL batch (rl/step.py): the cookbook sends a prompt's rollouts one after another
          (GRPO's group of `group_size`), each prompt + its sampled answer; the run of datums that share at least
          MIN_TRUNK tokens with the run's first becomes one tree, as long as the tree fits one micro-batch row.

A trunk token must carry no loss in any of its datums (its coefficient, or its weight under the mean cross-entropy,
is 0 in all of them) and the same target in all: computing it once then changes no gradient and no returned
log-prob (each datum reads the trunk's). The tree is exact whatever the loss; what it saves is the trunk's work,
(n - 1) x trunk tokens of an n-datum tree.

Only where the attention kernel takes branch ids (models/attention.py BRANCHED_KERNELS: flex, sdpa) and
compute.share_prefix is on; never under sequence parallelism (the trees are planned for whole rows, and the Ulysses
path is not tested with them); never for an MoE model with load balancing (router_aux_coef or router_bias_rate):
the balancing term and the bias update count each token the routers see, and a trunk computed once is seen once
where its datums apart show it n times, so the balancing objective would change.
"""

from __future__ import annotations

import numpy as np

from shardfit.models.attention import BRANCHED_KERNELS
from shardfit.rl.datum import Datum

# An RL group shares a trunk of at least this many tokens, or its datums are packed apart: below it the saving (a few
# tokens a datum) is less than what a tree costs FlexAttention (its blocks of mixed branches are partial, 128 x 128).
MIN_TRUNK = 32


def shares_prefixes(engine, kernel: str) -> bool:
    """Whether this pass may pack prefix trees (module docstring): compute.share_prefix, a kernel with branch masks,
    no sequence parallelism, and no MoE load balancing (module docstring)."""
    m = engine.cfg.model
    balancing = m.n_experts > 0 and (m.router_aux_coef > 0 or m.router_bias_rate > 0)
    return engine.cfg.compute.share_prefix and kernel in BRANCHED_KERNELS and engine.layout.sequence == 1 \
        and not balancing


def shared_prefix(a: Datum, b: Datum, counted_a: np.ndarray, counted_b: np.ndarray) -> int:
    """The tokens two datums can share as a trunk: their common first tokens with the same targets and no counted
    token (counted_*: [L] bool, the tokens with loss), leaving each at least one token of its own."""
    n = min(len(a), len(b)) - 1
    same = (a.tokens[:n] == b.tokens[:n]) & (a.inputs["target_tokens"][:n] == b.inputs["target_tokens"][:n]) \
        & ~counted_a[:n] & ~counted_b[:n]
    return int(n if same.all() else np.argmin(same))


def pair_trees(datums: list[Datum], counted: list[np.ndarray]) -> list[tuple[int, int]]:
    """(2, trunk) for each pair (datums 2k, 2k + 1): any common prompt is shared (rl/pack.py's `trees`)."""
    return [(2, shared_prefix(datums[i], datums[i + 1], counted[i], counted[i + 1])) for i in range(0, len(datums), 2)]


def prefix_groups(datums: list[Datum], counted: list[np.ndarray], budget: int,
                  min_trunk: int = MIN_TRUNK) -> list[tuple[int, int]]:
    """Consecutive runs of datums sharing >= min_trunk first tokens, each (count, trunk), covering the datums in
    order (count 1, trunk 0: a datum alone). A run's trunk is the smallest its members share with its first; a run
    grows while its tree (trunk + every member's remainder) fits `budget` tokens."""
    trees, i, n = [], 0, len(datums)
    while i < n:
        count, trunk = 1, 0
        while i + count < n:
            j = i + count
            t = shared_prefix(datums[i], datums[j], counted[i], counted[j])
            t = t if count == 1 else min(t, trunk)
            if t < min_trunk:
                break
            grown = t + sum(len(datums[k]) - t for k in range(i, j + 1))
            if grown > budget:
                break
            count, trunk = count + 1, t
        trees.append((count, trunk) if count > 1 else (1, 0))
        i += count
    return trees
