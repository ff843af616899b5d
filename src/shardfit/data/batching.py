"""Token-budget micro-batches, and the validation set's batches.

Token budgets (train.micro_batch_tokens = T): the step's global batch is G items (examples, or windows in
pretraining) of varying length. They are split into world x M bins of at most T tokens, and each bin becomes one
micro-batch: a single row of exactly T tokens, its items end to end as separate documents and padding only at the
end. Every forward/backward then sees the same shape, [1, T], whatever the lengths: memory is flat from step to
step and a compiled block never meets a new shape.

Why every rank runs the same number of micro-batches (FSDP issues collectives in every pass): M is computed on
every rank from the same input, the lengths of the step's G items, which every host reads from its own copy of the
dataset given only the step number, by the same deterministic procedure. So every rank derives the same M and the
same bins, with no collective. M starts at the lower bound ceil(sum / (world x T)) and grows by one until
longest-first placement into the least-filled bin fits every item.
"""

from __future__ import annotations

import heapq
import math

from shardfit.data.packing import MicroBatch, ShuffledDataset, stack_rows
from shardfit.data.sft_packed import concat_documents
from shardfit.errors import ShardfitError


def assign_bins(lengths: list[int], world: int, budget: int) -> list[list[list[int]]]:
    """Item indices per rank per micro-batch: [world][M][...], each micro-batch at most `budget` tokens, every
    rank exactly M micro-batches (some may be empty when there are fewer items than bins)."""
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ShardfitError(f"an item of {max(too_long)} tokens exceeds train.micro_batch_tokens={budget}",
                            where="train.micro_batch_tokens", fix="set it to at least data.seq_len")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index
    M = max(1, math.ceil(sum(lengths) / (world * budget)))
    while True:
        bins: list[list[int]] = [[] for _ in range(world * M)]
        heap = [(0, b) for b in range(world * M)]  # (fill, bin): the least-filled bin on top
        for i in order:
            fill, b = heapq.heappop(heap)
            if fill + lengths[i] > budget:  # the least-filled bin is too full: so is every other
                break
            bins[b].append(i)
            heapq.heappush(heap, (fill + lengths[i], b))
        else:
            # Bin b goes to rank b % world: the fullest bins are spread over the ranks, not stacked on one.
            return [[sorted(bins[m * world + r]) for m in range(M)] for r in range(world)]
        M += 1


def budget_batches(dataset: ShuffledDataset, first: int, count: int, budget: int, rank: int, world: int,
                   limit: int = 0) -> list[MicroBatch]:
    """Rank `rank`'s micro-batches of samples first..first+count-1, each [1, budget] (at most `limit` if > 0)."""
    ks = list(range(first, first + count))
    plan = assign_bins([dataset.item_length(k) for k in ks], world, budget)[rank]
    if limit:
        plan = plan[:limit]
    out = []
    for items in plan:
        parts = [dataset.item(ks[i]) for i in items]
        out.append(stack_rows([concat_documents(parts, budget, dataset.pad_id)]))
    return out


def eval_row_batches(dataset: ShuffledDataset, micro_batch: int, rank: int, world: int,
                     limit: int = 0) -> list[MicroBatch]:
    """The validation rows, in order, in rounds of world x micro_batch: every rank runs the same number of
    forwards (FSDP all-gathers in each); rows past the end are empty (padding, no labels)."""
    n = dataset.num_windows
    rounds = math.ceil(n / (world * micro_batch))
    if limit:
        rounds = min(rounds, limit)
    empty = concat_documents([], dataset.seq_len, dataset.pad_id)
    out = []
    for m in range(rounds):
        first = m * world * micro_batch + rank * micro_batch
        out.append(stack_rows([dataset.row(k) if k < n else empty for k in range(first, first + micro_batch)]))
    return out
