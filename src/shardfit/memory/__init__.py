"""Memory: the in-training monitor and the snapshot doctor."""

from shardfit.memory.doctor import examine
from shardfit.memory.monitor import MemoryMonitor
from shardfit.memory.snapshot import SafeUnpickler, load_snapshot

__all__ = ["MemoryMonitor", "SafeUnpickler", "examine", "load_snapshot"]
