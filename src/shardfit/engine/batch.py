"""The one micro-batch type of every step (`PackedBatch`), and the host-side cut that makes it.

Whoever fills a step (the trainer's data loader, train/batches.py; datums of the RL API, rl/pack.py; a test) hands
the Engine a list of PackedBatch, the same count and shapes on every rank. Everything here runs on the host before
the model sees a micro-batch, outside any checkpointed or compiled region: the full [b, S] position ids become the
micro-batch's DocumentMask (models/attention.py) here, once, and only then are tokens, labels, positions and the
per-token loss inputs cut into this rank's S/sp columns. Recomputation under checkpointing reads the same mask
object, and every rank of a sequence-parallel group builds the same one: no exchange is needed for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from shardfit.models.attention import DocumentMask, to_device
from shardfit.models.logprobs import scored_rows
from shardfit.parallel.ulysses import local_slice


@dataclass
class PackedBatch:
    """This rank's part of one micro-batch, on the host (tensors) and the device (mask)."""

    input_ids: torch.Tensor  # [b, S/sp]
    labels: torch.Tensor  # [b, S/sp]: the token each position predicts, -100 where none (padding, prompts)
    position_ids: torch.Tensor | None  # [b, S/sp]; None: 0..S-1 (one document per row, no sequence parallelism)
    mask: DocumentMask | None  # over the full [b, S]; None: plain causal attention
    capacity: int  # b x S / sp: the tokens this rank computes, padding included
    real_tokens: float  # of those, not padding (this rank's share)
    loss_tokens: int  # labels that carry loss
    coef: torch.Tensor | None = None  # [b, S/sp] float32: each token's loss coefficient (per-token losses)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # [b, S/sp] each: per-token loss inputs
    scored: torch.Tensor | None = None  # [b, S/sp] bool: the positions the output head scores; None: all
    # [b, S/sp] long: each token's model, an index into a pass of several models' list (engine/multi_model.py),
    # -1 for padding; None: the one model in the slot
    slots: torch.Tensor | None = None

    @property
    def local_tokens(self) -> int:
        return self.input_ids.numel()


def pack_local(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None, real_tokens: float,
               kernel: str, device: torch.device, sp_rank: int = 0, sp: int = 1, coef: torch.Tensor | None = None,
               inputs: dict[str, torch.Tensor] | None = None, scored: torch.Tensor | None = None,
               slots: torch.Tensor | None = None, branch: torch.Tensor | None = None) -> PackedBatch:
    """A whole micro-batch [b, S] (host tensors) -> this rank's PackedBatch. position_ids None: every row is one
    document (no mask). real_tokens: the whole micro-batch's, shared evenly over the sequence-parallel group so
    that the sum over ranks counts each token once. branch [b, S]: prefix trees' branch ids (models/attention.py)."""
    mask = DocumentMask.build(position_ids, kernel, device, branch) if position_ids is not None else None
    if mask is None:
        position_ids = None  # every row is one document: the model's own 0..S-1
    b, S = input_ids.shape
    inputs = dict(inputs or {})
    if sp > 1:
        if position_ids is None:
            position_ids = torch.arange(S).expand_as(input_ids)  # [b, S], made here, cut like the tokens
        cut = lambda x: local_slice(x, sp_rank, sp) if x is not None else None  # noqa: E731
        input_ids, labels, position_ids, coef, scored, slots = map(cut, (input_ids, labels, position_ids, coef,
                                                                         scored, slots))
        inputs = {k: cut(v) for k, v in inputs.items()}
    return PackedBatch(input_ids, labels, position_ids, mask, b * S // sp, real_tokens / sp,
                       int((labels != -100).sum()), coef, inputs, scored, slots)


class LazyBatches(Sequence):
    """A pass's micro-batches, each made (host tensors and document mask) only when the pass reaches it: make(i) ->
    the i-th PackedBatch. Why: a FlexAttention BlockMask costs milliseconds of host time per micro-batch (its build and
    the transpose torch adds for the backward), and a list made before the pass spent all of them while the GPU sat
    idle (Engine.forward of 11 micro-batches, session 24); made in the loop, each is built while the GPU still runs
    the micro-batches queued before it, and one mask at a time is alive. The same batches, in the same order, as
    the list. capacity: the micro-batches' total (Engine._pass's divisor), known without making any."""

    def __init__(self, count: int, make: Callable[[int], PackedBatch], capacity: int):
        self.count, self.make, self.capacity = count, make, capacity

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[PackedBatch]:
        # over the count, not Sequence's default (self[i] until an IndexError): an IndexError raised inside make
        # (a packing bug) would end the pass early and silently instead of reaching the caller
        return (self.make(i) for i in range(self.count))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return self.make(i % self.count)


def total_capacity(batches: Iterable[PackedBatch]) -> int:
    """The tokens the micro-batches compute, padding included; of LazyBatches without making them."""
    return batches.capacity if isinstance(batches, LazyBatches) else sum(b.capacity for b in batches)


@dataclass
class DeviceBatch:
    """A PackedBatch's tensors on the device, as a loss reads them (engine/losses.py). Flat per-token tensors [n],
    n = b x S/sp, in the order of the model's flattened outputs."""

    input_ids: torch.Tensor  # [b, S/sp]
    labels: torch.Tensor  # [b, S/sp]
    position_ids: torch.Tensor | None
    mask: DocumentMask | None
    coef: torch.Tensor | None  # [n]
    inputs: dict[str, torch.Tensor]  # [n] each
    rows: torch.Tensor | None  # the flat positions the head scores (models/logprobs.scored_rows), made on the host
    slots: torch.Tensor | None = None  # [n] long: each token's model in a pass of several (PackedBatch.slots)


def to_device_batch(b: PackedBatch, device: torch.device, loss_chunk: int) -> DeviceBatch:
    """Copies without a host sync (pinned where the host tensors are)."""
    flat = lambda x: to_device(x, device).flatten()  # noqa: E731
    rows = to_device(scored_rows(b.scored, loss_chunk), device) if b.scored is not None else None
    return DeviceBatch(to_device(b.input_ids, device), to_device(b.labels, device),
                       to_device(b.position_ids, device) if b.position_ids is not None else None, b.mask,
                       flat(b.coef) if b.coef is not None else None, {k: flat(v) for k, v in b.inputs.items()}, rows,
                       flat(b.slots) if b.slots is not None else None)
