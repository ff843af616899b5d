"""`shardfit doctor`: load snapshots (one per rank), replay, diagnose, report."""

from __future__ import annotations

from shardfit.doctor.cap import CapSettings, fraction_of
from shardfit.doctor.diagnose import Finding, RankResult, diagnose, rank_of
from shardfit.doctor.replay import replay
from shardfit.doctor.snapshot import collect_paths, load_snapshot


def examine(specs: list[str], memory_fraction: float | None = None,
            device_memory: int | None = None) -> tuple[list[RankResult], list[Finding]]:
    """memory_fraction: the per-process cap (torch.cuda.set_per_process_memory_fraction), which snapshots do not
    record; device_memory: the GPU's total bytes, which they do not record either (doctor/cap.py: where else the
    doctor looks for both)."""
    given = CapSettings(memory_fraction, device_memory)
    paths = collect_paths(specs)
    results = []
    for i, p in enumerate(paths):
        snap = load_snapshot(p)
        results.append(RankResult(rank_of(str(p), i), replay(snap), *fraction_of(snap, given)))
    results.sort(key=lambda x: x.rank)
    return results, diagnose(results, given)
