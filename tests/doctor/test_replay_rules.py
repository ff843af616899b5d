"""Synthetic traces, one per allocator rule, with layouts computed by hand."""

from shardfit.doctor import examine
from tests.doctor.conftest import MB, ev, seg, write_snapshot

A = 0x7F0000000000
FWD = [{"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 1}]
OPT = [{"name": "step", "filename": "torch/optim/adamw.py", "line": 1}]


def _one(tmp_path, segments, trace, **kw):
    (res,), findings = examine([str(write_snapshot(tmp_path / "s.pickle", segments, trace, **kw))])
    return res.replay, {f.code: f for f in findings}


def test_splitting_and_blocks_from_before_recording(tmp_path):
    # dump: a 100 MiB segment holding A (before recording, no stack) and C; B was allocated and freed while recording
    segments = [seg(A, 100 * MB, [(0, 10 * MB, "active_allocated", []), (40 * MB, 20 * MB, "active_allocated", FWD),
                                  (10 * MB, 30 * MB, "inactive", []), (60 * MB, 40 * MB, "inactive", [])])]
    trace = [ev("alloc", A + 10 * MB, 30 * MB, frames=OPT), ev("alloc", A + 40 * MB, 20 * MB, frames=FWD),
             ev("free_requested", A + 10 * MB, 30 * MB), ev("free_completed", A + 10 * MB, 30 * MB)]
    r, _ = _one(tmp_path, segments, trace)
    assert list(r.allocated) == [40 * MB, 60 * MB, 30 * MB, 30 * MB]
    p = r.peak
    assert (p.allocated, p.reserved, p.free_in_segments, p.largest_free) == (60 * MB, 100 * MB, 40 * MB, 40 * MB)
    assert p.categories == {"optimizer_state": 30 * MB, "activations": 20 * MB, "unknown": 10 * MB}
    assert r.end.free_in_split_segments == 70 * MB and r.end.largest_free == 40 * MB
    assert r.category_max == {"optimizer_state": 30 * MB, "activations": 20 * MB}


def test_stream_pools_and_pending_free(tmp_path):
    s1, s2 = A, A + (1 << 30)
    segments = [seg(s1, 64 * MB, [(0, 64 * MB, "active_pending_free", FWD)], stream=7),
                seg(s2, 32 * MB, [(0, 8 * MB, "active_allocated", FWD), (8 * MB, 24 * MB, "inactive", [])], stream=0)]
    trace = [ev("segment_alloc", s1, 64 * MB, stream=7), ev("alloc", s1, 64 * MB, stream=7, frames=FWD),
             ev("free_requested", s1, 64 * MB, stream=7)]
    r, codes = _one(tmp_path, segments, trace)
    e = r.end
    assert (e.allocated, e.pending_free, e.active, e.pending_blocks) == (8 * MB, 64 * MB, 72 * MB, 1)
    assert e.per_stream[7] == {"reserved": 64 * MB, "allocated": 0, "pending_free": 64 * MB, "free": 0,
                               "largest_free": 0}
    assert e.per_stream[0]["free"] == 24 * MB
    assert r.peak.allocated == 72 * MB and r.reserved[0] == 96 * MB
    assert "pending_free" in codes


def test_expandable_segments_map_and_unmap(tmp_path):
    # one expandable segment mapped in 2 MiB pages; the last page was unmapped before the dump
    segments = [seg(A, 6 * MB, [(0, 2 * MB, "active_allocated", FWD), (2 * MB, 4 * MB, "inactive", [])],
                    expandable=True)]
    trace = [ev("segment_map", A, 2 * MB), ev("segment_map", A + 2 * MB, 2 * MB), ev("segment_map", A + 4 * MB, 2 * MB),
             ev("segment_map", A + 6 * MB, 2 * MB), ev("alloc", A, 2 * MB, frames=FWD),
             ev("alloc", A + 2 * MB, 6 * MB, frames=FWD), ev("free_requested", A + 2 * MB, 6 * MB),
             ev("free_completed", A + 2 * MB, 6 * MB), ev("segment_unmap", A + 6 * MB, 2 * MB)]
    r, codes = _one(tmp_path, segments, trace, expandable=True)
    assert list(r.reserved) == [2 * MB, 4 * MB, 6 * MB, 8 * MB, 8 * MB, 8 * MB, 8 * MB, 8 * MB, 6 * MB]
    assert r.peak.allocated == 8 * MB and r.peak.reserved == 8 * MB and r.peak.free_in_segments == 0
    assert r.end.free_in_segments == 4 * MB and r.end.largest_free == 4 * MB  # free run crosses page boundaries
    assert "fragmentation" not in codes


def test_oom_explained_as_fragmentation_or_capacity(tmp_path):
    # 1 GiB segment: live 100 MiB | hole 300 | live 100 | hole 300 | live 224; the request of 500 MiB fits nowhere
    blocks = [(0, 100 * MB, "active_allocated", FWD), (100 * MB, 300 * MB, "inactive", []),
              (400 * MB, 100 * MB, "active_allocated", FWD), (500 * MB, 300 * MB, "inactive", []),
              (800 * MB, 224 * MB, "active_allocated", FWD)]
    oom = ev("oom", 0, 500 * MB, device_free=0)
    r, codes = _one(tmp_path, [seg(A, 1024 * MB, blocks)], [oom])
    f = codes["oom"]
    assert f.severity == "error" and "fragmentation" in f.title and "expandable_segments:True" in f.fix[0]
    assert r.ooms[0][1].largest_free == 300 * MB
    r, codes = _one(tmp_path, [seg(A, 1024 * MB, blocks)], [ev("oom", 0, 2048 * MB, device_free=100 * MB)])
    assert "too many live tensors" in codes["oom"].title


def test_memory_cached_by_a_side_stream_at_the_peak(tmp_path):
    # stream 9 (a reduce-scatter stream) held 1.5 GiB of gradients, freed before the compute stream's peak of 2 GiB
    GB = 1024 * MB
    s9, s0 = A, A + (8 << 30)
    segments = [seg(s9, 1536 * MB, [(0, 1536 * MB, "inactive", [])], stream=9),
                seg(s0, 2 * GB, [(0, 2 * GB, "inactive", [])], stream=0)]
    trace = [ev("segment_alloc", s9, 1536 * MB, stream=9), ev("alloc", s9, 1536 * MB, stream=9, frames=OPT),
             ev("free_requested", s9, 1536 * MB, stream=9), ev("free_completed", s9, 1536 * MB, stream=9),
             ev("segment_alloc", s0, 2 * GB), ev("alloc", s0, 2 * GB, frames=FWD),
             ev("free_requested", s0, 2 * GB), ev("free_completed", s0, 2 * GB)]
    r, codes = _one(tmp_path, segments, trace)
    assert r.peak.allocated == 2 * GB and r.peak.reserved == 2 * GB + 1536 * MB
    f = codes["side_stream_cache"]
    assert f.title.startswith("1.50 GiB cached by side streams") and "set_to_none=False" in f.fix[0]
    assert "stream 9: reserved 1.50 GiB, free 1.50 GiB" in f.evidence
