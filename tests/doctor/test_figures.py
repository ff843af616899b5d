"""The doctor's numeric figures (JSON `findings[].figures`) against the real snapshots' ground truth (MANIFEST.md),
and OOM verdicts with a per-process memory cap from each place the doctor learns it."""

import json
import pickle
import subprocess

import pytest

from shardfit.doctor import examine
from shardfit.errors import ShardfitError
from tests.doctor.conftest import MB, ev, seg, write_snapshot
from tests.doctor.test_fixtures import TRUTH

GB = 1 << 30
A = 0x7F0000000000
FWD = [{"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 1}]
# MANIFEST.md, "allocated at dump" (the other columns are in TRUTH)
ALLOC_AT_DUMP = {"varlen_default": 1324478464, "record_stream_pending": 116371456, "fsdp2_train_rank0": 1745027072}


def _doctor(*args) -> subprocess.CompletedProcess:
    """`shardfit doctor ARGS` through the CLI's entry point in this process (shardfit.cli.main.main, as the console
    script calls it; tests/cli/session.py's way): its exit code, stdout and stderr, without a process of its own
    (an interpreter and torch started for each took ~1.5 s a command). The command as its own process, exit code
    and output at the file descriptors: tests/doctor/test_fixtures.py's test_cli_text_and_json."""
    import contextlib
    import io

    from shardfit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["doctor", *map(str, args)])
    return subprocess.CompletedProcess(["shardfit", "doctor", *map(str, args)], code, out.getvalue(), err.getvalue())


def _doctor_json(*paths):
    p = _doctor("--json", *paths)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _figures(doc, code):
    (f,) = [f for f in doc["findings"] if f["code"] == code]
    return f["figures"]


def _close(x, truth, tol=0.01):
    return abs(x - truth) / truth < tol


def test_fixture_figures_match_ground_truth(fixtures):
    doc = _doctor_json(fixtures / "record_stream_pending.pickle")
    f = _figures(doc, "pending_free")
    _, _, resv = TRUTH["record_stream_pending"]
    assert (f["when"], f["pending_blocks"], f["pending_free"]) == ("dump", 6, 6 * 512 * MB)  # MANIFEST: six times 512
    assert (f["reserved"], f["allocated"]) == (resv, ALLOC_AT_DUMP["record_stream_pending"])
    assert doc["snapshots"][0]["memory_fraction"] is None  # PyTorch recorded no cap, and none was given

    f = _figures(_doctor_json(fixtures / "varlen_default.pickle"), "fragmentation")
    peak_alloc, peak_resv, _ = TRUTH["varlen_default"]
    assert _close(f["allocated"], peak_alloc) and f["peak_reserved"] == peak_resv
    assert f["unused"] == f["reserved"] - f["allocated"] - f["pending_free"]
    assert 0.3 < f["unused_fraction"] < 0.5 and f["expandable_segments"] is False  # the manifest's "about 40%"
    assert 0 < f["largest_free"] <= f["free_in_split_segments"] <= f["unused"]

    doc = _doctor_json(fixtures / "fsdp1_meta_nosync_rank0.pickle", fixtures / "fsdp1_meta_nosync_rank1.pickle")
    f = _figures(doc, "imbalance")
    peaks = {p["rank"]: p["peak_allocated"] for p in f["peaks"]}
    assert all(_close(peaks[r], TRUTH[f"fsdp1_meta_nosync_rank{r}"][0]) for r in (0, 1))
    assert f["outlier_rank"] == 0 and f["others_median"] == peaks[1]
    assert f["ratio"] == pytest.approx(peaks[0] / peaks[1])
    assert f["category"] == "parameters" and f["category_difference"] < 0  # rank 0's parameters never reached its GPU
    by_rank = {p["rank"]: p for p in f["peaks"]}
    assert all(by_rank[r]["peak_reserved"] == TRUTH[f"fsdp1_meta_nosync_rank{r}"][1] for r in (0, 1))
    assert by_rank[0]["category_bytes"] == 0 < by_rank[1]["category_bytes"]
    assert f["category_difference"] == by_rank[0]["category_bytes"] - by_rank[1]["category_bytes"]

    doc = _doctor_json(fixtures / "fsdp2_train_rank0.pickle", fixtures / "fsdp2_train_rank1.pickle")
    f = _figures(doc, "balanced")
    assert _close(f["min"], TRUTH["fsdp2_train_rank0"][0]) and _close(f["max"], TRUTH["fsdp2_train_rank1"][0])
    assert 0 <= f["spread"] < 0.1
    assert [(p["rank"], p["peak_reserved"]) for p in f["peaks"]] == [(r, TRUTH[f"fsdp2_train_rank{r}"][1])
                                                                      for r in (0, 1)]
    f = _figures(doc, "fsdp_buffers")
    cm = doc["snapshots"][0]["category_max"]
    assert f["rank"] == 0 and f["all_gather"] == cm["fsdp_all_gather"] > 0
    assert f["reduce_scatter"] == cm["fsdp_reduce_scatter"] > 0


def _oom_on(fixtures, tmp_path, asked, device_free, conf="", shardfit=None):
    """varlen_default with an OOM appended at the dump: the OOM's layout is the dump's, whose totals MANIFEST gives.
    The fixture is our own file, so plain pickle may read it."""
    data = pickle.loads((fixtures / "varlen_default.pickle").read_bytes())
    trace = data["device_traces"][0]
    trace.append({"action": "oom", "device_free": device_free, "size": asked, "stream": 0,
                  "time_us": trace[-1]["time_us"] + 1, "frames": []})
    data["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if shardfit is not None:
        data["shardfit"] = shardfit
    path = tmp_path / "oom_rank0.pickle"
    path.write_bytes(pickle.dumps(data))
    return path


def test_oom_figures_on_a_real_layout_and_the_cap(fixtures, tmp_path):
    _, _, resv = TRUTH["varlen_default"]
    path = _oom_on(fixtures, tmp_path, 2 * GB, 0)
    (res,), findings = examine([str(path)])
    f = next(x for x in findings if x.code == "oom").figures
    assert (f["reserved"], f["allocated"], f["asked"], f["device_free"]) == (resv, ALLOC_AT_DUMP["varlen_default"],
                                                                              2 * GB, 0)
    assert f["free_in_segments"] == res.replay.end.free_in_segments and f["largest_free"] < 2 * GB
    # Whole free segments (c10 would release them before failing) cover 2 GiB: no cap known, so one unrecorded
    assert f["releasable"] >= 2 * GB and f["memory_cap"] is None and f["cause"] == "unrecorded_memory_cap"

    kept = resv - f["releasable"]  # what stays reserved after c10 releases the empty segments
    # A cap below what stays reserved leaves no headroom: the split holes alone decide, then the cap
    for asked, cause in ((f["free_in_split_segments"] // 2, "fragmentation"), (2 * GB, "memory_cap")):
        (_,), findings = examine([str(_oom_on(fixtures, tmp_path, asked, 0))], memory_fraction=0.5,
                                 device_memory=kept)
        g = next(x for x in findings if x.code == "oom").figures
        assert g["memory_cap"] == kept // 2 and g["headroom"] == 0 and g["cause"] == cause
        assert g["memory_fraction_source"] == "given" and g["device_total_source"] == "given"
    assert g["would_fit"] == {"expandable_segments": False, "pending_completed": False,
                              "expandable_segments_and_pending_completed": False, "no_memory_cap": True}


@pytest.mark.parametrize("source", ["given", "allocator_settings", "recorded"])
def test_issue_example_and_the_cap_from_each_source(tmp_path, source):
    """The issue's snapshot: 2 GiB asked, largest free block 1 GiB, 4 GiB free in split segments."""
    blocks = [(i * GB, GB, "active_allocated" if i % 2 == 0 else "inactive", FWD if i % 2 == 0 else [])
              for i in range(8)]  # live 1 | hole 1 | ... over one 8 GiB segment
    path = write_snapshot(tmp_path / "a.pickle", [seg(A, 8 * GB, blocks)], [ev("oom", 0, 2 * GB, device_free=0)])
    (_,), findings = examine([str(path)])
    f = next(x for x in findings if x.code == "oom")
    assert (f.figures["asked"], f.figures["largest_free"], f.figures["free_in_split_segments"]) == (2 * GB, GB, 4 * GB)
    assert f.figures["cause"] == "fragmentation" and f.figures["would_fit"]["expandable_segments"]
    assert "2.00 GiB" in f.title and "1.00 GiB" in f.evidence[0] and "4.00 GiB" in f.evidence[0]

    # 6 GiB asked with 40 GiB free on the device: only a cap explains the OOM; how big it is decides the verdict
    trace = [ev("oom", 0, 6 * GB, device_free=40 * GB)]
    (_,), findings = examine([str(write_snapshot(tmp_path / "b.pickle", [seg(A, 8 * GB, blocks)], trace))])
    assert next(x for x in findings if x.code == "oom").figures["cause"] == "unrecorded_memory_cap"
    for fraction, cause, headroom in ((0.1, "memory_cap", 0), (0.15, "fragmentation", 4 * GB)):
        paths, kw = _capped(tmp_path, source, fraction, [seg(A, 8 * GB, blocks)], trace)
        (res,), findings = examine(paths, **kw)
        f = next(x for x in findings if x.code == "oom")
        assert res.memory_fraction == fraction and res.memory_fraction_source == source
        assert f.figures["memory_cap"] == int(fraction * 80 * GB) and f.figures["headroom"] == headroom
        assert f.figures["cause"] == cause
        if cause == "memory_cap":
            assert "per-process memory cap refused" in f.title and "at least 0.175" in f.fix[0]  # (8 + 6) / 80 GiB
        else:
            assert "expandable_segments:True would have let this request through" in f.fix[0]


def _capped(tmp_path, source, fraction, segments, trace):
    """(paths, keyword arguments) for examine: a snapshot whose cap, on an 80 GiB device, comes from `source`."""
    kw, conf, data = {"device_memory": 80 * GB}, "", {}
    if source == "given":
        kw["memory_fraction"] = fraction
    elif source == "allocator_settings":
        conf = f"expandable_segments:False,per_process_memory_fraction:{fraction}"
    else:
        kw, data["shardfit"] = {}, {"memory_fraction": fraction, "device_total": 80 * GB}
    data.update(segments=segments, device_traces=[trace], external_annotations=[],
                allocator_settings={"expandable_segments": False, "PYTORCH_CUDA_ALLOC_CONF": conf})
    path = tmp_path / f"{source}{fraction}.pickle"
    path.write_bytes(pickle.dumps(data))
    return [str(path)], kw


def test_device_total_estimated_and_bad_fraction_refused(tmp_path):
    path = write_snapshot(tmp_path / "c.pickle", [seg(A, 4 * GB, [(0, 4 * GB, "active_allocated", FWD)])],
                          [ev("oom", 0, GB, device_free=12 * GB)])
    (_,), findings = examine([str(path)], memory_fraction=0.25)
    f = next(x for x in findings if x.code == "oom").figures
    assert f["device_total"] == 16 * GB and f["device_total_source"] == "estimate"  # reserved + driver-free
    assert f["memory_cap"] == 4 * GB and f["cause"] == "memory_cap"
    with pytest.raises(ShardfitError, match="--memory-fraction"):
        examine([str(path)], memory_fraction=1.5)


def test_shardfit_snapshots_record_the_cap_pytorch_leaves_out(tmp_path, monkeypatch):
    """record.py adds the device total and the per-process fraction to what _dump_snapshot would write; the doctor
    reads them back (CUDA calls stubbed: this runs on CPU)."""
    import types

    import torch

    from shardfit.doctor.record import SnapshotRecorder

    blocks = [(0, 3 * GB, "active_allocated", FWD)]
    snap = {"segments": [seg(A, 3 * GB, blocks)], "device_traces": [[ev("oom", 0, 2 * GB, device_free=60 * GB)]],
            "allocator_settings": {"expandable_segments": False, "PYTORCH_CUDA_ALLOC_CONF": ""}}
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: dict(snap))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: 0.05, raising=False)
    path = SnapshotRecorder("", tmp_path, 0, torch.device("cpu"), 10).dump_oom(7)
    assert path is None  # not a CUDA run: nothing dumped
    rec = SnapshotRecorder("", tmp_path, 0, torch.device("cuda", 0), 10)
    path = rec.dump_oom(7)
    assert path.name == "oom_step000007_rank0.pickle" and not list(tmp_path.glob("*.tmp"))
    (res,), findings = examine([str(path)])
    f = next(x for x in findings if x.code == "oom").figures
    assert (res.memory_fraction, res.memory_fraction_source) == (0.05, "recorded")
    assert (f["device_total"], f["device_total_source"], f["memory_cap"]) == (80 * GB, "recorded", 4 * GB)
    assert f["headroom"] == GB and f["cause"] == "memory_cap"  # 3 GiB reserved under a 4 GiB cap; 2 GiB asked
