"""`shardfit doctor`: load snapshots (one per rank), replay, diagnose, report."""

from __future__ import annotations

from shardfit.memory.diagnose import Finding, RankResult, diagnose, rank_of
from shardfit.memory.replay import replay
from shardfit.memory.snapshot import collect_paths, load_snapshot


def examine(specs: list[str]) -> tuple[list[RankResult], list[Finding]]:
    paths = collect_paths(specs)
    results = [RankResult(rank_of(str(p), i), replay(load_snapshot(p))) for i, p in enumerate(paths)]
    results.sort(key=lambda x: x.rank)
    return results, diagnose(results)
