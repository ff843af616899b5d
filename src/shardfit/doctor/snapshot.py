"""Load CUDA caching-allocator snapshots (`torch.cuda.memory._dump_snapshot`) safely.

A snapshot is a pickle, and unpickling can run arbitrary code. `pickle_stream` builds only plain containers and
scalars (and the allowlisted OrderedDict/set/frozenset): any other reference to a Python global (the way a malicious
pickle runs code) is refused before anything runs. The work is bounded (limits.py: decompressed size, objects built,
nesting) and the structure is checked once, here, against the schema (snapshot_schema.py).

Formats from PyTorch 2.4 to 2.13 are accepted: the dict form ({"segments", "device_traces", ...}, optional keys may
be missing) and the legacy bare list of segments. Missing optional keys get neutral defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shardfit.doctor.limits import SNAPSHOT_DEPTH, SNAPSHOT_MIB, SNAPSHOT_OBJECTS, read_capped
from shardfit.doctor.pickle_stream import EventTrace, Malformed, OverLimit, load_plain
from shardfit.doctor.snapshot_schema import check_snapshot
from shardfit.errors import ShardfitError
from shardfit.safe_pickle import RefusedGlobal


@dataclass
class Snapshot:
    path: str
    segments: list[dict]
    trace: EventTrace | list[dict]  # the events of the traced device, oldest first (each read as a dict)
    device: int = 0
    allocator_settings: dict = field(default_factory=dict)
    annotations: list[dict] = field(default_factory=list)
    shardfit: dict = field(default_factory=dict)  # what shardfit's recorder adds: memory_fraction, device_total

    def stacks(self) -> list[list[dict]]:
        """Every distinct stack of the trace's events (once each when the trace is compact)."""
        return self.trace.stacks if isinstance(self.trace, EventTrace) else [ev["frames"] for ev in self.trace]

    @property
    def expandable(self) -> bool:
        if self.allocator_settings.get("expandable_segments"):
            return True
        return any(s.get("is_expandable") for s in self.segments)


def load_snapshot(path: str | Path) -> Snapshot:
    """Read, bounded (doctor/limits.py), check (snapshot_schema.py) and normalize one snapshot file."""
    path = Path(path)
    where = str(path)
    raw = read_capped(path, SNAPSHOT_MIB, "snapshot")
    try:
        data, compact = load_plain(raw, SNAPSHOT_OBJECTS.value(), SNAPSHOT_DEPTH.value())
    except RefusedGlobal as e:
        raise ShardfitError(f"not loaded: {e}; a memory snapshot holds only plain data, so this file is not one "
                            "or has been tampered with", where=where,
                            fix="pass the file _dump_snapshot wrote") from None
    except OverLimit as e:
        raise {"objects": SNAPSHOT_OBJECTS, "depth": SNAPSHOT_DEPTH}[e.limit].refuse(where, e.found) from None
    except Malformed as e:  # truncated, or not a pickle at all
        raise ShardfitError(f"not a readable pickle ({e})", where=where,
                            fix="pass a .pickle or .pickle.gz written by torch.cuda.memory._dump_snapshot") from None
    del raw
    parts = check_snapshot(data, compact, where)
    segments, traces = parts["segments"], parts["traces"]
    device = 0
    if segments:
        device = segments[0]["device"]
    elif traces:
        device = max(range(len(traces)), key=lambda i: len(traces[i]))
    trace = traces[device] if device < len(traces) else []
    if not len(trace) and any(len(t) for t in traces):  # events recorded for another device index
        device, trace = next((i, t) for i, t in enumerate(traces) if len(t))
    return Snapshot(where, segments, trace, device, parts["allocator_settings"], parts["annotations"],
                    parts["shardfit"])


def collect_paths(specs: list[str]) -> list[Path]:
    """Files as given; a directory contributes its *.pickle and *.pickle.gz files, sorted."""
    out: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.endswith((".pickle", ".pickle.gz", ".pkl")))
            if not found:
                raise ShardfitError("directory holds no .pickle or .pickle.gz snapshots", where=spec,
                                    fix="pass the snapshot files")
            out += found
        else:
            out.append(p)
    return out
