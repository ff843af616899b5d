"""Memory: the in-training monitor and the snapshot doctor."""

from shardfit.memory.doctor import examine
from shardfit.memory.monitor import MemoryMonitor
from shardfit.memory.snapshot import load_snapshot
from shardfit.safe_pickle import SafeUnpickler

__all__ = ["MemoryMonitor", "SafeUnpickler", "examine", "load_snapshot"]
