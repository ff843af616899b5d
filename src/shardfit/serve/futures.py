"""request_id -> result, with the long poll of /retrieve_future and each request's timings.

Every mutating call answers {request_id} at once; the SDK then polls /retrieve_future and re-polls a try_again at
once, without sleeping, so a poll is held here until the result is ready or `poll_s` passes
(well under the client's 45 s timeout). Results are set by the command loop's thread (`complete`) and awaited on
the HTTP server's event loop (`wait`): the hand-over is loop.call_soon_threadsafe. A result stays retrievable for
`keep_s` after it is first read (a retry of a lost answer gets it again), then it is dropped; an id dropped or never
issued is 'expired' (HTTP 410, which the SDK answers by re-submitting a sample) or unknown (404).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    """A finished request: a JSON object, or protobuf bytes (ForwardBackwardOutput, SampleResponse), or an error."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"  # "user" | "server" (Tinker's RequestErrorCategory)

    def body(self) -> dict | bytes:
        if self.error is not None:
            return {"error": self.error, "category": self.category}
        return self.proto if self.proto is not None else (self.json or {})


@dataclass
class Timing:
    """Seconds on the server: waiting in the queue (including for earlier seq_ids), then running."""

    kind: str
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
    def __init__(self, poll_s: float = 20.0, keep_s: float = 600.0, max_kept: int = 4096):
        self.poll_s, self.keep_s, self.max_kept = poll_s, keep_s, max_kept
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._results: dict[str, Result] = {}
        self._timings: dict[str, Timing] = {}
        self._read_at: dict[str, float] = {}
        self._waiters: dict[str, list[asyncio.Event]] = {}
        self._issued = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the HTTP server's loop, set at its start-up

    def create(self, kind: str) -> str:
        with self._lock:
            n = next(self._ids)
            self._issued = n
            rid = f"req-{n}"
            self._timings[rid] = Timing(kind)
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
        if waiters and self.loop is not None:
            for ev in waiters:
                self.loop.call_soon_threadsafe(ev.set)

    def state(self, rid: str) -> str:
        """'done', 'pending', 'expired' (issued, then dropped) or 'unknown'."""
        with self._lock:
            if rid in self._results:
                return "done"
            if rid in self._timings:
                return "pending"
            n = rid[4:] if rid.startswith("req-") else ""
            return "expired" if n.isdigit() and 0 < int(n) <= self._issued else "unknown"

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
        result = self._results[rid]
        self._evict(keep=rid)
        self._read_at.setdefault(rid, time.monotonic())
        return result

    def _evict(self, keep: str) -> None:
        """Drop results read more than keep_s ago, and the oldest read ones beyond max_kept, but `keep` (the one
        being read now) (lock held)."""
        now = time.monotonic()
        old = [r for r, t in self._read_at.items() if now - t > self.keep_s and r != keep]
        excess = len(self._read_at) - len(old) - self.max_kept
        if excess > 0:
            old += sorted((r for r in self._read_at if r not in old and r != keep), key=self._read_at.get)[:excess]
        for r in old:
            self._results.pop(r, None)
            self._timings.pop(r, None)
            self._read_at.pop(r, None)

    def timing(self, rid: str) -> Timing | None:
        with self._lock:
            return self._timings.get(rid)

    def snapshot(self, last: int = 50) -> dict:
        """Queue state and the latest requests' timings (GET /api/v1/shardfit/status)."""
        with self._lock:
            pending = [r for r in self._timings if r not in self._results]
            recent = sorted(self._timings.items(), key=lambda kv: kv[1].submitted)[-last:]
            return {"pending": len(pending), "requests": {r: t.as_dict() for r, t in recent}}
