"""The doctor's outputs: a terminal report and a JSON document (schema below, versioned).

JSON schema, version 1 (fields are only ever added within a version; a consumer ignores keys it does not know):
  {"schema": "shardfit.doctor/1",
   "verdict": str,                                   one line: the most important finding, or "no problems found"
   "snapshots": [{"path", "rank", "device", "events", "expandable_segments",
                  "memory_fraction": float | null,   the per-process cap when known (memory/cap.py; 1.0: none) or null
                  "memory_fraction_source": "given" | "recorded" | "allocator_settings" | null,
                  "peak": LAYOUT, "end": LAYOUT, "peak_reserved", "peak_phase",
                  "category_max": {category: bytes}}],
   "ranks": [{"rank", "peak_allocated", "peak_reserved"}],
   "findings": [{"code", "severity", "title", "evidence": [str], "fix": [str], "rank", "figures": FIGURES[code]}]}
  LAYOUT = {"allocated", "reserved", "active", "pending_free", "free_in_segments", "free_in_split_segments",
            "largest_free", "rounding_waste" (end only, else null), "pending_blocks", "per_stream": {stream: {...}},
            "categories": {category: bytes}, "top_sites": [[site, bytes, blocks]]}
  FIGURES, the numbers the evidence sentences are written from (the layout is the OOM's moment, the peak, or the
  dump as "when" says):
    oom: {"asked", "stream", "stream_largest_free", "stream_free", "largest_free", "free_in_segments",
          "free_in_split_segments", "releasable" (free bytes in segments holding nothing: c10 releases them before
          an OOM, so ~0 at a real one), "pending_free", "pending_blocks" (count), "allocated", "reserved",
          "categories": {category: live bytes}, "device_free" (the driver's report),
          "memory_fraction" (1.0: known to be uncapped), "memory_fraction_source", "device_total",
          "device_total_source" ("given" | "recorded" | "estimate": reserved + device_free, a lower bound),
          "memory_cap" (bytes, null without a known cap),
          "headroom" (bytes the cache could still grow: device_free + releasable, at most
                      memory_cap - (reserved - releasable)),
          "would_fit": {"expandable_segments", "pending_completed", "expandable_segments_and_pending_completed",
                        "no_memory_cap"}: bool each, whether that change alone would have let the request through,
          "cause": "fragmentation" | "pending_free" | "fragmentation_and_pending_free" | "memory_cap" |
                   "unrecorded_memory_cap" (headroom covered the request and no cap is known; would_fit then assumes
                   none) | "unexplained" (headroom covered it under the known cap) | "capacity"}
    fragmentation (at the peak): {"allocated", "reserved", "pending_free", "unused", "unused_fraction",
          "free_in_split_segments", "largest_free", "peak_reserved", "expandable_segments"}
    pending_free: {"when": "peak" | "dump", "pending_free", "pending_blocks", "allocated", "reserved"}
    side_stream_cache (at the peak): {"compute_stream", "compute_allocated", "idle", "idle_fraction", "reserved",
          "streams": [{"stream", "reserved", "free"}]}
    imbalance: {"peaks": [{"rank", "peak_allocated", "peak_reserved", "category_bytes" (that rank's bytes of
          "category" at its peak)}], "outlier_rank", "others_median" (of peak_allocated, rounded down), "ratio",
          "category" (the one that differs most), "category_difference" (outlier minus the others' median, signed),
          "categories": {category: outlier bytes}}
    balanced: {"peaks": [{"rank", "peak_allocated", "peak_reserved"}], "min", "max", "spread" (max / min - 1)}
    fsdp_buffers: {"all_gather", "reduce_scatter", "rank"}
    Every "X GiB" or "X MiB" in a finding's title, evidence and fix is one of its figures (tests/memory check it).
All sizes are bytes (integers); fractions are floats in [0, 1]. Categories: see
shardfit.memory.attribution.CATEGORIES.
"""

from __future__ import annotations

import dataclasses

from shardfit.memory.diagnose import Finding, RankResult, gib, peak_phase
from shardfit.memory.replay import Layout

SCHEMA = "shardfit.doctor/1"


def verdict(findings: list[Finding]) -> str:
    serious = [f for f in findings if f.severity != "info"]
    return serious[0].title if serious else (findings[0].title if findings else "no problems found")


def _layout_json(lay: Layout) -> dict:
    d = dataclasses.asdict(lay)
    d.pop("index")
    d["per_stream"] = {str(k): v for k, v in lay.per_stream.items()}
    return d


def to_json(results: list[RankResult], findings: list[Finding]) -> dict:
    snaps = []
    for x in results:
        r = x.replay
        snaps.append({"path": x.path, "rank": x.rank, "device": r.snapshot.device, "events": len(r.snapshot.trace),
                      "expandable_segments": r.snapshot.expandable, "memory_fraction": x.memory_fraction,
                      "memory_fraction_source": x.memory_fraction_source, "peak": _layout_json(r.peak),
                      "end": _layout_json(r.end), "peak_reserved": r.peak_reserved, "peak_phase": peak_phase(r),
                      "category_max": r.category_max})
    return {"schema": SCHEMA, "verdict": verdict(findings), "snapshots": snaps,
            "ranks": [{"rank": x.rank, "peak_allocated": x.replay.peak.allocated,
                       "peak_reserved": x.replay.peak_reserved} for x in results],
            "findings": [dataclasses.asdict(f) for f in findings]}


def _layout_lines(title: str, lay: Layout) -> list[str]:
    lines = [f"  {title}: allocated {gib(lay.allocated)} | reserved {gib(lay.reserved)} | active {gib(lay.active)}"
             f" | pending free {gib(lay.pending_free)}",
             f"    free inside segments {gib(lay.free_in_segments)} "
             f"(in split segments {gib(lay.free_in_split_segments)}),"
             f" largest free block {gib(lay.largest_free)}"
             + (f", rounding waste {gib(lay.rounding_waste)}" if lay.rounding_waste is not None else "")]
    if len(lay.per_stream) > 1:
        for stream, st in sorted(lay.per_stream.items()):
            lines.append(f"    stream {stream}: reserved {gib(st['reserved'])}, allocated {gib(st['allocated'])}, "
                         f"pending {gib(st['pending_free'])}, free {gib(st['free'])} "
                         f"(largest {gib(st['largest_free'])})")
    return lines


def to_text(results: list[RankResult], findings: list[Finding]) -> str:
    out = [f"shardfit doctor: {verdict(findings)}", ""]
    for x in results:
        r = x.replay
        out.append(f"rank {x.rank}: {x.path} ({len(r.snapshot.trace):,} events, expandable segments "
                   f"{'on' if r.snapshot.expandable else 'off'})")
        phase = peak_phase(r)
        out += _layout_lines("at the peak" + (f" ({phase})" if phase else ""), r.peak)
        out += _layout_lines("at dump", r.end)
        if r.peak.categories:
            out.append("  the peak is made of: " + ", ".join(f"{k} {gib(v)}" for k, v in r.peak.categories.items()))
        for s, size, n in r.peak.top_sites[:3]:
            out.append(f"    {gib(size):>10} in {n} block(s) from {s}")
        out.append("")
    if len(results) > 1:
        out.append("rank  peak allocated  peak reserved")
        out += [f"{x.rank:>4}  {gib(x.replay.peak.allocated):>14}  {gib(x.replay.peak_reserved):>13}" for x in results]
        out.append("")
    for f in findings:
        who = f" [rank {f.rank}]" if f.rank is not None else ""
        out.append(f"{f.severity.upper()}{who}: {f.title}")
        out += [f"  - {e}" for e in f.evidence]
        out += [f"  fix: {x}" for x in f.fix]
    return "\n".join(out).rstrip() + "\n"
