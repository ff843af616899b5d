import os
import pickle

import pytest

from shardfit.doctor import load_snapshot
from shardfit.errors import ShardfitError
from tests.doctor.conftest import MB, seg, write_snapshot


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Exploit(marker)]]}))
    with pytest.raises(ShardfitError, match=r"evil.pickle: not loaded: refused to load global '(posix|os)\.system'"):
        load_snapshot(bad)
    assert not marker.exists()
    pickle.loads(bad.read_bytes())  # the same bytes through plain pickle do run the command
    assert marker.exists()


@pytest.mark.parametrize("content, needle", [
    (pickle.dumps([1, 2, 3]), r"segments\[0\] is an int, not a segment"),
    (pickle.dumps("text"), "not a CUDA memory snapshot"),
    (pickle.dumps({"segments": "x"}), "segments is a str, not a list of segments"),
    (b"definitely not a pickle", "not a readable pickle"),
    (pickle.dumps({"segments": [], "device_traces": [[]]})[:-5], "not a readable pickle"),
    (b"\x1f\x8b\x08\x00garbage", "corrupt gzip data"),
])
def test_not_a_snapshot_is_a_clear_error(tmp_path, content, needle):
    f = tmp_path / "x.pickle"
    f.write_bytes(content)
    with pytest.raises(ShardfitError, match=needle) as e:
        load_snapshot(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_formats_gzip_legacy_and_missing_keys(tmp_path):
    segs = [seg(0x1000000, 4 * MB, [(0, MB, "active_allocated", [])])]
    gz = write_snapshot(tmp_path / "a.pickle.gz", segs, [], compress=True)
    assert load_snapshot(gz).segments[0]["total_size"] == 4 * MB
    legacy = tmp_path / "legacy.pickle"  # torch.cuda.memory_snapshot(): a bare list; old blocks lack keys
    legacy.write_bytes(pickle.dumps([{"device": 0, "address": 16, "total_size": 2 * MB,
                                      "blocks": [{"address": 16, "size": MB, "state": "active_allocated"}]}]))
    s = load_snapshot(legacy)
    assert s.trace == [] and s.segments[0]["stream"] == 0 and s.segments[0]["blocks"][0]["requested_size"] == MB
    with pytest.raises(ShardfitError, match="snapshot file not found"):
        load_snapshot(tmp_path / "missing.pickle")


def test_oldest_layout_without_optional_keys_replays(tmp_path):
    """PyTorch 2.4-era files: no time_us/stream/frames on events, no stream or expandable flag on segments, no
    requested_size on blocks, no allocator_settings or annotations, and the events recorded for device 1."""
    from shardfit.doctor import examine

    segs = [{"device": 1, "address": 0x2000000, "total_size": 8 * MB,
             "blocks": [{"address": 0x2000000, "size": 2 * MB, "state": "active_allocated"},
                        {"address": 0x2200000, "size": 6 * MB, "state": "inactive"}]}]
    trace = [{"action": "alloc", "addr": 0x2000000, "size": 2 * MB},
             {"action": "alloc", "addr": 0x2200000, "size": 6 * MB},
             {"action": "free_requested", "addr": 0x2200000, "size": 6 * MB},
             {"action": "free_completed", "addr": 0x2200000, "size": 6 * MB}]
    path = tmp_path / "old_rank0.pickle"
    path.write_bytes(pickle.dumps({"segments": segs, "device_traces": [[], trace]}, protocol=2))
    (res,), findings = examine([str(path)])
    r = res.replay
    assert r.snapshot.device == 1 and len(r.snapshot.trace) == 4
    assert r.peak.allocated == 8 * MB and r.peak.reserved == 8 * MB and r.end.allocated == 2 * MB
    assert r.snapshot.trace[0]["stream"] == 0 and r.snapshot.trace[0]["frames"] == []
