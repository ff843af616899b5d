"""request_id -> result, with the long poll of /retrieve_future and each request's timings.

Every mutating call answers {request_id} at once; the SDK then polls /retrieve_future and re-polls a try_again at
once, without sleeping, so a poll is held here until the result is ready or `poll_s` passes
(well under the client's 45 s timeout). Results are set by the command loop's thread (`complete`) and awaited on
the HTTP server's event loop (`wait`): the hand-over is loop.call_soon_threadsafe.

Ids are unguessable (128 random bits) and each is bound to the principal that made it (a digest of its API key): a
future is read by whoever holds its id and the key that created it, never by another key, and an id it does not
own is as unknown to it (404) as one never issued. A result stays retrievable for `keep_s` after it is first read (a
retry of a lost answer gets it again); one nobody reads expires `unread_s` after it finished; past `max_kept`
finished results the oldest go first, read ones before unread ones. An id dropped so is 'expired' (HTTP 410, which
the SDK answers by re-submitting a sample; a training call fails) while it is among the last `max_expired` dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Result:
    """A finished request: a JSON object, or protobuf bytes (ForwardBackwardOutput, SampleResponse), or an error."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"  # "user" | "server" (Tinker's RequestErrorCategory)
    parts: list[Result] | None = None  # a command of several requests (forward_backward_many): each one's Result

    def body(self) -> dict | bytes:
        if self.error is not None:
            return {"error": self.error, "category": self.category}
        return self.proto if self.proto is not None else (self.json or {})


@dataclass
class Timing:
    """Seconds on the server: waiting in the queue (including for earlier seq_ids), then running."""

    kind: str
    owner: str | None = None  # the principal that made the request
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | str | None]:
        queue = (self.started or time.monotonic()) - self.submitted
        run = (self.finished - self.started) if self.finished and self.started else None
        return {"kind": self.kind, "queue_s": round(queue, 6), "run_s": None if run is None else round(run, 6),
                **{f"{k}_s": round(v, 6) for k, v in self.phases.items()}}


class FutureStore:
    def __init__(self, poll_s: float = 20.0, keep_s: float = 600.0, unread_s: float = 3600.0, max_kept: int = 4096,
                 max_expired: int = 65536):
        self.poll_s, self.keep_s, self.unread_s, self.max_kept = poll_s, keep_s, unread_s, max_kept
        self._lock = threading.Lock()
        self._results: dict[str, Result] = {}
        self._timings: dict[str, Timing] = {}
        self._read_at: dict[str, float] = {}
        self._waiters: dict[str, list[asyncio.Event]] = {}
        self._expired: OrderedDict[str, str | None] = OrderedDict()  # dropped id -> its owner
        self._max_expired = max_expired
        self.loop: asyncio.AbstractEventLoop | None = None  # the HTTP server's loop, set at its start-up

    def create(self, kind: str, owner: str | None = None) -> str:
        rid = "req-" + secrets.token_urlsafe(16)
        with self._lock:
            self._timings[rid] = Timing(kind, owner)
        return rid

    def started(self, rid: str) -> None:
        with self._lock:
            if rid in self._timings:
                self._timings[rid].started = time.monotonic()

    def complete(self, rid: str, result: Result, phases: dict[str, float] | None = None) -> None:
        """From any thread: record the result and wake the polls waiting for it."""
        with self._lock:
            self._results[rid] = result
            t = self._timings.get(rid)
            if t is not None:
                t.finished = time.monotonic()
                t.started = t.started or t.finished
                t.phases.update(phases or {})
            waiters = self._waiters.pop(rid, [])
            self._evict(keep=rid)
        if waiters and self.loop is not None:
            for ev in waiters:
                self.loop.call_soon_threadsafe(ev.set)

    def state(self, rid: str, owner: str | None = None) -> str:
        """'done', 'pending', 'expired' (issued to `owner`, then dropped) or 'unknown' (never issued to it)."""
        with self._lock:
            self._evict(keep=None)
            t = self._timings.get(rid)
            if t is not None and t.owner == owner:
                return "done" if rid in self._results else "pending"
            if rid in self._expired and self._expired[rid] == owner:
                return "expired"
            return "unknown"

    async def wait(self, rid: str, timeout: float | None = None) -> Result | None:
        """The result, waiting up to `timeout` (default poll_s) on the server's loop; None: not ready yet."""
        ev = asyncio.Event()
        with self._lock:
            if rid in self._results:
                return self._read(rid)
            self._waiters.setdefault(rid, []).append(ev)
        with contextlib.suppress(asyncio.TimeoutError):  # not ready: the caller answers try_again
            await asyncio.wait_for(ev.wait(), self.poll_s if timeout is None else timeout)
        with self._lock:
            if ev in self._waiters.get(rid, []):
                self._waiters[rid].remove(ev)
            return self._read(rid) if rid in self._results else None

    def _read(self, rid: str) -> Result:
        self._read_at.setdefault(rid, time.monotonic())
        return self._results[rid]

    def _evict(self, keep: str | None) -> None:
        """Drop results read more than keep_s ago or finished and unread for unread_s, then the oldest finished
        beyond max_kept (read ones first), never `keep` (the one being answered) (lock held)."""
        now = time.monotonic()

        def finished(r: str) -> float:
            t = self._timings.get(r)
            return t.finished if t is not None and t.finished is not None else now

        done = [r for r in self._results if r != keep]
        old = {r for r in done if (now - self._read_at[r] > self.keep_s if r in self._read_at else
                                   now - finished(r) > self.unread_s)}
        excess = len(self._results) - len(old) - self.max_kept
        if excess > 0:
            rest = sorted((r for r in done if r not in old), key=lambda r: (r not in self._read_at, finished(r)))
            old.update(rest[:excess])
        for r in old:
            self._results.pop(r, None)
            self._read_at.pop(r, None)
            t = self._timings.pop(r, None)
            self._expired[r] = t.owner if t is not None else None
        while len(self._expired) > self._max_expired:
            self._expired.popitem(last=False)

    def timing(self, rid: str) -> Timing | None:
        with self._lock:
            return self._timings.get(rid)

    def snapshot(self, owner: str | None = None, last: int = 50) -> dict:
        """Queue state, and the latest requests' timings of `owner` alone (GET /api/v1/shardfit/status): another
        principal's ids are never shown."""
        with self._lock:
            pending = [r for r in self._timings if r not in self._results]
            mine = [(r, t) for r, t in self._timings.items() if t.owner == owner]
            recent = sorted(mine, key=lambda kv: kv[1].submitted)[-last:]
            return {"pending": len(pending), "requests": {r: t.as_dict() for r, t in recent}}
