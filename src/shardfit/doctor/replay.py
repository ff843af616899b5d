"""Replay a snapshot's trace: memory over time, and the allocator's exact layout at chosen moments.

The trace starts when recording started, after tensors already existed; the segments list is the layout at dump
time. So the layout at any earlier event is reconstructed backwards: start from the dump layout and undo events
newest first. Totals over time come from one forward pass of deltas anchored at the dump totals.

Counter rules (those of c10's caching allocator): `alloc` adds a block to allocated and active; `free_requested`
(Python freed the tensor) removes it from allocated, but it stays active, "pending free", until every stream that
used it is done (`free_completed`). `segment_alloc`/`segment_free` (and `segment_map`/`segment_unmap` with expandable
segments) change reserved. Event sizes are block sizes: allocation rounding is included, as in memory_stats().
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardfit.doctor.attribution import categorize, site
from shardfit.doctor.snapshot import Snapshot

_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class Block:
    size: int
    stream: int
    pending: bool  # freed by Python, held until another stream's work completes
    frames: list
    requested: int | None = None


@dataclass
class Layout:
    """Totals and free-space shape of the cache at one moment (bytes)."""

    index: int  # event index the layout follows; len(trace) - 1 is the dump, -1 the start of recording
    allocated: int
    reserved: int
    active: int
    pending_free: int
    free_in_segments: int
    free_in_split_segments: int  # free bytes in segments that also hold live blocks: not releasable
    largest_free: int
    per_stream: dict[int, dict[str, int]]
    categories: dict[str, int]
    top_sites: list[tuple[str, int, int]]  # (site, bytes, blocks)
    rounding_waste: int | None = None
    pending_blocks: int = 0


@dataclass
class Replay:
    snapshot: Snapshot
    times: Sequence[int] = field(default_factory=list)  # time_us per event (an array('q') after replay)
    allocated: Sequence[int] = field(default_factory=list)  # after each event
    reserved: Sequence[int] = field(default_factory=list)
    peak_index: int = -1
    peak: Layout | None = None
    end: Layout | None = None
    ooms: list[tuple[dict, Layout]] = field(default_factory=list)
    # Largest live bytes per category over the trace, counting only blocks allocated while recording.
    category_max: dict[str, int] = field(default_factory=dict)
    # About 2,000 points of the timeline: (event index, {category: live bytes}); "before recording" holds what was
    # allocated before the trace began (minus its frees), so each point's categories add up to allocated.
    samples: list[tuple[int, dict[str, int]]] = field(default_factory=list)

    @property
    def peak_allocated(self) -> int:
        return self.peak.allocated

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved) if self.reserved else self.end.reserved


def _dump_layout(snap: Snapshot) -> tuple[dict[int, list], dict[int, Block]]:
    ranges: dict[int, list] = {}  # start -> [size, stream]
    blocks: dict[int, Block] = {}
    for seg in snap.segments:
        ranges[seg["address"]] = [seg["total_size"], seg["stream"]]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[b["address"]] = Block(b["size"], seg["stream"], b["state"] == "active_pending_free",
                                             b.get("frames", []), b.get("requested_size"))
    return ranges, blocks


def _remove_range(ranges: dict[int, list], addr: int, size: int) -> None:
    if addr in ranges and ranges[addr][0] == size:
        del ranges[addr]
        return
    for start, (rsize, stream) in list(ranges.items()):  # part of a larger (expandable) range
        if start <= addr < start + rsize:
            del ranges[start]
            if addr > start:
                ranges[start] = [addr - start, stream]
            if addr + size < start + rsize:
                ranges[addr + size] = [start + rsize - addr - size, stream]
            return


def _stream_stats() -> dict[str, int]:
    return {"reserved": 0, "allocated": 0, "pending_free": 0, "free": 0, "largest_free": 0}


def _summarize(index: int, ranges: dict[int, list], blocks: dict[int, Block], with_rounding: bool) -> Layout:
    starts = sorted(ranges)
    # Merge touching ranges (pages of one expandable segment) so a free run may cross them.
    merged: list[list[int]] = []  # [start, end, stream]
    for s in starts:
        size, stream = ranges[s]
        if merged and merged[-1][1] == s and merged[-1][2] == stream:
            merged[-1][1] = s + size
        else:
            merged.append([s, s + size, stream])
    mstarts = [m[0] for m in merged]
    used: dict[int, list[tuple[int, int]]] = {}
    per_stream: dict[int, dict[str, int]] = {}
    allocated = pending = n_pending = 0
    cats: dict[str, int] = {}
    sites: dict[str, list[int]] = {}
    waste = 0
    for addr, b in blocks.items():
        i = bisect.bisect_right(mstarts, addr) - 1
        if i >= 0:
            used.setdefault(i, []).append((addr, addr + b.size))
        st = per_stream.setdefault(b.stream, _stream_stats())
        if b.pending:
            pending += b.size
            n_pending += 1
            st["pending_free"] += b.size
            continue
        allocated += b.size
        st["allocated"] += b.size
        cat = categorize(b.frames)
        cats[cat] = cats.get(cat, 0) + b.size
        entry = sites.setdefault(site(b.frames), [0, 0])
        entry[0] += b.size
        entry[1] += 1
        if with_rounding and b.requested is not None:
            waste += b.size - b.requested
    free_total = free_split = largest = 0
    for i, (start, end, stream) in enumerate(merged):
        st = per_stream.setdefault(stream, _stream_stats())
        st["reserved"] += end - start
        cursor, free_here, big = start, 0, 0
        for lo, hi in sorted(used.get(i, [])):
            if lo > cursor:
                free_here += lo - cursor
                big = max(big, lo - cursor)
            cursor = max(cursor, hi)
        if end > cursor:
            free_here += end - cursor
            big = max(big, end - cursor)
        free_total += free_here
        if used.get(i):
            free_split += free_here
        largest = max(largest, big)
        st["free"] += free_here
        st["largest_free"] = max(st["largest_free"], big)
    top = sorted(((k, v[0], v[1]) for k, v in sites.items()), key=lambda t: -t[1])[:10]
    cats = {k: v for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if v}
    return Layout(index, allocated, sum(m[1] - m[0] for m in merged), allocated + pending, pending, free_total,
                  free_split, largest, per_stream, cats, top,
                  waste if with_rounding else None, n_pending)


def replay(snap: Snapshot) -> Replay:
    trace = snap.trace
    ranges, blocks = _dump_layout(snap)
    end_alloc = sum(b.size for b in blocks.values() if not b.pending)
    end_resv = sum(r[0] for r in ranges.values())
    # Forward pass: deltas, per-category live bytes, and for each free the index of the alloc it frees (its frames).
    # Per-event results live in typed arrays (8 bytes an event, not a Python int object each): with a million events
    # the replay must stay within a few times the file's size.
    n = len(trace)
    d_alloc = d_resv = 0
    deltas_a, deltas_r, times = array("q"), array("q"), array("q")
    open_alloc: dict[int, int] = {}  # addr -> index of the live allocation made while recording
    pending: dict[int, int] = {}  # addr -> index of the allocation freed by Python, not yet completed
    alloc_of = array("q", bytes(8 * n))  # free event -> index of its allocation + 1 (0: none)
    cat_codes: dict[str, int] = {}
    cat_names: list[str] = []
    cat_of = array("H", bytes(2 * n))  # alloc event -> category code
    cat_cache: dict[int, int] = {}  # id(frames) -> category code (interned stacks repeat)
    live: dict[str, int] = {}
    cat_max: dict[str, int] = {}
    freed_before = 0  # bytes freed while recording that were allocated before recording began
    every = max(1, n // 2000)
    raw_samples: list[tuple[int, dict[str, int], int]] = []
    for j, ev in enumerate(trace):
        action, addr = ev["action"], ev.get("addr", 0)
        if action == "alloc":
            d_alloc += ev["size"]
            open_alloc[addr] = j
            frames = ev["frames"]
            code = cat_cache.get(id(frames))
            if code is None:
                cat = categorize(frames)
                code = cat_cache[id(frames)] = cat_codes.setdefault(cat, len(cat_codes))
                if code == len(cat_names):
                    cat_names.append(cat)
            cat_of[j] = code
            cat = cat_names[code]
            live[cat] = live.get(cat, 0) + ev["size"]
            cat_max[cat] = max(cat_max.get(cat, 0), live[cat])
        elif action == "free_requested":
            d_alloc -= ev["size"]
            a = open_alloc.pop(addr, None)
            if a is None:
                freed_before += ev["size"]
            else:
                alloc_of[j] = a + 1
                pending[addr] = a
                live[cat_names[cat_of[a]]] -= ev["size"]
        elif action == "free_completed":
            if addr in pending:
                alloc_of[j] = pending.pop(addr) + 1
        elif action in _RESERVE:
            d_resv += _RESERVE[action] * ev["size"]
        deltas_a.append(d_alloc)
        deltas_r.append(d_resv)
        times.append(ev.get("time_us", 0))
        if j % every == 0 or j == n - 1:
            raw_samples.append((j, {k: v for k, v in live.items() if v}, freed_before))
    base_a, base_r = end_alloc - d_alloc, end_resv - d_resv
    r = Replay(snap, times, array("q", (base_a + d for d in deltas_a)), array("q", (base_r + d for d in deltas_r)),
               category_max={k: v for k, v in sorted(cat_max.items(), key=lambda kv: -kv[1]) if v},
               samples=[(j, {"before recording": base_a - fb, **cats}) for j, cats, fb in raw_samples])
    del deltas_a, deltas_r
    if r.allocated and max(r.allocated) > end_alloc:
        r.peak_index = max(range(len(r.allocated)), key=r.allocated.__getitem__)
    else:
        r.peak_index = len(trace) - 1  # the dump itself is the peak (or there is no trace)
    oom_idx = [j for j, ev in enumerate(trace) if ev["action"] == "oom"]
    wanted = sorted({r.peak_index, *oom_idx}, reverse=True)
    r.end = _summarize(len(trace) - 1, ranges, blocks, with_rounding=True)
    layouts: dict[int, Layout] = {len(trace) - 1: r.end}
    # Backward walk: undo events newest first, capturing the layout after each wanted index.
    j = len(trace) - 1
    for target in wanted:
        while j > target:
            ev = trace[j]
            action, addr, size = ev["action"], ev.get("addr", 0), ev.get("size", 0)
            src = trace[alloc_of[j] - 1]["frames"] if alloc_of[j] else []
            if action == "alloc":
                blocks.pop(addr, None)
            elif action == "free_requested":
                old = blocks.get(addr)
                blocks[addr] = Block(size, ev["stream"], False, old.frames if old else src)
            elif action == "free_completed":
                blocks[addr] = Block(size, ev["stream"], True, src)
            elif action in ("segment_alloc", "segment_map"):
                _remove_range(ranges, addr, size)
            elif action in ("segment_free", "segment_unmap"):
                ranges[addr] = [size, ev["stream"]]
            j -= 1
        if target not in layouts:
            layouts[target] = _summarize(target, ranges, blocks, with_rounding=False)
    r.peak = layouts[r.peak_index]
    r.ooms = [(trace[k], layouts[k]) for k in sorted(oom_idx)]
    return r


def phase_at(snap: Snapshot, time_us: int) -> str | None:
    """The record_function range (FSDP::..., Optimizer.step...) open at time_us, else the last one started before."""
    open_ranges: list[str] = []
    last = None
    for a in sorted(snap.annotations, key=lambda a: a.get("time_us", 0)):
        if a.get("time_us", 0) > time_us:
            break
        if a.get("stage") == "START":
            open_ranges.append(a.get("name", "?"))
            last = a.get("name", "?")
        elif a.get("stage") == "END" and a.get("name") in open_ranges:
            open_ranges.remove(a.get("name"))
    if open_ranges:
        return f"inside {open_ranges[-1]}"
    return f"after {last}" if last else None
