"""The figures hold every number the sentences quote; per-rank figures stay whole bytes; a cap known to be absent
(fraction 1.0) is not blamed on an unrecorded one; the CLI's --memory-fraction and --gpu-memory reach the verdict."""

import re

import pytest

from shardfit.doctor import examine
from shardfit.doctor.diagnose import gib
from tests.doctor.conftest import MB, ev, seg, write_snapshot
from tests.doctor.test_figures import _capped, _doctor, _doctor_json, _figures

GB = 1 << 30
A, B = 0x7F0000000000, 0x7F8000000000
FWD = [{"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 1}]
# The layout: live 1 GiB | hole 1 GiB | ... over one 8 GiB segment
HOLES = [seg(A, 8 * GB, [(i * GB, GB, "active_allocated" if i % 2 == 0 else "inactive", FWD if i % 2 == 0 else [])
                         for i in range(8)])]
SIZE = re.compile(r"(-?\d+\.\d+ [GM]iB)")


def _numbers(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        for y in x:
            yield from _numbers(y)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def _assert_quoted_sizes_are_figures(findings):
    for f in findings:
        shown = {gib(v) for v in _numbers(f.figures)}
        for text in [f.title, *f.evidence, *f.fix]:
            missing = set(SIZE.findall(text)) - shown
            assert not missing, f"{f.code}: {missing} quoted in {text!r} but not in its figures"


def test_every_quoted_size_is_a_figure_on_the_fixtures(fixtures):
    codes = set()
    for names in (["varlen_default"], ["record_stream_pending"], ["fsdp1_meta_nosync_rank0", "fsdp1_meta_nosync_rank1"],
                  ["fsdp2_train_rank0", "fsdp2_train_rank1"]):
        _, findings = examine([str(fixtures / f"{n}.pickle") for n in names])
        _assert_quoted_sizes_are_figures(findings)
        codes |= {f.code for f in findings}
    assert codes == {"fragmentation", "pending_free", "imbalance", "balanced", "fsdp_buffers"}


def test_every_quoted_size_is_a_figure_on_synthetic_ooms_and_side_streams(tmp_path):
    trace = [ev("oom", 0, 6 * GB, device_free=40 * GB)]
    paths = [str(write_snapshot(tmp_path / "a.pickle", HOLES, [ev("oom", 0, 2 * GB, device_free=0)]))]
    for fraction in (0.1, 0.15):
        paths += _capped(tmp_path, "recorded", fraction, HOLES, trace)[0]
    # 4 GiB of tensors on the compute stream, 2 GiB idle in a side stream's pool
    side = [seg(A, 4 * GB, [(0, 4 * GB, "active_allocated", FWD)]), seg(B, 2 * GB, [(0, 2 * GB, "inactive", [])], 7)]
    paths.append(str(write_snapshot(tmp_path / "side.pickle", side, [ev("alloc", A, 4 * GB, frames=FWD)])))
    codes = set()
    for p in paths:
        _, findings = examine([p])
        _assert_quoted_sizes_are_figures(findings)
        codes |= {f.code for f in findings}
    assert {"oom", "side_stream_cache"} <= codes
    f = next(f for f in examine([paths[0]])[1] if f.code == "oom").figures
    assert f["categories"] == {"activations": 4 * GB} and f["pending_blocks"] == 0


def test_three_ranks_figures_are_whole_bytes(tmp_path):
    """The others' median of an even count is a half: the figures round it down instead of turning floats."""
    paths = []
    for rank, size in enumerate((10 * MB, 100 * MB, 100 * MB + 1)):
        segments = [seg(A, 128 * MB, [(0, size, "active_allocated", FWD), (size, 128 * MB - size, "inactive", [])])]
        trace = [ev("alloc", A, size, frames=FWD)]
        paths.append(str(write_snapshot(tmp_path / f"x_rank{rank}.pickle", segments, trace)))
    _, findings = examine(paths)
    f = next(x for x in findings if x.code == "imbalance")
    g = f.figures
    assert f.rank == g["outlier_rank"] == 0 and g["category"] == "activations"
    assert g["others_median"] == 100 * MB and type(g["others_median"]) is int
    assert g["category_difference"] == -90 * MB and type(g["category_difference"]) is int
    assert [(p["rank"], p["peak_allocated"], p["peak_reserved"], p["category_bytes"]) for p in g["peaks"]] == [
        (0, 10 * MB, 128 * MB, 10 * MB), (1, 100 * MB, 128 * MB, 100 * MB), (2, 100 * MB + 1, 128 * MB, 100 * MB + 1)]


@pytest.mark.parametrize("source", ["recorded", "allocator_settings"])
def test_a_fraction_of_one_is_known_to_be_no_cap(tmp_path, source):
    """6 GiB asked with 40 GiB free on the device: blamed on an unrecorded cap unless the snapshot says there is none,
    and then unexplained (another process?), the cap being the whole device."""
    trace = [ev("oom", 0, 6 * GB, device_free=40 * GB)]
    paths, kw = _capped(tmp_path, source, 1.0, HOLES, trace)
    (res,), findings = examine(paths, **kw)
    f = next(x for x in findings if x.code == "oom")
    assert (res.memory_fraction, res.memory_fraction_source) == (1.0, source)
    assert f.figures["memory_cap"] == 80 * GB and f.figures["headroom"] == 40 * GB
    assert f.figures["cause"] == "unexplained" and not f.figures["would_fit"]["no_memory_cap"]
    assert "free on the device" in f.fix[0] and "cap allowed" not in f.fix[0]


def test_cli_cap_flags_change_the_verdict(tmp_path):
    path = write_snapshot(tmp_path / "b.pickle", HOLES, [ev("oom", 0, 6 * GB, device_free=40 * GB)])
    assert _figures(_doctor_json(path), "oom")["cause"] == "unrecorded_memory_cap"
    for fraction, cause, headroom in (("0.1", "memory_cap", 0), ("0.15", "fragmentation", 4 * GB)):
        doc = _doctor_json("--memory-fraction", fraction, "--gpu-memory", "80", path)
        f = _figures(doc, "oom")
        assert (f["memory_cap"], f["headroom"], f["cause"]) == (int(float(fraction) * 80 * GB), headroom, cause)
        assert (f["device_total"], f["device_total_source"]) == (80 * GB, "given")
        assert doc["snapshots"][0]["memory_fraction"] == float(fraction)
    for flag, value in (("--memory-fraction", "1.5"), ("--gpu-memory", "0")):
        p = _doctor(flag, value, path)
        assert p.returncode == 2 and f"{flag}:" in p.stderr and not p.stdout
