"""Memory: the in-training monitor (and, with issue 4, the snapshot doctor)."""

from shardfit.memory.monitor import MemoryMonitor

__all__ = ["MemoryMonitor"]
