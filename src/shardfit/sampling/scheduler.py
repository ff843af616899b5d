"""The host's book of what runs: requests, their prefill jobs and rows, row slots, blocks, and when each row needs
its next block or ends.

- A **request** (`Request`) becomes one prefill job of its prompt; when the job's last chunk is prefilled its
  `num_samples` rows start, sharing the prompt's blocks (one reference each). A request is answered when its last
  row ends.
- A **job** (`Prefill`) is admitted (FIFO, never skipping the head) when row slots for its rows and blocks for all
  its tokens are free, plus headroom (a block per row and a watermark) unless nothing else runs; then it is
  prefilled in chunks, a few jobs per forward up to `prefill_chunk` tokens.
- A **row** (`Row`) decodes one token per step. Which step needs what is known on the host without asking the
  device: a row that joins at step s0 with g0 tokens generated writes its input's key at position
  P + g0 - 1 + (s - s0) at step s, so it needs a new block exactly when that position crosses a block boundary and
  it ends at max_tokens after step s0 + max_tokens - g0 - 1. Those events sit in a calendar keyed by step, so a
  step touches only the rows that cross a boundary (no loop over every row per token). A row whose first write goes
  into a block others hold copies it first (copy-on-write). Rows stopped by a stop token or string end when the host
  reads the device's outputs (runner.flush), every few steps.
- **Preemption**: when no block is free, the newest row or job (by admission) gives its blocks back and waits at
  the head of the queue; a row comes back as a job that prefills its prompt and tokens so far (no new draw: it goes
  on from its last token), so its samples are what they would have been.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from shardfit.sampling.kv import BlockAllocator
from shardfit.sampling.params import Sampled, SampleRequest


@dataclass(eq=False)
class Request:
    req: SampleRequest
    seed: int
    index: int  # submission order
    samples: list[Sampled]
    prompt_parts: list = field(default_factory=list)  # device (logp [n], top-k or None) per prefilled chunk
    open_rows: int = 0
    prefilled: bool = False
    result: object = None


@dataclass(eq=False)
class Row:
    request: Request
    sample: int
    seq: int = 0  # admission order: the newest is preempted first
    slot: int = -1  # its row slot while it runs
    blocks: list[int] = field(default_factory=list)
    n_gen: int = 0  # tokens generated when it joined the decode batch (at step join_step)
    join_step: int = 0
    epoch: int = 0  # bumped when it joins or leaves: its calendar events lapse
    running: bool = False
    ended: bool = False

    @property
    def out(self) -> Sampled:
        return self.request.samples[self.sample]


@dataclass(eq=False)
class Prefill:
    request: Request
    tokens: list[int]  # to prefill: the prompt, or a preempted row's prompt and tokens but the last
    rows: list[Row]  # its rows; a resumed row already has tokens
    new: bool  # draw the rows' first tokens from the last position
    seq: int = 0
    done: int = 0  # tokens prefilled
    blocks: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_rows: int):
        self.alloc, self.bs, self.max_rows = allocator, block_size, max_rows
        self.free_slots = list(range(max_rows - 1, -1, -1))
        self.waiting: collections.deque[Prefill] = collections.deque()
        self.prefilling: list[Prefill] = []
        self.active: list[Row] = []  # the decode batch, in order
        self.active_changed = True
        self.blocks_due: dict[int, list[tuple[Row, int]]] = collections.defaultdict(list)
        self.ends_due: dict[int, list[tuple[Row, int]]] = collections.defaultdict(list)
        self.step = 0  # decode steps run
        self._seq = itertools.count()
        self.watermark = max(1, allocator.n_blocks // 100)
        self.preemptions = 0  # rows and jobs sent back to the queue, counted (a too small KV cache shows here)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.active)

    def admit(self) -> list[Prefill]:
        """Admit the head of the queue while it fits: its blocks allocated, its rows' slots reserved."""
        out = []
        while self.waiting:
            job = self.waiting[0]
            need = -(-len(job.tokens) // self.bs)
            alone = not (self.prefilling or self.active)
            headroom = 0 if alone else len(job.rows) + self.watermark
            if len(self.free_slots) < len(job.rows) or self.alloc.n_free < need + headroom:
                break
            self.waiting.popleft()
            job.blocks = [self.alloc.allocate() for _ in range(need)]
            job.seq, job.done = next(self._seq), 0
            for row in job.rows:
                row.slot, row.seq = self.free_slots.pop(), job.seq
            self.prefilling.append(job)
            out.append(job)
        return out

    def chunks(self, budget: int) -> list[tuple[Prefill, int, int]]:
        """(job, start, end) for the next forward: the oldest jobs' next tokens, at most `budget` in all (at least one
        token of the first)."""
        out = []
        for job in self.prefilling:
            n = min(len(job.tokens) - job.done, budget)
            if n <= 0:
                break
            out.append((job, job.done, job.done + n))
            budget -= n
        return out

    def start_rows(self, job: Prefill) -> list[Row]:
        """The job's rows join the decode batch, holding its blocks (the job's own reference goes to the first)."""
        self.prefilling.remove(job)
        for i, row in enumerate(job.rows):
            row.blocks = list(job.blocks)
            if i:
                for b in job.blocks:
                    self.alloc.share(b)
        if not job.rows:  # scoring only: no row holds the prompt
            self.alloc.release_all(job.blocks)
        job.blocks = []
        for row in job.rows:
            self.join(row, len(job.request.req.prompt))
        return job.rows

    def join(self, row: Row, prompt_len: int) -> None:
        """Row starts decoding at this step with n_gen tokens; its block events and its end are booked. A row with
        max_tokens generated already (max_tokens=1: its token came from the prefill) leaves at once."""
        M = row.request.req.params.max_tokens
        row.running, row.epoch, row.join_step = True, row.epoch + 1, self.step
        if row.n_gen >= M:
            self.leave(row)
            return
        self.active.append(row)
        self.active_changed = True
        s0, w0 = self.step, prompt_len + row.n_gen - 1  # its first write position
        last = s0 + M - row.n_gen - 1  # its last step
        self.ends_due[last].append((row, row.epoch))
        s = s0  # at s0: a new block, or a copy of the shared partial one; then at every block boundary
        while s <= last:
            self.blocks_due[s].append((row, row.epoch))
            s += (self.bs - (w0 + s - s0) % self.bs) or self.bs

    def leave(self, row: Row) -> None:
        """Row stops decoding (ended or preempted): its blocks and slot are free."""
        if row.running:
            row.running, row.epoch = False, row.epoch + 1
            if row in self.active:
                self.active.remove(row)
                self.active_changed = True
            self.alloc.release_all(row.blocks)
            row.blocks = []
            self.free_slots.append(row.slot)
            row.slot = -1

    def victim(self):
        """The newest running row or prefilling job, or None."""
        cands = [*self.active, *self.prefilling]
        return max(cands, key=lambda x: (x.seq, getattr(x, "sample", 0)), default=None)

    def preempt_job(self, job: Prefill) -> None:
        self.preemptions += 1
        self.prefilling.remove(job)
        self.alloc.release_all(job.blocks)
        job.blocks, job.done = [], 0
        for row in job.rows:
            self.free_slots.append(row.slot)
            row.slot = -1
        if job.request.prompt_parts and job.new:
            job.request.prompt_parts.clear()  # recomputed with the prompt
        self.waiting.appendleft(job)

    def preempt_row(self, row: Row) -> None:
        """Row (its tokens flushed to the host) waits to be recomputed: its prompt and tokens but the last."""
        self.preemptions += 1
        self.leave(row)
        toks = row.out.tokens
        self.waiting.appendleft(Prefill(row.request, list(row.request.req.prompt) + toks[:-1], [row], new=False))
