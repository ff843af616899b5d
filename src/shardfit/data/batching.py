"""Token-budget micro-batches, and the validation set's batches. The algorithm and why: docs/data.md.

Token budgets (train.micro_batch_tokens = T): the step's G items (examples, or windows in pretraining) are split into
world x M bins of at most T tokens, each bin one micro-batch: a single row [1, T], its items end to end as separate
documents, padding only at the end. Every forward/backward sees the same shape whatever the lengths: memory is flat
and a compiled block never meets a new shape.
Invariant: every rank runs the same number of micro-batches (FSDP issues collectives in every pass) without a
collective: M and the bins are computed on every rank from the same input (the lengths of the step's G items, read
from each host's own copy of the dataset given only the step) by the same deterministic procedure. M is the smallest
count at which longest-first placement into the least-filled bin fits every item, found by bisection between
ceil(sum / (world x T)) and what best-fit-decreasing needs (used where balanced placement never fits).
O(N log N log N) for N items: the whole validation set is planned at once.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator

from shardfit.data.dataset import MicroBatch, ShuffledDataset, stack_rows
from shardfit.data.sft_packed import concat_documents
from shardfit.errors import ShardfitError


def _balanced(order: list[int], lengths: list[int], bins: int, budget: int) -> list[list[int]] | None:
    """Longest first into the least-filled of `bins` bins; None when an item does not fit."""
    out: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0, b) for b in range(bins)]  # (fill, bin): the least-filled bin on top
    for i in order:
        fill, b = heapq.heappop(heap)
        if fill + lengths[i] > budget:  # the least-filled bin is too full: so is every other
            return None
        out[b].append(i)
        heapq.heappush(heap, (fill + lengths[i], b))
    return out


def _best_fit(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Best-fit decreasing: each item (longest first) into the bin it fills most, a new bin when none has room.
    Always succeeds (items are at most `budget`); uses at most 11/9 of the fewest bins possible, plus one."""
    room: list[tuple[int, int]] = []  # (free tokens, bin), ascending
    out: list[list[int]] = []
    for i in order:
        j = bisect.bisect_left(room, (lengths[i], -1))
        if j == len(room):
            out.append([i])
            bisect.insort(room, (budget - lengths[i], len(out) - 1))
        else:
            free, b = room.pop(j)
            out[b].append(i)
            bisect.insort(room, (free - lengths[i], b))
    return out


def assign_bins(lengths: list[int], world: int, budget: int) -> list[list[list[int]]]:
    """Item indices per rank per micro-batch: [world][M][...], each micro-batch at most `budget` tokens, every
    rank exactly M micro-batches (some may be empty when there are fewer items than bins)."""
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ShardfitError(f"an item of {max(too_long)} tokens exceeds train.micro_batch_tokens={budget}",
                            where="train.micro_batch_tokens", fix="set it to at least data.seq_len")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index
    fitted = _best_fit(order, lengths, budget)
    lo, hi = max(1, math.ceil(sum(lengths) / (world * budget))), max(1, math.ceil(len(fitted) / world))
    best = _balanced(order, lengths, world * hi, budget)
    while lo < hi:  # the smallest M at which balanced placement fits (bisection: every rank takes the same path)
        mid = (lo + hi) // 2
        bins = _balanced(order, lengths, world * mid, budget)
        if bins is None:
            lo = mid + 1
        else:
            hi, best = mid, bins
    M = hi
    if best is None or len(best) != world * M:  # no balanced placement up to best-fit's count: its bins, fullest
        by_fill = sorted(fitted, key=lambda b: (-sum(lengths[i] for i in b), b))  # first, padded with empty ones
        best = by_fill + [[] for _ in range(world * M - len(by_fill))]
    # Bin b goes to rank b % world: the fullest bins are spread over the ranks, not stacked on one.
    return [[sorted(best[m * world + r]) for m in range(M)] for r in range(world)]


def budget_batches(dataset: ShuffledDataset, first: int, count: int, budget: int, rank: int, world: int,
                   limit: int = 0) -> Iterator[MicroBatch]:
    """Rank `rank`'s micro-batches of samples first..first+count-1, each [1, budget] (at most `limit` if > 0), made
    one at a time as they are iterated (the plan, item lengths only, is made first: every rank knows its count)."""
    ks = range(first, first + count)
    plan = assign_bins([dataset.item_length(k) for k in ks], world, budget)[rank]
    for items in plan[:limit] if limit else plan:
        parts = [dataset.item(ks[i]) for i in items]
        yield stack_rows([concat_documents(parts, budget, dataset.pad_id)])


def eval_row_batches(dataset: ShuffledDataset, micro_batch: int, rank: int, world: int,
                     limit: int = 0) -> Iterator[MicroBatch]:
    """The validation rows, in order, in rounds of world x micro_batch: every rank runs the same number of
    forwards (FSDP all-gathers in each); rows past the end are empty (padding, no labels). Made one round at a time
    as they are iterated: a large validation set is never held whole."""
    n = dataset.num_windows
    rounds = math.ceil(n / (world * micro_batch))
    if limit:
        rounds = min(rounds, limit)
    empty = concat_documents([], dataset.seq_len, dataset.pad_id)
    for m in range(rounds):
        first = m * world * micro_batch + rank * micro_batch
        yield stack_rows([dataset.row(k) if k < n else empty for k in range(first, first + micro_batch)])
