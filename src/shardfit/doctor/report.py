"""The doctor's outputs: a terminal report and a JSON document (schema "shardfit.doctor/1", versioned).

The JSON schema, field by field: docs/doctor.md. Within a version fields are only ever added; a consumer ignores keys
it does not know. Top level: schema, verdict (one line: the most important finding, or "no problems found"),
snapshots (per file: rank, device, memory cap and its source, the LAYOUT at the peak and at the dump, category
maxima), ranks (peak allocated and reserved per rank), findings (code, severity, title, evidence, fix, rank, and
figures: the numbers the evidence sentences are written from, keyed per finding code).
Invariants: all sizes are bytes (integers), fractions floats in [0, 1]; every "X GiB" or "X MiB" in a finding's
title, evidence and fix is one of its figures (tests/doctor check it). Categories:
shardfit.doctor.attribution.CATEGORIES.
"""

from __future__ import annotations

import dataclasses

from shardfit.doctor.diagnose import Finding, RankResult, gib, peak_phase
from shardfit.doctor.replay import Layout

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
