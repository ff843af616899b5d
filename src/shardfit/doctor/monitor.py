"""Watches the per-rank memory figures that the step's single stats collective (the Engine's) brings every log step.

It warns about the two things that precede most sharded-run OOMs: allocator retries (cudaMalloc failed, the cache
was flushed and the request retried: slow, and one step from an OOM) and reserved memory that keeps growing after
warm-up (fragmentation: the cache holds segments whose free blocks no request fits).
"""

from __future__ import annotations


class MemoryMonitor:
    def __init__(self, growth_warn_gib: float, warmup_logs: int = 1):
        self.growth_warn_gib = growth_warn_gib
        self.warmup_logs = warmup_logs  # the first log steps may still grow (optimizer state, caches)
        self.seen = 0
        self.last_reserved: float | None = None
        self.last_retries = 0.0

    def update(self, mem: dict[str, float]) -> list[str]:
        """mem: summarize_memory() output (GiB and counts, min/max over ranks). Returns warnings to print."""
        warnings = []
        self.seen += 1
        if mem["alloc_retries_max"] > self.last_retries:
            warnings.append(f"warning: {mem['alloc_retries_max']:.0f} allocator retries on the worst rank (cudaMalloc "
                            "failed and the cache was flushed): lower train.micro_batch or enable checkpointing")
        grown = mem["reserved_max"] - self.last_reserved if self.last_reserved is not None else 0.0
        if self.seen > self.warmup_logs + 1 and grown > self.growth_warn_gib:
            warnings.append(f"warning: reserved memory grew {grown * 1024:.0f} MiB since the last log step "
                            f"(now {mem['reserved_max']:.2f} GiB on the worst rank): fragmentation? "
                            "record snapshots and run shardfit doctor")
        self.last_reserved, self.last_retries = mem["reserved_max"], mem["alloc_retries_max"]
        return warnings
