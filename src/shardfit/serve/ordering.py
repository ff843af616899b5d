"""The queue of accepted commands, released per model in seq_id order (rank 0 only).

A TrainingClient numbers its requests 1, 2, 3, ... (fwd/bwd chunks, optim, save, load) and pipelines them: chunks of
one call arrive concurrently, the first one last, and step k+1 is sent before step k is read.
So a model's command with seq_id n waits here until n-1 has been released; commands without a model (sampling)
are ready at once. Ready commands run in the order they became ready. A seq_id refused before it became a command
(`skip`) is counted as released, so a bad request never blocks the ones after it. So is a seq_id that never
arrives: the SDK numbers a request before it sends it, and a request that fails inside the client (a value it cannot
serialise) leaves its number unused, where every later request of that client would wait for ever. After `gap_s`
seconds (serve.seq_gap_s; 0: wait for ever) of a model's oldest waiting command waiting, the missing numbers are
skipped with one line in the log, and one that arrives afterwards is refused as a reused seq_id.
`take_following` hands the loop the ready commands right behind the one it took, while they are of a kind that runs
together (sample requests, batched into one Engine.sample call): never past another command, so nothing overtakes
what became ready before it (a sample never runs before the optim_step, snapshot or sampler_load ahead of it).
On one rank a sample run takes more samples while it decodes (`take_ready`, serve/sample_joining.py), by the same
rule: never past another command.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardfit.errors import ShardfitError


@dataclass
class Pending:
    command: object  # commands.Command
    model_id: str | None
    seq_id: int | None
    arrived: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, gap_s: float = 0.0, log: Callable[[str], None] | None = None):
        self.gap_s = gap_s  # how long a command waits for an earlier seq_id that never arrives (0: for ever)
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._cond = threading.Condition()
        self._next: dict[str, int] = {}  # model_id -> the seq_id it releases next
        self._skipped: dict[str, set[int]] = {}
        self._waiting: dict[tuple[str, int], Pending] = {}
        self._ready: list[Pending] = []
        self._closed = False

    def add_model(self, model_id: str, first_seq: int = 1) -> None:
        with self._cond:
            self._next.setdefault(model_id, first_seq)
            self._skipped.setdefault(model_id, set())

    def has_model(self, model_id: str) -> bool:
        with self._cond:
            return model_id in self._next

    def check_seq(self, model_id: str, seq_id: int, where: str) -> None:
        """Refuse (400) an unknown model or a seq_id already used, before the request becomes a command."""
        with self._cond:
            if model_id not in self._next:
                raise ShardfitError(f"unknown model_id '{model_id}'", where=where,
                                    fix="create the model first (ServiceClient.create_lora_training_client)")
            if seq_id < self._next[model_id] or (model_id, seq_id) in self._waiting \
                    or seq_id in self._skipped[model_id]:
                raise ShardfitError(f"seq_id {seq_id} of model '{model_id}' was already used", where=where,
                                    fix="number each request of a model once, from 1 up (the SDK does)")

    def submit(self, command: object, model_id: str | None = None, seq_id: int | None = None) -> None:
        with self._cond:
            p = Pending(command, model_id, seq_id)
            if model_id is None:
                self._ready.append(p)
            else:
                self._waiting[(model_id, seq_id)] = p
                self._release(model_id)
            self._cond.notify_all()

    def skip(self, model_id: str, seq_id: int) -> None:
        """A refused request's seq_id: the model's later requests do not wait for it."""
        with self._cond:
            if model_id in self._next and seq_id >= self._next[model_id]:
                self._skipped[model_id].add(seq_id)
                self._release(model_id)
                self._cond.notify_all()

    def _release(self, model_id: str) -> None:
        """Move the model's consecutive seq_ids from waiting to ready (lock held)."""
        n, skipped = self._next[model_id], self._skipped[model_id]
        while True:
            if n in skipped:
                skipped.discard(n)
            elif (model_id, n) in self._waiting:
                self._ready.append(self._waiting.pop((model_id, n)))
            else:
                break
            n += 1
        self._next[model_id] = n

    def next(self, timeout: float) -> Pending | None:
        """The oldest ready command, waiting up to `timeout` s; None when there is none (or after close)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                gap = self._skip_gaps()
                if self._ready or self._closed:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left if gap is None else min(left, gap))
            if self._closed and not self._ready:
                return None
            return self._ready.pop(0)  # in release order: a model's commands by seq_id, never by arrival

    def _skip_gaps(self) -> float | None:
        """(Lock held.) Skip the missing seq_ids of each model whose oldest waiting command has waited gap_s (module
        docstring), one log line each; the seconds until the next model's would be skipped (None: none waits)."""
        if not self.gap_s or not self._waiting:
            return None
        oldest: dict[str, Pending] = {}
        for (m, n), p in self._waiting.items():
            if m not in oldest or n < oldest[m].seq_id:
                oldest[m] = p
        now, soonest = time.monotonic(), None
        for m, p in oldest.items():
            wait = p.arrived + self.gap_s - now
            if wait > 0:
                soonest = wait if soonest is None else min(soonest, wait)
                continue
            first, last = self._next[m], p.seq_id - 1
            self._log(f"shardfit serve: model '{m}': seq_id {first}{'' if first == last else f'..{last}'} never "
                      f"arrived in {self.gap_s:g} s (numbered by its client, never sent: a request that failed in "
                      f"the client); seq_id {p.seq_id} and the ones after it run")
            self._skipped[m].update(range(first, last + 1))
            self._release(m)
        return soonest

    def take_following(self, fits: Callable[[Pending], bool]) -> list[Pending]:
        """The ready commands at the head of the queue, in order, while `fits` takes each (it may count what it took:
        a batch's rows); stops at the first it refuses, which stays first."""
        out = []
        with self._cond:
            while self._ready and fits(self._ready[0]):
                out.append(self._ready.pop(0))
        return out

    def take_ready(self, decide: Callable[[Pending], str]) -> tuple[list[Pending], bool]:
        """The ready commands `decide` takes, walking from the head in order: "take" (removed and returned), "pass"
        (left where it is; the walk goes on) or "stop" (the walk ends there, that one first still). (taken, whether
        one was passed). A running sample run's intake (serve/sample_joining.py): it stops at any command that is
        not a sample, so nothing overtakes a command, and passes samples only (of other weights: the next run's)."""
        taken, passed = [], False
        with self._cond:
            for p in list(self._ready):
                verdict = decide(p)
                if verdict == "stop":
                    break
                if verdict == "take":
                    taken.append(p)
                    self._ready.remove(p)
                else:
                    passed = True
        return taken, passed

    def take_together(self, first: Pending, joins) -> list[Pending]:
        """The ready commands that run in one pass with `first` (just taken: serve/executor.py's `combine`): of
        every other model, its oldest ready command when joins(it) says so. A model's later commands stay, so its
        seq_id order holds; a model whose oldest ready command does not join keeps all of its own; commands without
        a model (sampling) stay where they are. Nothing waits for a model that is not ready."""
        with self._cond:
            seen, taken = {first.model_id}, []
            for p in list(self._ready):
                if p.model_id is None or p.model_id in seen:
                    continue
                seen.add(p.model_id)
                if joins(p):
                    taken.append(p)
                    self._ready.remove(p)
            return taken

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> dict[str, int]:
        with self._cond:
            return {"ready": len(self._ready), "waiting_for_earlier_seq_id": len(self._waiting)}
