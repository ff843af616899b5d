import gzip
import os
import pickle
from pathlib import Path

import pytest

FIXTURES = Path(os.environ.get("SHARDFIT_FIXTURES",
                               Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "snapshots"))


@pytest.fixture
def fixtures() -> Path:
    if not (FIXTURES / "MANIFEST.md").is_file():
        pytest.skip(f"real snapshots not found at {FIXTURES} (set SHARDFIT_FIXTURES)")
    return FIXTURES


MB = 1 << 20


def seg(addr, size, blocks=(), stream=0, expandable=False):
    """A dump-time segment; blocks are (offset, size, state, frames)."""
    return {"device": 0, "address": addr, "total_size": size, "stream": stream, "segment_type": "large",
            "is_expandable": expandable, "frames": [],
            "blocks": [{"address": addr + off, "size": sz, "requested_size": sz, "state": st, "frames": fr}
                       for off, sz, st, fr in blocks]}


def ev(action, addr, size, stream=0, frames=(), t=0, **extra):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": list(frames),
            **extra}


def write_snapshot(path: Path, segments, trace, expandable=False, compress=False):
    data = {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": expandable},
            "external_annotations": []}
    raw = pickle.dumps(data)
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path
