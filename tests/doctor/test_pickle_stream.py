"""The compact snapshot reader gives back exactly what pickle gives, for real and synthetic snapshots."""

import collections
import pickle

import pytest

from shardfit.doctor.pickle_stream import EventTrace, Malformed, load_plain
from shardfit.doctor.snapshot import load_snapshot
from tests.doctor.conftest import MB, ev, seg, write_snapshot


def _expand(obj, compact):
    """The reader's output with each compacted event list turned back into dicts."""
    if isinstance(obj, list):
        if id(obj) in compact:
            return list(compact[id(obj)])
        return [_expand(x, compact) for x in obj]
    if isinstance(obj, dict):
        return {k: _expand(v, compact) for k, v in obj.items()}
    return obj


def test_real_snapshots_read_the_same_as_pickle(fixtures):
    for path in sorted(fixtures.glob("*.pickle")):
        raw = path.read_bytes()
        data, compact = load_plain(raw)
        want = pickle.loads(raw)
        # the events were stored in columns (every event of every traced device)
        assert sum(len(t) for t in compact.values()) == sum(len(t) for t in want.get("device_traces") or []), path
        assert _expand(data, compact) == want, path.name


SHARED = [{"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 7}]


def _synthetic():
    trace = [ev("segment_alloc", 0x1000, 2 * MB, stream=3, t=1, frames=SHARED),
             ev("alloc", 0x1000, 512, stream=3, t=2, frames=SHARED), ev("alloc", 0x1200, 1 << 40, t=3),
             ev("free_requested", 0x1000, 512, stream=3, t=4), ev("free_completed", 0x1000, 512, stream=3, t=5),
             ev("oom", 0, 3 * MB, t=6, device_free=1024, compile_context="N/A"),
             ev("snapshot", 0, 0, t=7, user_metadata="")]
    trace[2]["frames"] = trace[1]["frames"]  # one stack list referenced by two events (pickle memo)
    return {"segments": [seg(0x1000, 2 * MB, [(0, 512, "active_allocated", SHARED)])],
            "device_traces": [trace, []], "allocator_settings": {"expandable_segments": True}, "nested": (1, 2.5, None)}


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_protocol_and_extra_keys_round_trip(protocol):
    snap = _synthetic()
    raw = pickle.dumps(snap, protocol=protocol)
    data, compact = load_plain(raw)
    assert _expand(data, compact) == pickle.loads(raw)
    (trace,) = compact.values()
    assert isinstance(trace, EventTrace) and len(trace) == 7
    assert trace[-2]["device_free"] == 1024 and trace[-2]["compile_context"] == "N/A"
    assert len(trace.stacks) == 2  # [] and SHARED: stacks are stored once


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_containers_of_older_versions_are_read_through_the_allowlist(tmp_path, protocol):
    snap = _synthetic()
    snap["allocator_settings"] = collections.OrderedDict(snap["allocator_settings"])  # pickled as a global
    snap["tags"], snap["frozen"] = {"a", "b"}, frozenset([1, 2])  # REDUCE of set/frozenset under protocols 2-3
    raw = pickle.dumps(snap, protocol=protocol)
    data, compact = load_plain(raw)
    assert _expand(data, compact) == pickle.loads(raw)
    assert type(data["allocator_settings"]) is collections.OrderedDict
    path = tmp_path / "old.pickle"
    path.write_bytes(raw)
    loaded = load_snapshot(path)
    assert isinstance(loaded.trace, EventTrace) and len(loaded.trace) == 7 and loaded.expandable


def test_text_protocols_are_refused_not_handed_to_a_full_unpickler():
    with pytest.raises(Malformed, match="opcode 0x28 at byte 0 is not one a memory snapshot uses|not one"):
        load_plain(pickle.dumps({"segments": []}, protocol=0))


def test_truncated_snapshot_is_a_clear_error(tmp_path):
    from shardfit.errors import ShardfitError

    good = write_snapshot(tmp_path / "s.pickle", [seg(0x1000, 2 * MB)], [ev("alloc", 0x1000, 512)])
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(ShardfitError, match="not a readable pickle"):
        load_snapshot(cut)
