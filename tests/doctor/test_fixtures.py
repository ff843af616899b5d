"""The doctor against real H200 snapshots and the ground truth in their MANIFEST.md."""

import json
import subprocess
import sys

import pytest

from shardfit.doctor import examine

# file: (peak allocated, peak reserved, reserved at dump) as torch.cuda.memory_stats() read them (MANIFEST.md)
TRUTH = {
    "varlen_default": (9234807808, 15397289984, 15397289984),
    "varlen_expandable": (9222421504, 9439281152, 9439281152),
    "record_stream_pending": (653242368, 3925868544, 3925868544),
    "fsdp2_train_rank0": (4765467648, 5901385728, 5901385728),
    "fsdp2_train_rank1": (4765467648, 5901385728, 5901385728),
    "fsdp1_meta_nosync_rank0": (671154176, 740294656, 740294656),
    "fsdp1_meta_nosync_rank1": (3355836416, 3428843520, 3428843520),
}


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_replay_matches_measured_peaks(fixtures, name):
    (res,), _ = examine([str(fixtures / f"{name}.pickle")])
    peak_alloc, peak_resv, resv_dump = TRUTH[name]
    assert abs(res.replay.peak.allocated - peak_alloc) / peak_alloc < 0.01
    assert res.replay.end.reserved == resv_dump
    assert res.replay.peak_reserved == peak_resv


def _codes(findings):
    return {f.code: f for f in findings}


def test_fragmentation_found_only_without_expandable_segments(fixtures):
    _, findings = examine([str(fixtures / "varlen_default.pickle")])
    frag = _codes(findings)["fragmentation"]
    assert "expandable_segments:True" in frag.fix[0]
    (res,), _ = examine([str(fixtures / "varlen_default.pickle")])
    p = res.replay.peak
    assert 0.3 < (p.reserved - p.allocated) / p.reserved < 0.5  # the manifest's "about 40%"
    assert p.free_in_split_segments > 0
    _, findings = examine([str(fixtures / "varlen_expandable.pickle")])
    assert "fragmentation" not in _codes(findings)


def test_record_stream_pending_blocks(fixtures):
    (res,), findings = examine([str(fixtures / "record_stream_pending.pickle")])
    f = _codes(findings)["pending_free"]
    assert res.replay.end.pending_blocks == 6 and res.replay.end.pending_free == 6 * 512 * 2**20
    assert res.replay.end.reserved > 5 * res.replay.end.allocated  # reserved several times the live tensors
    assert any("record_stream" in x for x in f.fix) and "TORCH_NCCL_AVOID_RECORD_STREAMS=1" in " ".join(f.fix)


def test_fsdp1_meta_init_imbalance(fixtures):
    results, findings = examine([str(fixtures / "fsdp1_meta_nosync_rank0.pickle"),
                                 str(fixtures / "fsdp1_meta_nosync_rank1.pickle")])
    f = _codes(findings)["imbalance"]
    assert f.rank == 0 and "parameters never reached" in f.title
    ratio = results[0].replay.peak.allocated / results[1].replay.peak.allocated
    assert 0.15 < ratio < 0.25  # "about a fifth"
    assert "sync_module_states=True" in f.fix[0] and "device_id" in f.fix[0]


def test_fsdp2_balanced_with_visible_buffers(fixtures):
    results, findings = examine([str(fixtures / "fsdp2_train_rank0.pickle"),
                                 str(fixtures / "fsdp2_train_rank1.pickle")])
    codes = _codes(findings)
    assert "balanced" in codes and "imbalance" not in codes
    cm = results[0].replay.category_max
    assert cm["fsdp_all_gather"] > 0 and cm["fsdp_reduce_scatter"] > 0


def test_cli_text_and_json(fixtures):
    args = [sys.executable, "-m", "shardfit", "doctor"]
    p = subprocess.run(args + [str(fixtures / "record_stream_pending.pickle")], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("shardfit doctor: 3.00 GiB held for other streams")
    p = subprocess.run(args + ["--json", str(fixtures / "fsdp1_meta_nosync_rank0.pickle"),
                               str(fixtures / "fsdp1_meta_nosync_rank1.pickle")], capture_output=True, text=True)
    doc = json.loads(p.stdout)
    assert doc["schema"] == "shardfit.doctor/1" and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert {"allocated", "reserved", "pending_free", "largest_free", "categories", "per_stream"} <= set(
        doc["snapshots"][0]["peak"])
    p = subprocess.run(args + [str(fixtures / "MANIFEST.md")], capture_output=True, text=True)
    assert p.returncode == 2 and "MANIFEST.md: not a readable pickle" in p.stderr


def test_timeline_samples_add_up_and_pictures_render(fixtures, tmp_path):
    pytest.importorskip("matplotlib")
    results, _ = examine([str(fixtures / "varlen_default.pickle")])
    r = results[0].replay
    assert len(r.samples) > 1000
    for j, cats in r.samples[::97]:  # each sample's categories add up to the replayed allocated bytes
        assert sum(cats.values()) == r.allocated[j]
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    p = subprocess.run([sys.executable, "-m", "shardfit", "doctor", str(fixtures / "fsdp1_meta_nosync_rank0.pickle"),
                        str(fixtures / "fsdp1_meta_nosync_rank1.pickle"), f"--png={png}", f"--html={page}"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text()
    assert "data:image/png;base64," in text and "parameters never reached its GPU" in text
    assert not list(tmp_path.glob("*.tmp"))
