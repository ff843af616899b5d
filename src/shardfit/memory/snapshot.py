"""Load CUDA caching-allocator snapshots (`torch.cuda.memory._dump_snapshot`) safely.

A snapshot is a pickle, and unpickling can run arbitrary code. `shardfit.safe_pickle` admits only plain containers and
scalars: any reference to a Python global (the way a malicious pickle runs code) is refused before anything runs.

Formats from PyTorch 2.4 to 2.13 are accepted: the dict form ({"segments", "device_traces", ...}, optional keys may
be missing) and the legacy bare list of segments. Missing optional keys get neutral defaults.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.memory.pickle_stream import EventTrace, NeedsFullUnpickler, load_plain
from shardfit.safe_pickle import RefusedGlobal, safe_loads


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


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ShardfitError("snapshot file not found", where=str(path), fix="check the path") from None
    except IsADirectoryError:
        raise ShardfitError("is a directory", where=str(path), fix="pass snapshot files or one directory") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ShardfitError(f"corrupt gzip data ({e})", where=str(path), fix="re-copy the snapshot") from None
    return raw


def _normalize_block(b: dict) -> dict:
    b.setdefault("requested_size", b.get("size", 0))
    b.setdefault("frames", [])
    b.setdefault("state", "active_allocated")
    return b


def _normalize_segment(s: dict) -> dict:
    s.setdefault("stream", 0)
    s.setdefault("segment_type", "large" if s.get("total_size", 0) > (1 << 20) else "small")
    s.setdefault("is_expandable", False)
    s.setdefault("frames", [])
    s["blocks"] = [_normalize_block(b) for b in s.get("blocks", [])]
    return s


def load_snapshot(path: str | Path) -> Snapshot:
    path = Path(path)
    raw = _read_bytes(path)
    compact: dict[int, EventTrace] = {}
    try:
        try:
            data, compact = load_plain(raw)  # events straight into columns (see pickle_stream)
        except NeedsFullUnpickler:
            data = safe_loads(raw)  # containers of older PyTorch versions, through the allowlist
    except RefusedGlobal as e:
        raise ShardfitError(f"not loaded: {e}; a memory snapshot holds only plain data, so this file is not one "
                            "or has been tampered with", where=str(path),
                            fix="pass the file _dump_snapshot wrote") from None
    except Exception as e:  # truncated or not a pickle at all: EOFError, ValueError, ...
        raise ShardfitError(f"not a readable pickle ({type(e).__name__}: {e})", where=str(path),
                            fix="pass a .pickle or .pickle.gz written by torch.cuda.memory._dump_snapshot") from None
    if isinstance(data, list):  # legacy: torch.cuda.memory_snapshot() output, segments only
        data = {"segments": data}
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list) or not all(
            isinstance(s, dict) and "total_size" in s for s in data["segments"]):
        raise ShardfitError("not a CUDA memory snapshot (no 'segments' list)", where=str(path),
                            fix="pass the file torch.cuda.memory._dump_snapshot() wrote")
    segments = [_normalize_segment(s) for s in data["segments"]]
    traces = data.get("device_traces") or []
    device = 0
    if segments:
        device = segments[0].get("device", 0)
    elif traces:
        device = max(range(len(traces)), key=lambda i: len(traces[i] or []))
    traces = [compact.get(id(t)) or list(t or []) for t in traces]  # an EventTrace, or plain dicts
    trace = traces[device] if device < len(traces) else []
    if not len(trace) and any(len(t) for t in traces):  # events recorded for another device index
        device, trace = next((i, t) for i, t in enumerate(traces) if len(t))
    if isinstance(trace, list):
        for ev in trace:
            ev.setdefault("frames", [])
            ev.setdefault("stream", 0)
    extra = data.get("shardfit")
    return Snapshot(str(path), segments, trace, device, data.get("allocator_settings") or {},
                    data.get("external_annotations") or [], extra if isinstance(extra, dict) else {})


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
